"""Where an emulated Pi's message time goes: the CPU a message cycle costs the device's messaging cores, and
DGA's message path and rounds against FedAvg's on the same link, where the main job and the headline run.

First, FedAvg over lan on four emulated Raspberry Pi 4s (the CNN on Fashion-MNIST, K = 5, ``--rounds`` rounds): the
CPU time of each device's two messaging cores (its SuperNode, and the agent process but its training thread: its
cgroups' ``supernode`` and ``agent``, read by process every ``SAMPLE_S``: ``RoleCpu``) per message cycle, in seconds
of this host's core and of a Pi core (host seconds / the messaging share, from this host's n-body speed measured
during the run: ``HostDuring``); idle polling is included, as a device pays it. Two windows: the run's steady state
(each device from its third message to its last reply: the first messages carry a run's fixed costs, the node's
first contact with the run, its app, the session) and the whole run. With ``py-spy`` installed, one device's
SuperNode and agent are sampled and their samples sorted by what they were doing (``WHERE``).

Then each case's FedAvg against DGA over each of its links (``CASES``: the main job's, ``edgefl compare``'s settings
over home-wifi and long-distance with D = 2, and the headline's, ``bench/dga_vs_fedavg.py``'s over lan and
long-distance with D = 4; ``--link-rounds`` rounds each, ``--repeats`` pairs of runs per link, which of the two
goes first alternating): the median message path R of each (``messages.jsonl``), a
round's training T, DGA's path over FedAvg's, and DGA's rounds per second over FedAvg's (from the third round on)
against what the link allows, min(1 + R/T, D + 1) with FedAvg's R and T, and beside it each run's rounds counted
in its own T (``compare_case``).

    python bench/message_cost.py [--rounds 12] [--link-rounds 10] [--repeats 3] [--cases main,headline]
        [--cost-only] [--out runs/bench-message-cost]

result.json: ``pi_core_s_per_cycle`` (both messaging cores, steady state, the median over devices),
``host_core_s_per_cycle``, ``whole_run`` (the same over the whole run), ``per_process`` (SuperNode and agent),
``profile`` (py-spy's shares, where it ran), and per case and link (``cases``) ``fedavg_path_s``, ``dga_path_s``,
``dga_path_ratio``, ``round_train_s``, ``dga_speedup_per_round``, ``allowed_speedup``, ``dga_round_efficiency``
(each the mean over the repeats; ``dga_path_ratio_ci`` and ``dga_round_efficiency_ci`` as [mean, low, high], the
95 % interval; ``repeats``: each pair's figures); ``targets``: each aim, judged on the mean, and whether it is met.
A run's folder is ``OUT/CASE/LINK/REPEAT/STRATEGY``.
"""

from __future__ import annotations

import abc
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
from typing import Any, Self

from dga_vs_fedavg import HEADLINE, HEADLINE_DELAY
from results import write_result

from contract.devices import device_profile
from contract.kernels import HOST, nbody_s_per_step
from contract.run_folder import MESSAGES, ROUNDS, read_rounds
from contract.settings import build_config
from edge.devices import cpu_hierarchy
from edgefl.compare import DEFAULT_PROFILES, DEFAULT_STRATEGIES
from edgefl.compare import DEFAULTS as MAIN_JOB
from edgefl.launcher import run
from edgefl.processes import interrupt_on_signals
from edgefl.report import load_run, mean_interval

SAMPLE_S = 0.2
HOST_EVERY_S = 2.0
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
SETTINGS = {"dataset": "fashion-mnist", "partition": "dirichlet:0.3", "model": "cnn", "clients": 4,
            "local_steps": 5, "device_profile": "rpi4", "eval_every": 1000, "eval_examples": 500}  # fmt: skip
NOT_TIMED = {"eval_every": 1000, "eval_examples": 500}  # no evaluation between rounds: the path is measured
CASES = {  # name -> (settings, DGA, links)
    "main": (
        {k: v for k, v in MAIN_JOB.items() if k not in ("rounds", "out")},
        DEFAULT_STRATEGIES[1],
        DEFAULT_PROFILES,
    ),
    "headline": (HEADLINE, f"dga:{HEADLINE_DELAY}", ("lan", "long-distance")),
}
SKIPPED = 2  # a device's first messages (its first contact with the run), and a run's first rounds: fixed costs
AIM_PI_CORE_S, AIM_PATH_RATIO, AIM_EFFICIENCY = 0.3, 1.2, 0.9
JUDGED = ("dga_path_ratio", "dga_round_efficiency")  # per link: the mean over repeats, with its interval


