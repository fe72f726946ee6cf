"""Flower glue on the client side: the thin ClientApp that relays each message to the edge agent, and the
message layout both ends speak. Imports no torch: Flower starts this in a fresh process per message."""
