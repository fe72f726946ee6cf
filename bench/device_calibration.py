"""The emulated Raspberry Pis against published Pi figures, kernel by kernel, under each profile's own caps.

For each profile (rpi4, rpi3), a child process runs each kernel on one device core of its cgroups: the kernels
that set the profile's two shares (``contract.devices``) — single-thread float64 DGEMM on the training core,
CPython's n-body on a messaging core — and three that check what the shares do not set: a STREAM-like triad
(memory bandwidth; a quota slices a host core's time, so the emulated Pi's bandwidth is the host's times the
share), a ResNet-18 forward pass in torch (the published figure is ncnn's, a tuned ARM engine with Winograd
convolutions, so torch eager is expected slower), and a training step of LEAF's Shakespeare LSTM (batch 10,
~3.8 GFLOP), whose emulated FLOP rate is printed against the Cortex-A72's peak (12 GFLOP/s of float32 at
1.5 GHz). Each is timed over ``contract.kernels.DEVICE_WINDOW_S`` of wall time (a quota is a rate over 100 ms
periods). Per kernel: emulated, published, their ratio, the source, and whether it sets a share; the shares
are set from the host's speed measured at run time and follow it while the kernel runs (``edge.devices.HostFollower``:
every 2 s one of this host's CPUs in turn probed, the quotas set from their mean; this host's cores moved 2x
within a minute and apart from each other), and each setting kernel is the median of ``REPEATS`` tries — so the
setting kernels should land within ``AIM``.

    python bench/device_calibration.py [--profiles rpi4,rpi3] [--out runs/bench-device-calibration]

result.json: ``hosts`` (the speeds the caps were set from, in order: this host drifts by tens of percent within
minutes), ``shares`` per profile (at the end of its first kernel), and ``kernels`` per profile: per kernel
``emulated``, ``tries``, ``published``, ``ratio``, ``unit``, ``source``, ``sets_share``; and ``within_aim``
(every setting kernel of every profile within ``AIM``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Iterable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from results import write_result

from contract.devices import (
    PI3_RESNET18_MS,
    PI4_RESNET18_MS_AT_1500,
    PUBLISHED_SOURCES,
    device_profile,
)
from contract.kernels import DEVICE
from edge.devices import FOLLOW_EVERY_S, DeviceCaps, HostFollower

AIM = 0.20
REPEATS = 3  # tries of a kernel that sets a share: their median
A72_FP32_PEAK_GFLOPS = 12.0  # 8 FLOP/cycle (one 128-bit NEON FMA) at 1.5 GHz
PI4_STREAM_TRIAD_MBS = 4844.0  # gcc -O3, one thread, headless Pi 4: sci-pi.org.uk/bench/stream.html
TRIAD_N = 4_000_000  # three arrays of 32 MB: far beyond any cache
LSTM_STEP_GFLOP = 3.8  # LEAF's LSTM (emb 8, 2 x 256, 80 characters) at batch 10: forward + backward
CHILD = "--child"
KERNELS = {  # name: (device core it runs on, unit, higher is better)
    "dgemm": ("train", "GFLOP/s", True),
    "nbody": ("agent", "µs a step", False),
    "triad": ("train", "MB/s", True),
    "resnet18": ("train", "ms a forward pass", False),
    "leaf_lstm_step": ("train", "GFLOP/s", True),
}


def published(profile: str, speeds: Any) -> dict[str, tuple[float | None, str, bool]]:
    """Per kernel: the published figure (None: none published), its source, and whether it sets a share."""
    resnet = {"rpi4": PI4_RESNET18_MS_AT_1500, "rpi3": PI3_RESNET18_MS}.get(profile)
    derived = "" if profile == "rpi4" else " (scaled from the Pi 4's: contract/devices.py)"
    return {
        "dgemm": (speeds.dgemm_gflops, PUBLISHED_SOURCES["dgemm"] + derived, True),
        "nbody": (speeds.nbody_s_per_step * 1e6, PUBLISHED_SOURCES["nbody"] + ", CPython 3.11" + derived, True),
        "triad": (PI4_STREAM_TRIAD_MBS if profile == "rpi4" else None, "STREAM Triad, gcc -O3: sci-pi.org.uk", False),
        "resnet18": (resnet, PUBLISHED_SOURCES["resnet18"] + " (ncnn, at 1.5 GHz for the Pi 4)", False),
        "leaf_lstm_step": (A72_FP32_PEAK_GFLOPS if profile == "rpi4" else None, "Cortex-A72 fp32 peak: a bound",
                           False),
    }  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--profiles", default="rpi4,rpi3")
    parser.add_argument("--out", type=Path, default=Path("runs/bench-device-calibration"))
    parser.add_argument(CHILD, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args.child)
    rows, figures, shares_of, hosts, within = [], {}, {}, [], True
    for name in args.profiles.split(","):
        profile = device_profile(name)
        figures[name] = {}
        for kernel, (role, unit, higher) in KERNELS.items():
            value, source, sets = published(name, profile.speeds)[kernel]
            tries = []
            for _ in range(REPEATS if sets else 1):
                caps = DeviceCaps(profile.shares(), "calibration", tag=f"bench{os.getpid()}")
                with caps, HostFollower([(caps, profile)]) as follower:
                    figure = run_capped(kernel, role, caps)
                tries.append(figure)
                hosts += [asdict(host) for host in follower.samples]
                shares_of.setdefault(name, asdict(caps.shares))
                print(f"   {kernel}: {figure:.4g} {unit}, caps set {len(follower.samples)} times from this host's "
                      f"DGEMM {_range(follower.samples, 'dgemm_gflops', 1)} GFLOP/s, n-body "
                      f"{_range(follower.samples, 'nbody_s_per_step', 1e6)} µs a step", flush=True)  # fmt: skip
            emulated = statistics.median(tries)
            ratio = None if value is None else emulated / value
            off = None if ratio is None else (ratio - 1 if higher else 1 / ratio - 1)  # > 0: the emulation is fast
            within &= not sets or (off is not None and abs(off) <= AIM)
            figures[name][kernel] = {"emulated": emulated, "tries": tries,
                                     "published": value, "ratio": ratio, "unit": unit, "speed_off": off,
                                     "source": source, "sets_share": sets}  # fmt: skip
            speed_off = "—" if off is None else f"{off:+.0%}"
            rows.append(f"| {name} | {kernel} | {unit} | {emulated:.4g} | {_g(value)} | {_g(ratio)} | "
                        f"{speed_off} | {'yes' if sets else 'no'} | {source} |")  # fmt: skip
            print(f"   {kernel}: {emulated:.4g} {unit} (published {_g(value)})", flush=True)
    dgemm, nbody = (sorted(h[k] for h in hosts) for k in ("dgemm_gflops", "nbody_s_per_step"))
    text = "\n".join([
        f"This host's speed the caps were set from (CPU time, a short probe of one CPU every "
        f"{FOLLOW_EVERY_S:.0f} s, the CPUs' mean): DGEMM {dgemm[0]:.1f} to {dgemm[-1]:.1f} GFLOP/s, n-body "
        f"{nbody[0] * 1e6:.2f} to {nbody[-1] * 1e6:.2f} µs a step on one core. Each kernel on one core of the emulated "
        f"device's cgroups, its caps following that speed, timed over {DEVICE.window_s:.0f} s of wall time (a "
        f"kernel that sets a share: the median of {REPEATS} tries); "
        "speed off: + the emulation is faster than the Pi, − slower.",
        "",
        *(f"- {n}: training core {s['train']:.4f}, messaging cores {s['message']:.4f} of this host's core (at the "
          "end of its first kernel)" for n, s in shares_of.items()),
        "",
        "| profile | kernel | unit | emulated | published | emulated / published | speed off | sets a share | source |",
        "|---|---|---|---|---|---|---|---|---|",
        *rows,
        "",
        f"Every kernel that sets a share within {AIM:.0%}: {'yes' if within else 'NO'}.",
    ])  # fmt: skip
    write_result(args.out, text, {"hosts": hosts, "shares": shares_of, "kernels": figures,
                                  "within_aim": within})  # fmt: skip
    return 0 if within else 1


def _range(samples: Iterable[Any], field: str, scale: float) -> str:
    values = sorted(getattr(sample, field) * scale for sample in samples)
    return f"{values[0]:.2f}-{values[-1]:.2f}"


def run_capped(kernel: str, role: str, caps: DeviceCaps) -> float:
    """``kernel`` in a child that imported what it needs uncapped, then was placed on ``role``'s device core."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    with subprocess.Popen([sys.executable, __file__, CHILD, kernel], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                          text=True, env=env) as worker:  # fmt: skip
        assert worker.stdin is not None and worker.stdout is not None
        if worker.stdout.readline().strip() != "ready":
            raise RuntimeError(f"the {kernel} child did not start")
        caps.place(role, worker.pid)
        worker.stdin.write("go\n")
        worker.stdin.flush()
        return float(worker.stdout.readline())


