"""Where a run's seconds outside training go: ``edgefl run`` as a user types it, timed from outside, phase by
phase, beside Flower's own FedAvg (``--strategy flower-fedavg``) on the same testbed.

Each run is the command in a process of its own, watched every 20 ms from here: when its config is written, the
SuperLink serves, every agent is ready (its data loaded), every SuperNode has joined, the run is submitted, the
ServerApp logs, round 1's first message is pushed (messages.jsonl: the server's monotonic clock, which is this
host's), the last round's last reply is pulled, the last row is written, summary.json is written, the run's
processes are gone, and the command exits. The edgefl run is made twice: first with an empty cache
(``XDG_CACHE_HOME`` a fresh folder: the split is computed), then warm; Flower's after them, warm; last, ``edgefl run
--federation remote`` against an ``edgefl server`` and clients started (and joined) before it, on loopback in plain
text: what a run costs when its devices are already running.

    python bench/startup.py [--clients 4] [--rounds 3] [--profile loopback]

result.json: ``time_to_first_round_s`` (warm), ``eval_lag_s`` (last row − last reply), ``teardown_s`` (summary.json
→ processes gone), ``exit_after_training_s`` (last reply → the command's exit), ``outside_training_s`` (the run's
whole time less its training wall clock), the cold run's, Flower's and the remote one's beside
(``remote_time_to_first_round_s``), every phase of each run, and the
CPU seconds of each process's imports and of one evaluation (torch as before, onnxruntime now: the Evaluator's way,
and with the parameters fed as inputs), measured first.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

from results import write_result

from contract.run_folder import CONFIG, MESSAGES, ROUNDS, SERVER_LOG, SUMMARY, read_rounds
from edgefl.processes import ProcessGroup, free_port, process_tree, tail

POLL_S = 0.02
TIMEOUT_S = 900.0
PHASES = (  # name, what it marks
    ("config", "config.toml written"),
    ("superlink", "SuperLink serving"),
    ("agents_ready", "every agent's data loaded"),
    ("nodes_joined", "every SuperNode joined"),
    ("submitted", "the run announced (flwr run returned, every agent ready)"),
    ("server_app", "the ServerApp's first log line"),
    ("first_round", "round 1's first message pushed"),
    ("last_reply", "the last round's last reply pulled"),
    ("last_row", "the last row written"),
    ("summary", "summary.json written"),
    ("stopped", "the run's processes gone"),
    ("exit", "the command exited"),
)


def logged(path: Path, text: str) -> bool:
    try:
        return text in path.read_text(errors="replace")
    except OSError:
        return False


class Watch:
    """Records, on this host's monotonic clock, the first poll at which each phase's condition held."""

    def __init__(self, run_dir: Path, clients: int, agents: bool) -> None:
        logs = run_dir / "logs"
        self.seen: dict[str, float] = {}
        self.checks: dict[str, Callable[[], bool]] = {
            "config": (run_dir / CONFIG).exists,
            "superlink": lambda: logged(logs / "superlink.log", "Uvicorn running on"),
            "nodes_joined": lambda: all(logged(logs / f"supernode-{i}.log", "SuperNode ID:") for i in range(clients)),
            "server_app": (run_dir / SERVER_LOG).exists,
            "summary": (run_dir / SUMMARY).exists,
        }
        if agents:
            self.checks["agents_ready"] = lambda: all((run_dir / f".node-{i}.ready").exists() for i in range(clients))

    def poll(self) -> None:
        now = time.monotonic()
        for name, check in self.checks.items():
            if name not in self.seen and check():
                self.seen[name] = now


def descendants(pid: int) -> set[int]:
    """The live descendants of ``pid`` (the processes a run started)."""
    return set(process_tree([pid])) - {pid}


def timed_run(argv: list[str], run_dir: Path, clients: int, agents: bool, env: dict[str, str]) -> dict[str, float]:
    """Run ``argv`` (an ``edgefl run``) and return each phase's seconds since it started."""
    shutil.rmtree(run_dir, ignore_errors=True)
    watch = Watch(run_dir, clients, agents)
    started = time.monotonic()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    lines: list[str] = []

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("run ") and "submitted" not in watch.seen:
                watch.seen["submitted"] = time.monotonic()
            if line.startswith("round "):
                print(f"  {line.rstrip()}", flush=True)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    rows = 0
    while proc.poll() is None:
        watch.poll()
        if (count := len(read_rounds(run_dir))) != rows:
            rows = count
            watch.seen["row"] = time.monotonic()
        if "summary" in watch.seen and "stopped" not in watch.seen and not descendants(proc.pid):
            watch.seen["stopped"] = time.monotonic()
        if time.monotonic() - started > TIMEOUT_S:
            proc.kill()
            raise SystemExit(f"{argv} did not end within {TIMEOUT_S:.0f} s")
        time.sleep(POLL_S)
    watch.seen["exit"] = time.monotonic()
    reader.join()
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed:\n{''.join(lines[-20:])}")
    watch.seen.setdefault("stopped", watch.seen["exit"])
    watch.seen["last_row"] = watch.seen.pop("row")
    trips = read_rounds(run_dir, MESSAGES)
    training = [t for t in trips if t["rounds"]] or trips  # edgefl's identify messages carry no round; Flower's
    watch.seen["first_round"] = min(t["sent_at"] for t in training)  # trips name none
    watch.seen["last_reply"] = max(t["sent_at"] + t["round_trip_s"] for t in training)
    phases = {name: round(watch.seen[name] - started, 2) for name, _ in PHASES if name in watch.seen}
    phases["training_wall_s"] = round(json.loads((run_dir / SUMMARY).read_text())["wall_clock_s"], 2)
    phases["rows"] = len(read_rounds(run_dir, ROUNDS))
    return phases


