"""What the benchmarks share: progress lines, and the result — its markdown in OUT/result.md and on screen, its
headline figures in OUT/result.json."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any


def add_deployment_arguments(parser: argparse.ArgumentParser, profile: str, out: str) -> None:
    """The settings of the slow-link deployment benchmarks: non-IID Fashion-MNIST, 4 clients, 30 rounds of 10
    local steps, target accuracy 0.8, over the link profile ``profile``, results in ``out``."""
    parser.add_argument("--profile", default=profile)
    parser.add_argument("--dataset", default="fashion-mnist")
    parser.add_argument("--partition", default="dirichlet:0.3")
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--local-steps", type=int, default=10)
    parser.add_argument("--lr-schedule", default="constant", help="constant or cosine (the same for every run)")
    parser.add_argument("--target-accuracy", type=float, default=0.8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path(out))


def print_row_done(name: str, accuracy: list[float], started: float) -> None:
    """One progress line after a simulated row: final and best test accuracy, seconds it took."""
    print(f"{name}: final {accuracy[-1]:.4f} best {max(accuracy):.4f} ({time.monotonic() - started:.0f} s)", flush=True)


def table_text(intro: str, columns: list[str], rows: list[str]) -> str:
    """A result's text: ``intro``, then a markdown table of ``columns`` over ``rows`` (each a ``| ... |`` line)."""
    return "\n".join([intro, "", "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns), *rows])


def write_result(out: Path, text: str, figures: dict[str, Any]) -> None:
    """Write ``text`` to OUT/result.md and print it; ``figures`` (the headline numbers) to OUT/result.json."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "result.md").write_text(text + "\n")
    clean = json.loads(json.dumps(figures), parse_constant=lambda _: None)  # NaN/Inf: null
    (out / "result.json").write_text(json.dumps(clean, indent=2) + "\n")
    print(text)