class Sampler(abc.ABC):
    """A thread that calls ``sample`` every ``every`` seconds while the ``with`` block runs."""

    every = SAMPLE_S

    def __init__(self) -> None:
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Self:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join()

    def _run(self) -> None:
        while not self.stop.wait(self.every):
            self.sample()

    @abc.abstractmethod
    def sample(self) -> None: ...


class RoleCpu(Sampler):
    """CPU seconds each device's roles (``edgefl-<pid>-device-*``'s cgroups) have used since it was placed, read every
    ``SAMPLE_S``: ``supernode`` its SuperNode process's, ``train`` the agent's training thread's, ``agent`` the rest
    of the agent process's. By process, not by thread: a process's count keeps its ended threads' (each object
    pulled or pushed runs on a thread of a pool made for that call)."""

    def __init__(self) -> None:
        super().__init__()
        self.history: list[tuple[float, dict[tuple[str, str], float]]] = []  # (when, (device, role) → CPU s)
        self.first: dict[tuple[str, str], float] = {}  # (device, role) → its CPU seconds when first seen placed
        self.pids: dict[tuple[str, str], set[int]] = collections.defaultdict(set)  # (device, role) → processes
        self.root = cpu_hierarchy()[1]

    def sample(self) -> None:
        totals = {}
        for device in self.root.glob(f"edgefl-{os.getpid()}-device-*"):
            for role in ("train", "agent", "supernode"):
                self.pids[device.name, role].update(_ints(device / role / "cgroup.procs"))
            train = sum(_cpu_s(f"/proc/{tid}/task/{tid}/stat") or 0.0 for tid in _ints(device / "train" / "tasks"))
            agent = [_cpu_s(f"/proc/{pid}/stat") for pid in _ints(device / "agent" / "cgroup.procs")]
            supernode = [_cpu_s(f"/proc/{pid}/stat") for pid in _ints(device / "supernode" / "cgroup.procs")]
            if None in agent or None in supernode or not (agent and supernode):
                continue  # not placed yet, or gone
            for role, cpu in (("train", train), ("agent", sum(agent) - train), ("supernode", sum(supernode))):
                self.first.setdefault((device.name, role), cpu)
                totals[device.name, role] = cpu - self.first[device.name, role]
        self.history.append((time.monotonic(), totals))

    def at(self, when: float) -> dict[tuple[str, str], float]:
        """The CPU seconds of each (device, role) since it was placed, as last sampled at or before ``when``."""
        found: dict[tuple[str, str], float] = {}
        for sampled, totals in self.history:
            if sampled > when:
                break
            found = {**found, **totals}  # a device gone from a later sample keeps its last figures
        return found


class HostDuring(Sampler):
    """This host's n-body step (``contract.kernels``, CPU time, ``HOST``'s timing) measured every ``HOST_EVERY_S``
    while a run runs: the host's core drifts by tens of percent within minutes, so a host second is converted to a
    Pi's at the speed the host had while it was spent."""

    every = HOST_EVERY_S

    def __init__(self) -> None:
        super().__init__()
        self.samples: list[float] = []

    def sample(self) -> None:
        self.samples.append(nbody_s_per_step(HOST))

    def nbody_s_per_step(self) -> float:
        return statistics.median(self.samples)


def _ints(path: Path) -> list[int]:
    try:
        return [int(line) for line in path.read_text().split()]
    except OSError:
        return []


