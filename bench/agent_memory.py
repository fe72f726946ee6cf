"""Where an edge agent's memory goes: the peak resident memory of a real agent process (``python -m
fl_client.node``) serving a whole run of a local federation beside its real SuperNode, for each model asked for,
and where it goes: the process's peak after each stage of starting a session and training a round, in
one fresh process, as on a device (VmHWM: ru_maxrss would count this script's own memory when it forked).

    python bench/agent_memory.py [--cases fashion-mnist:cnn,shakespeare:leaf-lstm] [--clients 2] [--rounds 4]

Each case is also run through ``edgefl server`` and one ``edgefl client`` a device (loopback, plain text), its agents
and SuperNodes as that command starts them.

result.json: ``peak_rss_mb`` (the highest agent's VmHWM over the cases), ``supernode_peak_rss_mb`` (its SuperNode's
beside it), ``client_peak_rss_mb`` and ``client_supernode_peak_rss_mb`` (the same as ``edgefl client`` starts
them), and per case each agent's and SuperNode's peak, the highest peak its replies reported (``client_health``),
``edgefl_client``'s, and the stages."""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from results import write_result

STAGES = "--stages"  # this script, run as the fresh process that measures the stages of one case
READY_TIMEOUT_S = 180.0


def vm_hwm_mb(pid: int) -> float:
    """The peak resident memory of the live process ``pid`` (VmHWM), in MB."""
    found = re.search(r"^VmHWM:\s+(\d+) kB", Path(f"/proc/{pid}/status").read_text(), re.MULTILINE)
    return int(found.group(1)) / 1024 if found else 0.0


def stages(dataset: str, model: str, partition: str, clients: int, local_steps: int) -> dict[str, float]:
    """This process's peak after each stage of starting partition 0's session and training its first round."""

    def peak_mb() -> float:
        return vm_hwm_mb(os.getpid())

    measured = {"python": peak_mb()}
    import torch

    torch.set_num_threads(1)
    measured["+ torch"] = peak_mb()
    import fl_client.tasks  # noqa: F401  (Flower's runtime client, as the agent's process holds it)

    measured["+ Flower's runtime client"] = peak_mb()
    from contract.settings import build_config
    from edge.agent import Session
    from ml.models import get_flat_params

    job = build_config(dataset=dataset, model=model, partition=partition, clients=clients,
                       local_steps=local_steps).client_job()  # fmt: skip
    session = Session(job, 0, clients)
    measured["+ a session: its partition, model, optimizer, codec"] = peak_mb()
    session.train_one_round(1, get_flat_params(session.model))  # from the model as built: the first global model
    measured["+ one round of training"] = peak_mb()
    return measured


def started_as_on_a_device(log_dir: Path, env: dict[str, str]) -> Any:
    """A federation's processes with each agent and SuperNode started as a device starts it (``python -m``), not
    forked from the local testbed's fork servers: a forked child's peak counts only the shared pages it touched,
    less than a device's agent, which loads them itself."""
    from edgefl.processes import ProcessGroup

    class AsOnADevice(ProcessGroup):
        def fork(self, server: Any, name: str, module: str, args: list[str], netns: str | None,
                 command: list[str]) -> Any:  # fmt: skip
            return self.start(name, command)

    return AsOnADevice(log_dir, env)


