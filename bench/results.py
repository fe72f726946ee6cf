"""What the benchmarks share: progress lines, and the result — its markdown in OUT/result.md and on screen, its
headline figures in OUT/result.json."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any


def print_row_done(name: str, accuracy: list[float], started: float) -> None:
    """One progress line after a simulated row: final and best test accuracy, seconds it took."""
    print(f"{name}: final {accuracy[-1]:.4f} best {max(accuracy):.4f} ({time.monotonic() - started:.0f} s)", flush=True)


def write_result(out: Path, text: str, figures: dict[str, Any]) -> None:
    """Write ``text`` to OUT/result.md and print it; ``figures`` (the headline numbers) to OUT/result.json."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "result.md").write_text(text + "\n")
    clean = json.loads(json.dumps(figures), parse_constant=lambda _: None)  # NaN/Inf: null
    (out / "result.json").write_text(json.dumps(clean, indent=2) + "\n")
    print(text)