def _cpu_s(stat: str) -> float | None:
    """utime + stime of a ``/proc/.../stat`` file in seconds (a process's counts its ended threads'); None if gone."""
    try:
        fields = Path(stat).read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


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
    parser.add_argument("--rounds", type=int, default=12, help="the measured FedAvg run's rounds")
    parser.add_argument("--link-rounds", type=int, default=10, help="each link comparison's runs' rounds")
    parser.add_argument("--cases", default=",".join(CASES), help=f"of {', '.join(CASES)}")
    parser.add_argument("--out", type=Path, default=Path("runs/bench-message-cost"))
    parser.add_argument("--repeats", type=int, default=3, help="pairs of runs (FedAvg, DGA) over each link")
    parser.add_argument("--cost-only", action="store_true", help="only the message cycle's CPU, no link comparison")
    args = parser.parse_args()
    unknown = set(args.cases.split(",")) - set(CASES)
    if unknown or args.rounds < SKIPPED + 2 or args.link_rounds < SKIPPED + 2 or args.repeats < 1:
        parser.error(f"--cases of {', '.join(CASES)}; at least {SKIPPED + 2} rounds and one repeat "
                     f"(unknown: {sorted(unknown)})")  # fmt: skip
    interrupt_on_signals()
    profile = device_profile(SETTINGS["device_profile"])
    shares = profile.shares()
    print(f"rpi4: training core {shares.train:.4f}, messaging cores {shares.message:.4f} of this host's", flush=True)
    config = build_config(None, strategy="fedavg", profile="lan", rounds=args.rounds,
                          out=str(args.out / "cost" / "fedavg"), **SETTINGS)  # fmt: skip
    print("== the message cycle: fedavg over lan", flush=True)
    with HostDuring() as host:
        cost = measured_run(config, args.out / "profile")
    assert profile.speeds is not None
    share = profile.speeds.nbody_s_per_step and host.nbody_s_per_step() / profile.speeds.nbody_s_per_step
    print(f"this host's n-body step during the run: {host.nbody_s_per_step() * 1e6:.2f} µs (median of "
          f"{len(host.samples)}, {min(host.samples) * 1e6:.2f}-{max(host.samples) * 1e6:.2f}); the messaging share of "
          f"a Pi 4's core then {share:.4f}", flush=True)  # fmt: skip
    cases = {} if args.cost_only else {name: compare_case(name, args) for name in args.cases.split(",")}
    steady = cost["steady"]
    result = {
        "pi_core_s_per_cycle": steady["both"] / share, "host_core_s_per_cycle": steady["both"],
        "per_process": steady["per_process"], "messaging_share": share, "messaging_share_placed": shares.message,
        "host_nbody_s_per_step": host.samples,
        "whole_run": {"pi_core_s_per_cycle": cost["whole"]["both"] / share,
                      "host_core_s_per_cycle": cost["whole"]["both"], "per_process": cost["whole"]["per_process"]},
        "profile": cost["profile"], "cycles": cost["cycles"], "cases": cases,
    }  # fmt: skip
    result["targets"] = targets(result)
    text = "\n".join([
        f"Four emulated Raspberry Pi 4s, FedAvg over lan, {args.rounds} rounds of {SETTINGS['local_steps']} steps (the "
        "CNN, 0.42 MB a message): the CPU of each device's messaging cores per message cycle (idle polling included), "
        f"the median over devices; the steady state is each device's messages after its first {SKIPPED}. Seconds of a "
        f"Pi core are this host's over the messaging share of a Pi 4's core while the run ran ({share:.4f}: this "
        f"host's n-body step, {host.nbody_s_per_step() * 1e6:.2f} µs, the median of {len(host.samples)} measured "
        "during it, "
        f"{min(host.samples) * 1e6:.2f} to {max(host.samples) * 1e6:.2f}; the devices were placed at "
        f"{shares.message:.4f}):",
        "",
        "| process | steady: host core s a cycle | steady: Pi core s | whole run: host core s | whole run: Pi core s |",
        "|---|---|---|---|---|",
        *(f"| {name} | {s:.4f} | {s / share:.3f} | {cost['whole']['per_process'][name]:.4f} | "
          f"{cost['whole']['per_process'][name] / share:.3f} |" for name, s in steady["per_process"].items()),
        f"| both messaging cores | {steady['both']:.4f} | {steady['both'] / share:.3f} | "
        f"{cost['whole']['both']:.4f} | {cost['whole']['both'] / share:.3f} |",
        "",
        *_profile_lines(cost.get("profile", {})),
        *_case_lines(cases),
        *(f"- {aim}: {'met' if ok else 'NOT met'} ({value})" for aim, (ok, value) in result["targets"].items()),
    ])  # fmt: skip
    write_result(args.out, text, result)
    return 0