def served(dataset: str, model: str, args: argparse.Namespace) -> dict[str, Any]:
    """A whole run of ``args.rounds`` rounds served by a local federation of ``args.clients`` agents: each agent's
    and SuperNode's VmHWM once the run has ended (before they stop), and the highest peak the replies reported."""
    from contract.run_folder import read_rounds
    from contract.settings import build_config
    from edgefl.launcher import local_federation, run_on

    out = (args.out / f"{dataset}-{model}").resolve()
    config = build_config(dataset=dataset, model=model, partition=args.partition, clients=args.clients,
                          rounds=args.rounds, local_steps=args.local_steps, eval_examples=args.eval_examples,
                          out=str(out))  # fmt: skip
    with local_federation(config, out, progress=lambda line: None, processes=started_as_on_a_device) as federation:
        run_dir = run_on(federation, config, progress=lambda line: print(f"  {line}", flush=True))
        pids = {name: proc.pid for name, proc in federation.procs.procs}
        agents = [round(vm_hwm_mb(pids[f"agent-{i}"]), 1) for i in range(args.clients)]
        supernodes = [round(vm_hwm_mb(pids[f"supernode-{i}"]), 1) for i in range(args.clients)]
    reported = [report["peak_rss_mb"] for row in read_rounds(run_dir)
                for report in row["client_health"].values() if report.get("peak_rss_mb")]  # fmt: skip
    return {"agents_mb": agents, "supernodes_mb": supernodes, "reported_mb": max(reported, default=None),
            "rounds": len(read_rounds(run_dir))}  # fmt: skip


def as_edgefl_client_starts_it(dataset: str, model: str, args: argparse.Namespace) -> dict[str, Any]:
    """The same run through ``edgefl server`` and one ``edgefl client`` a device, on loopback in plain text: each
    agent and SuperNode as ``edgefl client`` starts them (no session built before the run's first message); their
    VmHWM once the run has ended (before they stop), and the highest peak the replies reported."""
    from contract.run_folder import read_rounds
    from edgefl.processes import free_port, process_tree

    out = (args.out / f"{dataset}-{model}-client").resolve()
    port, started = free_port(), []

    def edgefl(*argv: str) -> subprocess.Popen[bytes]:
        log = (out / f"{argv[0]}-{len(started)}.log").open("wb")
        proc = subprocess.Popen([sys.executable, "-m", "edgefl.cli", *argv], stdout=log, stderr=subprocess.STDOUT)
        started.append(proc)
        return proc

    def ready(path: Path, proc: subprocess.Popen[bytes]) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not path.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{proc.args} did not get ready (see {out})")
            time.sleep(0.2)  # polled: the command writes the file, nothing to wait on in another process

    out.mkdir(parents=True, exist_ok=True)
    address = f"127.0.0.1:{port}"
    try:
        server = edgefl("server", "--listen", address, "--insecure", "--allow-any-device", "--out", str(out / "server"),
                        "--ready-file", str(out / "server.ready"))  # fmt: skip
        ready(out / "server.ready", server)
        clients = [edgefl("client", "--server", address, "--insecure", "--partition-id", str(i), "--num-partitions",
                          str(args.clients), "--dataset", dataset, "--out", str(out / f"client-{i}"),
                          "--ready-file", str(out / f"client-{i}.ready")) for i in range(args.clients)]  # fmt: skip
        for i, client in enumerate(clients):
            ready(out / f"client-{i}.ready", client)
        run_dir = out / "run"  # submitted to the SuperLink on this machine, as the server's ready file says to
        local = (out / "server.ready").read_text().split("--federation remote --server ")[1].split()[0]
        submitted = subprocess.run(
            [sys.executable, "-m", "edgefl.cli", "run", "--federation", "remote", "--server", local, "--insecure",
             "--dataset", dataset, "--model", model, "--partition", args.partition, "--clients", str(args.clients),
             "--rounds", str(args.rounds), "--local-steps", str(args.local_steps), "--eval-examples",
             str(args.eval_examples), "--out", str(run_dir)], capture_output=True, text=True)  # fmt: skip
        if submitted.returncode != 0:
            raise RuntimeError(f"the run failed: {submitted.stderr.strip()[-300:]}")
        found: dict[str, list[float]] = {"agents_mb": [], "supernodes_mb": []}
        for client in clients:
            for pid in process_tree([client.pid]):
                command = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
                for module, key in ((b"fl_client.node", "agents_mb"), (b"fl_client.supernode", "supernodes_mb")):
                    if module in command:
                        found[key].append(round(vm_hwm_mb(pid), 1))
    finally:
        for proc in reversed(started):
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=60)
    reported = [report["peak_rss_mb"] for row in read_rounds(run_dir)
                for report in row["client_health"].values() if report.get("peak_rss_mb")]  # fmt: skip
    return {**found, "reported_mb": max(reported, default=None), "rounds": len(read_rounds(run_dir))}


