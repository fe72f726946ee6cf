"""Flower glue on the device: the ClientApp, served inside the edge agent's long-lived process over the
SuperNode's Runtime API (``--isolation process``), and the tuned SuperNode that starts no process per message."""