def child(kernel: str) -> int:
    """Prepare ``kernel``, say "ready", wait for "go" (by then placed on its core), print its figure."""
    measure = prepare(kernel)
    print("ready", flush=True)
    sys.stdin.readline()
    print(measure(), flush=True)
    return 0


def prepare(kernel: str) -> Any:
    """The kernel's figure as a function, its imports and data made first (they are not the device's work)."""
    from contract.kernels import dgemm_gflops, nbody_s_per_step

    if kernel == "dgemm":
        return dgemm_gflops
    if kernel == "nbody":
        return lambda: nbody_s_per_step() * 1e6
    import numpy as np

    if kernel == "triad":
        b, c, a = np.ones(TRIAD_N), np.ones(TRIAD_N), np.empty(TRIAD_N)

        def triad() -> None:  # a = b + s·c in two passes (numpy has no fused triad): 40 bytes moved an element
            np.multiply(c, 3.0, out=a)
            np.add(a, b, out=a)

        return lambda: 24 * TRIAD_N / DEVICE.seconds_per_run(triad) / 1e6  # STREAM counts 24 bytes an element
    import torch

    torch.set_num_threads(1)
    if kernel == "resnet18":
        net, image = resnet18().eval(), torch.randn(1, 3, 224, 224)

        def forward() -> None:
            with torch.inference_mode():
                net(image)

        return lambda: DEVICE.seconds_per_run(forward) * 1000
    from ml.data import load_dataset
    from ml.models import build_model
    from ml.trainer import seconds_per_step

    data = load_dataset("shakespeare")
    model = build_model(data, 0, "leaf-lstm")
    return lambda: LSTM_STEP_GFLOP / seconds_per_step(model, data, 10, 0.8, 0.0, 0, DEVICE.window_s)


