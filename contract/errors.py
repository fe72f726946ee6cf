"""The two bases of edgefl's errors. ``EdgeflError``: every error a user can cause; the ``edgefl`` command catches
it, prints its ``str()`` (one line) and exits 2. ``PeerError``: every message from the other end that cannot be
taken; the receiver logs its ``str()`` and refuses the message. The two are disjoint. A subclass may add
``ValueError`` or ``RuntimeError`` as a second base so that callers catching those still catch it. Every package
imports this module; it imports nothing."""


class EdgeflError(Exception):
    """A setting, input or environment that cannot work; ``str()`` is one line for the user."""


class PeerError(Exception):
    """A message from the other end (a device's reply, the server's instruction, a payload) that cannot be taken;
    ``str()`` is the one-line reason the receiver logs and refuses it with. Not an ``EdgeflError``: the user did
    nothing wrong, and the receiver refuses the message and goes on."""
