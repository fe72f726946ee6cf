"""Where an emulated Pi's message time goes: the CPU a message cycle costs the device's messaging cores, and
DGA's message path against FedAvg's on the same link.

First, FedAvg over lan on four emulated Raspberry Pi 4s (the CNN on Fashion-MNIST, K = 5): the CPU time of each
device's two messaging cores (its SuperNode, and the agent's threads other than training: its cgroups'
``supernode`` and ``agent``, read per thread every ``SAMPLE_S``) over the run, per message cycle, in seconds of
this host's core and of a Pi core (host seconds / the messaging share, ``contract.devices``); idle polling is
included, as a device pays it. With ``py-spy`` installed, one device's SuperNode and agent are sampled for the
run and their samples sorted by what they were doing (``WHERE``: the Fleet requests, the Runtime API between
agent and SuperNode, the SuperNode's loop, the ClientApp). Then FedAvg and DGA:2 over each link: the median
message path R of each (``messages.jsonl``), a round's training T, DGA's path over FedAvg's, and DGA's rounds per
second over FedAvg's against what the link allows, min(1 + R/T, D + 1) with FedAvg's R and T.

    python bench/message_cost.py [--links lan,home-wifi,long-distance] [--rounds 12] [--out runs/bench-message-cost]

result.json: ``pi_core_s_per_cycle`` (both messaging cores, the median over devices), ``host_core_s_per_cycle``,
``per_process`` (SuperNode and agent), ``profile`` (py-spy's top functions, where it ran) and per link
``fedavg_path_s``, ``dga_path_s``, ``dga_path_ratio``, ``round_train_s``, ``dga_round_efficiency``.
"""

from __future__ import annotations

import argparse
import collections
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from results import write_result

from contract.devices import device_profile
from contract.run_folder import MESSAGES, read_rounds
from contract.settings import build_config
from edge.devices import cpu_hierarchy
from edgefl.launcher import run
from edgefl.processes import interrupt_on_signals
from edgefl.report import load_run

SAMPLE_S = 0.2
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
SETTINGS = {"dataset": "fashion-mnist", "partition": "dirichlet:0.3", "model": "cnn", "clients": 4,
            "local_steps": 5, "device_profile": "rpi4", "eval_every": 1000, "eval_examples": 500}  # fmt: skip
DGA = "dga:2"


class RoleCpu:
    """CPU seconds used by the threads in each device's role cgroups (``edgefl-<pid>-device-*``), summed per role;
    read every SAMPLE_S so that a thread's time counts even after it ends."""

    def __init__(self) -> None:
        self.seen: dict[tuple[str, str, int], float] = {}  # (device, role, thread) → its CPU seconds so far
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.pids: dict[tuple[str, str], set[int]] = collections.defaultdict(set)  # (device, role) → processes

    def __enter__(self) -> RoleCpu:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join()

    def _sample(self) -> None:
        root = cpu_hierarchy()[1]
        while not self.stop.wait(SAMPLE_S):
            for device in root.glob(f"edgefl-{os.getpid()}-device-*"):
                for role in ("train", "agent", "supernode"):
                    for pid in _ints(device / role / "cgroup.procs"):
                        self.pids[device.name, role].add(pid)
                    for tid in _ints(device / role / "tasks"):
                        cpu = _thread_cpu_s(tid)
                        if cpu is not None:
                            self.seen[device.name, role, tid] = cpu

    def per_device(self) -> dict[str, dict[str, float]]:
        totals: dict[str, dict[str, float]] = collections.defaultdict(lambda: collections.defaultdict(float))
        for (device, role, _), cpu in self.seen.items():
            totals[device][role] += cpu
        return {device: dict(roles) for device, roles in totals.items()}


def _ints(path: Path) -> list[int]:
    try:
        return [int(line) for line in path.read_text().split()]
    except OSError:
        return []