IMPORTS = {  # what each process imports before it can do its part, as `python -c "import ..."`
    "an agent": "torch, fl_client.tasks, edge.agent, fl_client.app",
    "a SuperNode": "fl_client.supernode, flwr.supernode.start_client_internal",
    "a ServerApp: flwr-serverapp, then edgefl's (now once per server, forked)": "flwr.superlink.cli, fl_server.app",
    "flwr run: Flower's CLI (now called in the command's own process)": "flwr.cli.app",
}
EVALUATION = """
import itertools, json, math, time
import torch
from fl_server.engine import EVALUATION_BATCH
from ml.data import load_dataset
from ml.model_card import build_card
from ml.models import build_model
from ml.onnx import INPUT_NAME, OUTPUT_NAME, inference_session, scores, with_parameters
from ml.trainer import evaluate
torch.set_num_threads(1)
data = load_dataset("fashion-mnist")
model = build_model(data, 0, "auto")
card = build_card(data, 0, "auto")
x, y = data.x_test, data.y_test
def evaluate_onnx(session, fed):
    for i in range(0, len(y), EVALUATION_BATCH):
        inputs = {INPUT_NAME: x[i : i + EVALUATION_BATCH], **fed}
        scores(session.run([OUTPUT_NAME], inputs)[0], y[i : i + EVALUATION_BATCH])
def fed_as_inputs():
    ends = [0, *itertools.accumulate(math.prod(shape) for _, shape in card.layout)]
    fed = {name: card.params[a:b].reshape(shape) for (name, shape), a, b in zip(card.layout, ends, ends[1:])}
    evaluate_onnx(inference_session(card.graph, 1), fed)
def cpu(work):
    start = time.process_time()
    work()
    return round(time.process_time() - start, 2)
print(json.dumps({
    "torch, NCHW (before)": cpu(lambda: evaluate(model, x, y)),
    "onnxruntime, parameters fed as inputs": cpu(fed_as_inputs),
    "onnxruntime, parameters baked into the graph (now)": cpu(
        lambda: evaluate_onnx(inference_session(with_parameters(card.graph, card.params, card.layout), 1), {})
    ),
}))
"""


def remote_run(edgefl: str, common: list[str], args: argparse.Namespace, env: dict[str, str]) -> dict[str, float]:
    """``edgefl run --federation remote`` timed as ``timed_run`` times a local one, against ``edgefl server`` and
    ``args.clients`` ``edgefl client`` processes started before it and joined (plain text on loopback: the devices'
    start-up is not the run's)."""
    port = free_port()
    home = (args.out / "remote").resolve()
    shutil.rmtree(home, ignore_errors=True)  # the logs of an earlier bench name another server's address
    with ProcessGroup(home / "processes", env) as procs:
        procs.start("edgefl-server", [edgefl, "server", "--listen", f"127.0.0.1:{port}", "--insecure",
                                      "--allow-any-device", "--out", str(home / "server")])  # fmt: skip
        server_log = procs.log_dir / "edgefl-server.log"
        procs.wait_until("edgefl server", lambda: "--federation remote --server" in tail(server_log, 50), TIMEOUT_S)
        local = tail(server_log, 50).split("--federation remote --server ")[1].split()[0]
        for i in range(args.clients):
            procs.start(f"client-{i}", [edgefl, "client", "--server", f"127.0.0.1:{port}", "--insecure",
                                        "--partition-id", str(i), "--num-partitions", str(args.clients),
                                        "--dataset", "fashion-mnist", "--out", str(home / f"client-{i}")])  # fmt: skip
        for i in range(args.clients):
            log = procs.log_dir / f"client-{i}.log"
            procs.wait_until(f"client {i} to join", lambda log=log: "joined" in tail(log, 50), TIMEOUT_S)
        remote = [a for a in common if a not in ("--profile", args.profile)]
        argv = [edgefl, "run", "--strategy", "fedavg", *remote, "--federation", "remote", "--server", local,
                "--insecure", "--out", str(home / "run")]  # fmt: skip
        return timed_run(argv, home / "run", args.clients, False, env)


def cpu_seconds(code: str) -> tuple[float, str]:
    """The CPU seconds (user + system) of ``python -c CODE`` in a fresh process, and what it printed."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return round(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime, 2), done.stdout


def cpu_budget() -> dict[str, dict[str, float]]:
    """On an idle machine, before the runs: each process's imports, and one evaluation of the test split."""
    imports = {name: cpu_seconds(f"import {modules}")[0] for name, modules in IMPORTS.items()}
    evaluation = json.loads(cpu_seconds(EVALUATION)[1].splitlines()[-1])
    return {"imports_cpu_s": imports, "evaluation_cpu_s": evaluation}


