"""The machine learning both ends share: data sets and their partitions, the models, local training and
evaluation, ONNX export. No Flower and no network here."""