def _thread_cpu_s(tid: int) -> float | None:
    """The thread's own CPU seconds (``/proc/TID/stat`` of a process's first thread is the whole process's)."""
    try:
        fields = Path(f"/proc/{tid}/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS  # utime + stime


def profile_processes(pids: dict[str, int], seconds: float, out: Path) -> dict[str, list[tuple[str, float]]]:
    """py-spy's samples of each process for ``seconds``: the share of samples per function, own time first."""
    spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    found: dict[str, list[tuple[str, float]]] = {}
    procs = {name: subprocess.Popen([spy, "record", "--pid", str(pid), "--duration", str(int(seconds)), "--rate",
                                     "50", "--nonblocking", "--format", "raw", "--output", str(out / f"{name}.txt")],
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
             for name, pid in pids.items()}  # fmt: skip
    for name, proc in procs.items():
        proc.wait(timeout=seconds + 60)
        found[name] = _top_functions(out / f"{name}.txt")
    return found


WHERE = (  # (what, a frame name that puts a sample there), first match wins
    ("training (the training core's)", "LocalTrainer.train_steps"),
    ("Fleet API requests to the SuperLink (httpx, TLS, node signature)", "FleetHttpClient."),
    ("Runtime API requests to the SuperNode (the agent's claims, objects, replies)", "RuntimeHttpClient."),
    ("serving the Runtime API (the SuperNode's uvicorn)", "Server.run"),
    ("threads parked on a lock or queue", "Condition.wait"),
    ("the SuperNode's loop (pulls, pushes, reply polls)", "start_client_internal"),
    ("the ClientApp (decode, train's hand-over, encode)", "train"),
)


def _top_functions(raw: Path) -> list[tuple[str, float]]:
    """From py-spy's collapsed stacks (samples of threads on a CPU, root frame first): the share of samples under
    each of ``WHERE``, then "other"."""
    where: collections.Counter[str] = collections.Counter()
    total = 0
    for line in raw.read_text().splitlines() if raw.exists() else []:
        stack, _, count = line.rpartition(" ")
        names = [frame.split(" (")[0] for frame in stack.split(";")]
        total += int(count)
        where[next((what for what, frame in WHERE if any(n.startswith(frame) for n in names)), "other")] += int(count)
    return [(what, n / total) for what, n in where.most_common()] if total else []


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--links", default="lan,home-wifi,long-distance")
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--out", type=Path, default=Path("runs/bench-message-cost"))
    parser.add_argument("--cost-only", action="store_true", help="only the message cycle's CPU, no link comparison")
    args = parser.parse_args()
    interrupt_on_signals()
    shares = device_profile(SETTINGS["device_profile"]).shares()
    print(f"rpi4: training core {shares.train:.4f}, messaging cores {shares.message:.4f} of this host's", flush=True)
    links: dict[str, dict[str, Any]] = {}
    cost: dict[str, Any] = {}
    for link in args.links.split(","):
        summaries = {}
        for strategy in ("fedavg",) if args.cost_only else ("fedavg", DGA):
            out = args.out / link / strategy.replace(":", "-")
            config = build_config(None, strategy=strategy, profile=link, rounds=args.rounds, out=str(out), **SETTINGS)
            print(f"== {strategy} over {link}", flush=True)
            if strategy == "fedavg" and not cost:
                cost = measured_run(config, args.out / "profile")
            else:
                run(config, lambda line: print("   " + line, flush=True))
            summaries[strategy] = (load_run(out)[0], _cycles(out))
        if args.cost_only:
            break
        (fedavg, _), (dga, _) = summaries["fedavg"], summaries[DGA]
        r, t = fedavg["message_path_s"], fedavg["round_train_s"]
        allowed = min(1 + r / t, 2 + 1)
        speedup = fedavg["seconds_per_round"] / dga["seconds_per_round"]
        links[link] = {"fedavg_path_s": r, "dga_path_s": dga["message_path_s"], "round_train_s": t,
                       "dga_path_ratio": dga["message_path_s"] / r, "dga_speedup_per_round": speedup,
                       "allowed_speedup": allowed, "dga_round_efficiency": speedup / allowed}  # fmt: skip
    per_cycle = cost["host_core_s_per_cycle"]
    text = "\n".join([
        f"Four emulated Raspberry Pi 4s (messaging cores {shares.message:.4f} of this host's core), FedAvg over lan, "
        f"{args.rounds} rounds of {SETTINGS['local_steps']} steps (the CNN, 0.42 MB a message): the CPU of each "
        "device's messaging cores per message cycle (idle polling included), the median over devices:",
        "",
        "| process | host core s a cycle | Pi core s a cycle |",
        "|---|---|---|",
        *(f"| {name} | {s:.4f} | {s / shares.message:.3f} |" for name, s in cost["per_process"].items()),
        f"| both messaging cores | {per_cycle:.4f} | {per_cycle / shares.message:.3f} |",
        "",
        *_profile_lines(cost.get("profile", {})),
        *_link_lines(links),
    ])  # fmt: skip
    write_result(args.out, text, {"pi_core_s_per_cycle": per_cycle / shares.message, "host_core_s_per_cycle": per_cycle,
                                  "messaging_share": shares.message, **cost, "links": links})  # fmt: skip
    return 0


def measured_run(config: Any, profile_out: Path) -> dict[str, Any]:
    """The run with its devices' messaging CPU sampled, and one device's processes profiled where py-spy is."""
    profile_out.mkdir(parents=True, exist_ok=True)
    profile: dict[str, list[tuple[str, float]]] = {}
    with RoleCpu() as cpu:
        spy = threading.Thread(target=lambda: profile.update(_profile_first_device(cpu, profile_out)), daemon=True)
        spy.start()
        run(config, lambda line: print("   " + line, flush=True))
        spy.join(timeout=120)
    cycles = _cycles(Path(config.out))
    per_device = cpu.per_device()
    devices = _by_partition(per_device)

    def median_per_cycle(*roles: str) -> float:
        return statistics.median(sum(d.get(role, 0.0) for role in roles) / cycles[n] for n, d in devices)

    per_process = {"SuperNode": median_per_cycle("supernode"), "agent (not training)": median_per_cycle("agent")}
    both = median_per_cycle("supernode", "agent")
    return {"host_core_s_per_cycle": both, "per_process": per_process, "profile": profile,
            "cycles": cycles, "cpu_s": per_device}  # fmt: skip


def _by_partition(per_device: dict[str, dict[str, float]]) -> list[tuple[int, dict[str, float]]]:
    """(partition, its roles' CPU): device ``edgefl-<pid>-device-<i>`` is client i."""
    return [(int(name.rsplit("-", 1)[1]), roles) for name, roles in sorted(per_device.items())]


def _profile_first_device(cpu: RoleCpu, out: Path) -> dict[str, list[tuple[str, float]]]:
    """Once device 0's SuperNode and agent are placed, py-spy on both for the rest of the run (where installed)."""
    if not (shutil.which("py-spy") or Path(sys.executable).with_name("py-spy").exists()):
        return {}
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        found = {role: pids for (device, role), pids in list(cpu.pids.items()) if device.endswith("-device-0")}
        if found.get("supernode") and found.get("agent"):
            pids = {"SuperNode": min(found["supernode"]), "agent": min(found["agent"])}
            return profile_processes(pids, 25, out)
        time.sleep(SAMPLE_S)  # polled until the launcher has placed them
    return {}


def _cycles(run_dir: Path) -> dict[int, int]:
    """Message cycles per partition (``messages.jsonl``: every message, answered or not)."""
    return collections.Counter(m["partition"] for m in read_rounds(run_dir, MESSAGES))


def _link_lines(links: dict[str, dict[str, Any]]) -> list[str]:
    if not links:
        return []
    return [
        "FedAvg against DGA:2 on each link (R: the median message path; T: a round's training; allowed: "
        "min(1 + R/T, D + 1) with FedAvg's R and T):",
        "",
        "| link | FedAvg R s | DGA R s | DGA R / FedAvg R | T s | DGA rounds/s over FedAvg's | allowed | efficiency |",
        "|---|---|---|---|---|---|---|---|",
        *(f"| {link} | {v['fedavg_path_s']:.2f} | {v['dga_path_s']:.2f} | {v['dga_path_ratio']:.2f} | "
          f"{v['round_train_s']:.2f} | {v['dga_speedup_per_round']:.2f}x | {v['allowed_speedup']:.2f}x | "
          f"{v['dga_round_efficiency']:.2f} |" for link, v in links.items()),
    ]  # fmt: skip


def _profile_lines(profile: dict[str, list[tuple[str, float]]]) -> list[str]:
    if not profile:
        return ["(py-spy not installed: `pip install py-spy` for where the time goes)", ""]
    lines = ["Where device 0's processes were on a CPU (py-spy's samples, 50 a second, of threads it saw running):",
             ""]  # fmt: skip
    for name, top in profile.items():
        lines += [f"- {name}: " + "; ".join(f"{fn} {share:.0%}" for fn, share in top)]
    return [*lines, ""]


if __name__ == "__main__":
    sys.exit(main())
