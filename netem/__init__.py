"""Link profiles, link shaping with netem through pyroute2, and the namespaced testbed."""


def contain_pyroute2_children() -> None:
    """Set pyroute2's process-wide config before it opens a socket inside a network namespace (``netem.tc``,
    ``netem.testbed`` call it first; idempotent). Importing ``netem`` changes nothing."""
    from pyroute2 import config as pyroute2_config

    # pyroute2 opens every socket inside a namespace in a short-lived forked child, which it stops with SIGTERM.
    # By default that child keeps this process's signal handlers: under edgefl's CLI (SIGTERM -> KeyboardInterrupt)
    # the child then unwound the parent's stack and ran its cleanup, tearing down live testbeds. In "mp" mode
    # multiprocessing contains whatever the child raises, and disable_mp_signal gives it the default SIGTERM.
    pyroute2_config.child_process_mode = "mp"
    pyroute2_config.disable_mp_signal = True