def compare_case(name: str, args: argparse.Namespace) -> dict[str, Any]:
    """FedAvg against the case's DGA over each of its links, ``args.repeats`` times (the two in turns, which goes
    first alternating): their paths, T, and DGA's round efficiency — its rounds per second over FedAvg's against
    min(1 + R/T, D + 1); per link the mean of each over the repeats, with its 95 % interval (``_ci``) for the ratio
    and the efficiency. Beside it the same counted in each run's own round training T
    (``dga_round_efficiency_in_own_t``): not the judged one, since a T that differs between the two runs may be
    DGA's own cost as well as this host's drift (DGA's T came out 3-36 % longer in eleven pairs on one day)."""
    settings, dga, links = CASES[name]
    found: dict[str, Any] = {"dga": dga, "links": {}}
    for link in links:
        pairs = []
        for repeat in range(1, args.repeats + 1):
            order = ("fedavg", dga) if repeat % 2 else (dga, "fedavg")
            runs = {}
            for strategy in order:
                out = args.out / name / link / str(repeat) / strategy.replace(":", "-")
                config = build_config(None, strategy=strategy, profile=link, rounds=args.link_rounds, out=str(out),
                                      **{**settings, **NOT_TIMED})  # fmt: skip
                print(f"== {name}: {strategy} over {link} ({repeat} of {args.repeats})", flush=True)
                run(config, lambda line: print("   " + line, flush=True))
                runs[strategy] = (load_run(out)[0], steady_round_s(out))
            pairs.append(compare_pair(runs["fedavg"], runs[dga], int(dga.split(":")[1])))
        found["links"][link] = {
            **{key: statistics.mean(p[key] for p in pairs) for key in pairs[0]},
            **{f"{key}_ci": mean_interval([p[key] for p in pairs]) for key in JUDGED},
            "repeats": pairs,
        }  # fmt: skip
    return found


def compare_pair(
    fedavg_run: tuple[dict[str, Any], float], dga_run: tuple[dict[str, Any], float], delay: int
) -> dict[str, float]:
    """One FedAvg run against one DGA run with delay ``delay``, each (summary, steady seconds a round)."""
    (fedavg, fedavg_round_s), (dga, dga_round_s) = fedavg_run, dga_run
    r, t, dga_t = fedavg["message_path_s"], fedavg["round_train_s"], dga["round_train_s"]
    allowed = min(1 + r / t, delay + 1)
    speedup = fedavg_round_s / dga_round_s
    in_own_t = (fedavg_round_s / t) / (dga_round_s / dga_t)  # each run's rounds in its own T
    return {
        "fedavg_path_s": r, "dga_path_s": dga["message_path_s"], "round_train_s": t,
        "dga_round_train_s": dga_t, "dga_path_ratio": dga["message_path_s"] / r,
        "fedavg_round_s": fedavg_round_s, "dga_round_s": dga_round_s, "dga_speedup_per_round": speedup,
        "dga_speedup_in_own_t": in_own_t, "allowed_speedup": allowed, "dga_round_efficiency": speedup / allowed,
        "dga_round_efficiency_in_own_t": in_own_t / allowed,
    }  # fmt: skip


def steady_round_s(run_dir: Path) -> float:
    """Seconds a round from the run's third round to its last (its first rounds carry the run's fixed costs)."""
    wall = [row["wall_s"] for row in read_rounds(run_dir, ROUNDS)]
    return (wall[-1] - wall[SKIPPED]) / (len(wall) - 1 - SKIPPED)


def targets(result: dict[str, Any]) -> dict[str, tuple[bool, str]]:
    """Each aim of the message path, whether it is met, and the figure it is judged on."""
    pi = result["pi_core_s_per_cycle"]
    found = {f"a message cycle at most {AIM_PI_CORE_S} s of a Pi core (steady state)": (pi <= AIM_PI_CORE_S,
                                                                                        f"{pi:.3f} s")}  # fmt: skip
    for name, case in result["cases"].items():
        for link, v in case["links"].items():
            found[f"{name}, {link}: DGA's path at most {AIM_PATH_RATIO}x FedAvg's (the mean)"] = (
                v["dga_path_ratio"] <= AIM_PATH_RATIO, _with_interval(v["dga_path_ratio_ci"], "x"))  # fmt: skip
            found[f"{name}, {link}: DGA's rounds at least {AIM_EFFICIENCY} of what the link allows (the mean)"] = (
                v["dga_round_efficiency"] >= AIM_EFFICIENCY, _with_interval(v["dga_round_efficiency_ci"]))  # fmt: skip
    return found


def _with_interval(ci: list[float], unit: str = "") -> str:
    mean, low, high = ci
    return f"{mean:.2f}{unit}" if low == high else f"{mean:.2f}{unit} [{low:.2f}, {high:.2f}]"


