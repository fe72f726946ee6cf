"""netem."""
