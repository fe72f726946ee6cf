"""Flower glue on the server side: the ServerApp, the message loop that drives ``strategies.rounds`` through
Flower's push/pull API, and the results it writes (rounds.jsonl, summary.json, checkpoints)."""
