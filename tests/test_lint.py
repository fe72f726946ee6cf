"""The tree stays ruff-clean (lint and format), with the repository's own configuration."""

import subprocess
import sys

from tests.conftest import REPO


def test_ruff_check_and_format() -> None:
    for args in (["check", "."], ["format", "--check", "."]):
        done = subprocess.run([sys.executable, "-m", "ruff", *args], cwd=REPO, capture_output=True, text=True)
        assert done.returncode == 0, done.stdout + done.stderr
