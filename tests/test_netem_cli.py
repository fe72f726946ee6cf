"""``edgefl netem apply --client IP=PROFILE``: server-side shaping per client address, bad input in one line."""

from __future__ import annotations

import pytest


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--client", "10.0.0=lan"], "IPv4=PROFILE"),
        (["--client", "10.0.0.7"], "IPv4=PROFILE"),
        (["--client", "10.0.0.7=dial-up"], "dial-up"),
        ([], "--profile NAME"),
        (["--client", "10.0.0.7=lan"], "efl-no-such-dev"),  # valid request, missing interface: untouched
    ],
)
def test_apply_per_client_bad_input(args: list[str], needle: str, edgefl_main) -> None:
    done = edgefl_main("netem", "apply", "--dev", "efl-no-such-dev", *args)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0] and "Traceback" not in done.stderr
