"""The one base of every error a user can cause: the ``edgefl`` command catches it, prints its ``str()`` (one
line) and exits 2. Every package imports it; it imports nothing."""


class EdgeflError(Exception):
    """A setting, input or environment that cannot work; ``str()`` is one line for the user."""
