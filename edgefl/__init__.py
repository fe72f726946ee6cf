"""The ``edgefl`` command: configuration, the launcher that runs a real Flower deployment, reports."""