def measured_run(config: Any, profile_out: Path | None = None) -> dict[str, Any]:
    """The run with its devices' messaging CPU sampled, and (with ``profile_out``) one device's processes profiled
    where py-spy is: the CPU per message cycle over each device's steady state and over the whole run."""
    profile: dict[str, list[tuple[str, float]]] = {}
    with RoleCpu() as cpu:
        if profile_out is not None:
            profile_out.mkdir(parents=True, exist_ok=True)
            spy = threading.Thread(target=lambda: profile.update(_profile_first_device(cpu, profile_out)), daemon=True)
            spy.start()
        run(config, lambda line: print("   " + line, flush=True))
        if profile_out is not None:
            spy.join(timeout=120)
    messages = read_rounds(Path(config.out), MESSAGES)
    whole = cpu.at(float("inf"))
    steady: dict[tuple[str, str], float] = {}
    cycles: dict[int, int] = {}
    for device in {device for device, _ in whole}:
        partition = int(device.rsplit("-", 1)[1])  # device edgefl-<pid>-device-<i> is client i
        mine = sorted((m for m in messages if m["partition"] == partition), key=lambda m: m["sent_at"])
        start, end = mine[SKIPPED]["sent_at"], max(m["sent_at"] + m["round_trip_s"] for m in mine)
        before, after = cpu.at(start), cpu.at(end + SAMPLE_S)
        cycles[partition] = len(mine) - SKIPPED
        for role in ("supernode", "agent"):
            key = (device, role)
            steady[key] = (after.get(key, 0.0) - before.get(key, 0.0)) / cycles[partition]
    whole_per_cycle = {
        key: cpu_s / len([m for m in messages if m["partition"] == int(key[0].rsplit("-", 1)[1])])
        for key, cpu_s in whole.items() if key[1] != "train"
    }  # fmt: skip
    return {"steady": _medians(steady), "whole": _medians(whole_per_cycle), "profile": profile, "cycles": cycles}


def _medians(per_cycle: dict[tuple[str, str], float]) -> dict[str, Any]:
    """The median over devices of each messaging core's CPU a cycle, and of both."""
    devices = sorted({device for device, _ in per_cycle})

    def median(*roles: str) -> float:
        return statistics.median(sum(per_cycle.get((d, role), 0.0) for role in roles) for d in devices)

    per_process = {"SuperNode": median("supernode"), "agent (not training)": median("agent")}
    return {"per_process": per_process, "both": median("supernode", "agent")}


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


def _case_lines(cases: dict[str, Any]) -> list[str]:
    if not cases:
        return []
    rows = []
    for name, case in cases.items():
        for link, v in case["links"].items():
            for repeat, p in enumerate(v["repeats"], 1):
                rows.append(f"| {name} ({case['dga']}) | {link} | {repeat} | {_pair_cells(p)} |")
            if len(v["repeats"]) > 1:
                rows.append(f"| {name} ({case['dga']}) | {link} | mean | {_pair_cells(v)} |")
    return [
        "FedAvg against DGA on each case's links (R: the median message path; T: a round's training, FedAvg's / "
        "DGA's; rounds per second from the third round on, and in each run's own T; allowed: min(1 + R/T, D + 1) with "
        "FedAvg's R and T; efficiency: DGA's rounds over FedAvg's, over what is allowed; each pair of runs a row, "
        "then their mean; the aims below are judged on the mean, with its 95 % interval):",
        "",
        "| case | link | run | FedAvg R s | DGA R s | DGA R / FedAvg R | T s | FedAvg s/round | DGA s/round | "
        "DGA rounds/s over FedAvg's | in their own T | allowed | efficiency |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        *rows,
        "",
    ]


def _pair_cells(v: dict[str, Any]) -> str:
    return (
        f"{v['fedavg_path_s']:.2f} | {v['dga_path_s']:.2f} | {v['dga_path_ratio']:.2f} | "
        f"{v['round_train_s']:.2f} / {v['dga_round_train_s']:.2f} | {v['fedavg_round_s']:.2f} | "
        f"{v['dga_round_s']:.2f} | {v['dga_speedup_per_round']:.2f}x | {v['dga_speedup_in_own_t']:.2f}x | "
        f"{v['allowed_speedup']:.2f}x | {v['dga_round_efficiency']:.2f}"
    )


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
