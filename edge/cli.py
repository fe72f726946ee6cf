"""``edgefl edge bench MODEL``: the model's inference speed and accuracy on this device (see ``edge.bench``).

The lead's ``edgefl/cli.py`` calls :func:`register`. Bad input raises ``edge.bench.BenchError`` (a
``DataError``) or ``edge.devices.DeviceError``, which ``edgefl.cli.main`` prints as one line with exit code 2.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
from pathlib import Path

EXIT_DISAGREE = 1
DEFAULT_SECONDS = 3.0


def bench_command(args: argparse.Namespace) -> int:
    """Print the benchmark table; exit code 0 if the three back ends agree within tolerance, else 1. With
    ``--write-profile FILE``, first this device's figures (``edge.bench.device_figures``) go to FILE."""
    from edge.bench import BenchError, device_figures, format_report, load_target, run_bench
    from edge.devices import DeviceCaps, device_profile

    if not args.seconds > 0:
        raise BenchError(f"--seconds must be positive, got {args.seconds}")
    if args.threads < 1:
        raise BenchError(f"--threads must be at least 1, got {args.threads}")
    profile = device_profile(args.device_profile)
    shares = profile.shares()
    target = load_target(args.target, args.data_dir, args.model_name)
    with DeviceCaps(shares, "bench") as cap:  # a few seconds, this process on the device: no HostFollower in it
        if args.write_profile:
            record = device_figures(target, args.batch_size, args.profile_name, cap)
            args.write_profile.write_text(json.dumps(record, indent=2) + "\n")
        cap.place("train" if args.threads == 1 else None, os.getpid())  # one device core, or all of them
        report = run_bench(target, args.seconds, args.threads)
    limit = (
        "no CPU cap"
        if shares.train is None
        else f"{shares.cores} cores of this machine's: training {shares.train:.3f}, messaging {shares.message:.3f}"
    )
    print(f"device profile {profile.name}: {limit} ({profile.source})")
    if args.write_profile:
        step = record["train_step"]
        print(
            f"wrote {args.write_profile}: DGEMM {record['dgemm_gflops']:.2f} GFLOP/s, n-body "
            f"{record['nbody_s_per_step'] * 1e6:.1f} µs a step, a local step of {step['model']} at batch "
            f"{step['batch_size']} {step['seconds'] * 1000:.1f} ms (--device-profile {args.write_profile})"
        )
    print(format_report(report))
    return 0 if report.fp32_agrees and report.int8_agrees else EXIT_DISAGREE


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``edge`` with its subcommand ``bench``; it sets ``func`` to a handler returning the exit code."""
    edge = subparsers.add_parser("edge", help="the model on the device: inference benchmarks")
    commands = edge.add_subparsers(dest="edge_command", required=True, metavar="COMMAND")

    bench = commands.add_parser(
        "bench",
        help="latency, throughput and accuracy in torch, ONNX Runtime fp32 and ONNX Runtime int8",
        description="Exit code 0 if the three back ends agree within tolerance, 1 if not, 2 on bad input.",
    )
    bench.add_argument("target", metavar="RUN_OR_DATA", help="a run folder (its checkpoint.npz), or a data set name")
    bench.add_argument("--model", dest="model_name", default="auto",
                       help="for a data set name: the model to build (ml/catalog.py; default auto)")  # fmt: skip
    bench.add_argument(
        "--seconds", type=float, default=DEFAULT_SECONDS, help=f"time budget of the timing (default {DEFAULT_SECONDS})"
    )
    bench.add_argument("--threads", type=int, default=1, help="CPU threads for torch and onnxruntime (default 1)")
    bench.add_argument("--data-dir", help="folder with the data set's files, for a data set name")
    bench.add_argument("--device-profile", default="laptop",
                       help="rpi3 | rpi4 | rpi5 | laptop | FILE.json: cap this process's CPU like it")  # fmt: skip
    bench.add_argument("--write-profile", type=Path, metavar="FILE.json",
                       help="first measure this device (DGEMM, CPython n-body, a local step of the model) and "
                       "write a device profile for --device-profile FILE.json (the testbed, the clock)")  # fmt: skip
    bench.add_argument("--profile-name", default=platform.node() or "device", help="the profile's name (the host's)")
    bench.add_argument("--batch-size", type=int, default=32, help="the local step's batch for --write-profile")
    bench.set_defaults(func=bench_command)