def figures(phases: dict[str, float]) -> dict[str, float]:
    return {
        "time_to_first_round_s": phases["first_round"],
        "eval_lag_s": round(phases["last_row"] - phases["last_reply"], 2),
        "teardown_s": round(phases["stopped"] - phases["summary"], 2),
        "exit_after_training_s": round(phases["exit"] - phases["last_reply"], 2),
        "outside_training_s": round(phases["exit"] - phases["training_wall_s"], 2),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--local-steps", type=int, default=20)
    parser.add_argument("--profile", default="loopback")
    parser.add_argument("--out", type=Path, default=Path("runs/bench-startup"))
    args = parser.parse_args()
    edgefl = str(Path(sys.executable).parent / "edgefl")
    common = ["--dataset", "fashion-mnist", "--partition", "dirichlet:0.3", "--clients", str(args.clients),
              "--rounds", str(args.rounds), "--local-steps", str(args.local_steps), "--profile", args.profile,
              "--seed", "0"]  # fmt: skip
    print("CPU seconds of each process's imports, and of one evaluation ...", flush=True)
    budget = cpu_budget()
    runs: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory(prefix="edgefl-cold-cache-") as cold_cache:
        for name, strategy, cache in (
            ("edgefl, cold cache", "fedavg", cold_cache),
            ("edgefl", "fedavg", cold_cache),
            ("flower-fedavg", "flower-fedavg", cold_cache),
        ):
            print(f"{name}: edgefl run --strategy {strategy} ...", flush=True)
            env = {**os.environ, "XDG_CACHE_HOME": cache}
            run_dir = args.out / name.replace(", ", "-").replace(" ", "-")
            argv = [edgefl, "run", "--strategy", strategy, *common, "--out", str(run_dir)]
            runs[name] = timed_run(argv, run_dir, args.clients, strategy == "fedavg", env)
        print("remote: edgefl run --federation remote, against a server and clients already running ...", flush=True)
        runs["remote"] = remote_run(edgefl, common, args, {**os.environ, "XDG_CACHE_HOME": cold_cache})
    names = list(runs)
    lines = [
        f"# A run's fixed costs: {args.clients} clients, Fashion-MNIST, {args.rounds} rounds of {args.local_steps} "
        f"local steps, link {args.profile}",
        "",
        "Seconds since `edgefl run` started, at the first poll (20 ms) at which each held.",
        "",
        "| phase | " + " | ".join(names) + " |",
        "|---|" + "---|" * len(names),
    ]
    for phase, what in PHASES:
        cells = [f"{runs[n][phase]:.2f}" if phase in runs[n] else "—" for n in names]
        lines.append(f"| {what} | " + " | ".join(cells) + " |")
    lines.append(
        "| training (summary's wall_clock_s) | " + " | ".join(f"{runs[n]['training_wall_s']:.2f}" for n in names) + " |"
    )
    per_run = {name: figures(runs[name]) for name in names}
    for key in per_run["edgefl"]:
        lines.append(f"| **{key}** | " + " | ".join(f"{per_run[n][key]:.2f}" for n in names) + " |")
    warm, flower, cold = per_run["edgefl"], per_run["flower-fedavg"], per_run["edgefl, cold cache"]
    lines += [
        "",
        f"Round 1 starts {warm['time_to_first_round_s']:.1f} s after `edgefl run` (cold cache "
        f"{cold['time_to_first_round_s']:.1f} s; Flower's FedAvg {flower['time_to_first_round_s']:.1f} s: "
        f"{flower['time_to_first_round_s'] / warm['time_to_first_round_s']:.2f}x edgefl's); against a server and "
        f"devices already running, {per_run['remote']['time_to_first_round_s']:.1f} s.",
    ]
    lines += ["", "CPU seconds in a fresh process on this machine, idle, before the runs:", "",
              "| imports of | CPU s |", "|---|---|"]  # fmt: skip
    lines += [f"| {name} | {seconds:.2f} |" for name, seconds in budget["imports_cpu_s"].items()]
    lines += ["", "| one evaluation of the 10,000 test examples (the CNN), with | CPU s |", "|---|---|"]
    lines += [f"| {name} | {seconds:.2f} |" for name, seconds in budget["evaluation_cpu_s"].items()]
    result = {
        **warm,
        **budget,
        "cold_time_to_first_round_s": cold["time_to_first_round_s"],
        "flower_time_to_first_round_s": flower["time_to_first_round_s"],
        "remote_time_to_first_round_s": per_run["remote"]["time_to_first_round_s"],
        "flower_teardown_s": flower["teardown_s"],
        "flower_over_edgefl_first_round": round(flower["time_to_first_round_s"] / warm["time_to_first_round_s"], 2),
        "phases": runs,
    }
    write_result(args.out, "\n".join(lines), result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
