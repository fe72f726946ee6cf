"""Flower glue on the server side: the ServerApp, the message loop that drives ``strategies.rounds`` through
Flower's push/pull API, who trains which partition, and Flower's own FedAvg as a baseline."""
