"""What runs on the device, apart from Flower's glue: the edge agent that keeps the model, optimizer, data
partition and algorithm state alive between messages, emulated device CPUs, health readings and
``edgefl edge bench``."""