def resnet18() -> Any:
    """ResNet-18 for 224x224 images (He et al. 2016), built from torch's layers (torchvision is not installed)."""
    from torch import nn

    class Block(nn.Module):
        def __init__(self, cin: int, cout: int, stride: int) -> None:
            super().__init__()
            conv = nn.Conv2d
            self.body = nn.Sequential(conv(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(),
                                      conv(cout, cout, 3, 1, 1, bias=False), nn.BatchNorm2d(cout))  # fmt: skip
            same = stride == 1 and cin == cout
            self.skip = nn.Identity() if same else nn.Sequential(conv(cin, cout, 1, stride, bias=False),
                                                                 nn.BatchNorm2d(cout))  # fmt: skip

        def forward(self, x: Any) -> Any:
            return (self.body(x) + self.skip(x)).relu()

    widths, layers, cin = (64, 128, 256, 512), [], 64
    for i, width in enumerate(widths):
        layers += [Block(cin, width, 1 if i == 0 else 2), Block(width, width, 1)]
        cin = width
    return nn.Sequential(nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(), nn.MaxPool2d(3, 2, 1),
                         *layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(512, 1000))  # fmt: skip


def _g(value: float | None) -> str:
    return "—" if value is None else f"{value:.4g}"


if __name__ == "__main__":
    started = time.monotonic()
    status = main()
    if CHILD not in sys.argv:
        print(f"({time.monotonic() - started:.0f} s)")
    sys.exit(status)
