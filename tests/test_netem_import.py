"""Importing ``netem`` changes nothing process-wide: pyroute2's config is set by ``contain_pyroute2_children``,
which the namespace code calls before it opens a socket inside a namespace."""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import REPO

CODE = """
import netem, netem.tc, netem.testbed, netem.verify
from pyroute2 import config
print(config.child_process_mode, config.disable_mp_signal)
netem.contain_pyroute2_children()
print(config.child_process_mode, config.disable_mp_signal)
"""


def test_importing_netem_leaves_pyroute2_as_it_is_until_namespaces_are_used() -> None:
    done = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["fork False", "mp True"]
