"""The algorithms, as plain numpy: FedAvg's weighted mean, DGA's delayed correction, the round engine's state
machine, and the update codecs. Nothing here imports Flower or touches the network."""
