"""What runs on the device: the edge agent that keeps the model, optimizer, data and algorithm state alive
between Flower messages, the local trainer, data sets and models, ONNX export and health readings.

Keep this file import-free: Flower's per-message ClientApp process imports ``edge.protocol`` and must not pay
for torch."""
