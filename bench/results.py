"""What the benchmarks share: progress lines and the result, as markdown in OUT/result.md and on screen."""

from __future__ import annotations

import time
from pathlib import Path


def print_row_done(name: str, accuracy: list[float], started: float) -> None:
    """One progress line after a simulated row: final and best test accuracy, seconds it took."""
    print(f"{name}: final {accuracy[-1]:.4f} best {max(accuracy):.4f} ({time.monotonic() - started:.0f} s)", flush=True)


def write_result(out: Path, text: str) -> None:
    """Write text to OUT/result.md and print it."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "result.md").write_text(text + "\n")
    print(text)