def fresh_stages(dataset: str, model: str, args: argparse.Namespace) -> dict[str, float]:
    argv = [sys.executable, __file__, STAGES, dataset, model, args.partition, str(args.clients), str(args.local_steps)]
    return json.loads(subprocess.run(argv, check=True, capture_output=True, text=True).stdout.splitlines()[-1])


def main() -> int:
    if sys.argv[1:2] == [STAGES]:
        dataset, model, partition, clients, steps = sys.argv[2:]
        print(json.dumps(stages(dataset, model, partition, int(clients), int(steps))))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default="fashion-mnist:cnn,shakespeare:leaf-lstm", help="DATASET:MODEL,...")
    parser.add_argument("--partition", default="dirichlet:0.3", help="of the image data sets (text: natural)")
    parser.add_argument("--clients", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--local-steps", type=int, default=10)
    parser.add_argument("--eval-examples", type=int, default=500, help="the server's test sample (0: all)")
    parser.add_argument("--out", type=Path, default=Path("runs/bench-agent-memory"))
    args = parser.parse_args()
    cases: dict[str, dict[str, Any]] = {}
    lines = [f"{args.clients} clients, {args.rounds} rounds of {args.local_steps} local steps, FedAvg, loopback", ""]
    for case in args.cases.split(","):
        dataset, model = case.split(":")
        print(f"{case}: stages, then a served run", flush=True)
        partition = "natural" if dataset == "shakespeare" else args.partition
        of_case = argparse.Namespace(**{**vars(args), "partition": partition})
        measured = fresh_stages(dataset, model, of_case)
        run = served(dataset, model, of_case)
        client = as_edgefl_client_starts_it(dataset, model, of_case)
        measured["+ serving a run's messages (the agent's VmHWM)"] = max(run["agents_mb"])
        cases[case] = {**run, "stages_mb": measured, "edgefl_client": client}
        lines += [f"### {case} ({partition})", "", "| stage | peak RSS MB | added MB |", "|---|---|---|"]
        previous = 0.0
        for stage, mb in measured.items():
            lines.append(f"| {stage} | {mb:.0f} | {mb - previous:+.0f} |")
            previous = mb
        lines += ["", f"agents' VmHWM {run['agents_mb']} MB, their SuperNodes' {run['supernodes_mb']} MB; the highest "
                  f"peak the replies reported (client_health): {run['reported_mb']} MB", "",
                  f"as `edgefl client` starts them (a run through `edgefl server`): agents' VmHWM "
                  f"{client['agents_mb']} MB, their SuperNodes' {client['supernodes_mb']} MB; client_health "
                  f"{client['reported_mb']} MB", ""]  # fmt: skip
    peak_case = max(cases, key=lambda c: max(cases[c]["agents_mb"]))
    client_case = max(cases, key=lambda c: max(cases[c]["edgefl_client"]["agents_mb"]))
    figures = {"peak_rss_mb": max(cases[peak_case]["agents_mb"]),
               "supernode_peak_rss_mb": max(cases[peak_case]["supernodes_mb"]),
               "client_peak_rss_mb": max(cases[client_case]["edgefl_client"]["agents_mb"]),
               "client_supernode_peak_rss_mb": max(cases[client_case]["edgefl_client"]["supernodes_mb"]),
               "cases": cases}  # fmt: skip
    write_result(args.out, "\n".join(lines), figures)
    return 0


if __name__ == "__main__":
    sys.exit(main())
