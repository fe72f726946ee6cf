"""The models of ``ml.catalog``'s table, small enough to train on a Raspberry Pi 4, and their parameters as one
flat float32 vector.

The models have parameters only (no BatchNorm, no buffers: ResNet-8 normalizes with GroupNorm), so the flat
vector describes a model completely, and they use only ops that ``torch.onnx.export`` supports.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from torch import nn
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from ml.catalog import AUTO, MODELS, ModelError, resolve_model
from ml.data import Dataset

MIN_IMAGE_SIDE = 8
POOLED_MIN_SIDE = 4
CNN_CHANNELS = (16, 32)
CNN_HIDDEN = 64
EARLY_POOL_MIN_SIDE = 16
RESNET_CHANNELS = (16, 32, 64)
GROUP_NORM_GROUPS = 8
CHAR_EMBEDDING_DIM = 8
CHAR_HIDDEN = 128  # char-lstm: one layer
LEAF_HIDDEN, LEAF_LAYERS = 256, 2  # leaf-lstm: LEAF's Shakespeare model


def _pooled_side(side: int) -> int:
    """The smallest divisor of ``side`` that is at least POOLED_MIN_SIDE (4 for 8, 28, 32, 64).

    Adaptive pooling exports to ONNX only when the output size divides the input size.
    """
    return next(size for size in range(POOLED_MIN_SIDE, side + 1) if side % size == 0)


def _early_pool(side: int) -> bool:
    """Halve large images after the first convolution: 4x less work in the second, the costly one."""
    return side >= EARLY_POOL_MIN_SIDE and side % 2 == 0


class ImageCNN(nn.Module):
    """conv3x3(16) -> ReLU [-> max-pool 2 on images ≥ 16 px] -> conv3x3(32) -> ReLU -> adaptive max-pool
    -> FC(64) -> ReLU -> FC(classes).

    About 102k parameters for 28x28 inputs (pooled to 7x7), 35k for 8x8 (pooled to 4x4).
    """

    def __init__(self, height: int, width: int, num_classes: int) -> None:
        super().__init__()
        early = _early_pool(height) and _early_pool(width)
        side = (height // 2, width // 2) if early else (height, width)
        pooled = (_pooled_side(side[0]), _pooled_side(side[1]))
        self.layers = nn.Sequential(
            nn.Conv2d(1, CNN_CHANNELS[0], kernel_size=3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2) if early else nn.Identity(),
            nn.Conv2d(CNN_CHANNELS[0], CNN_CHANNELS[1], kernel_size=3, padding=1),
            nn.ReLU(),
            nn.AdaptiveMaxPool2d(pooled),
            nn.Flatten(),
            nn.Linear(CNN_CHANNELS[1] * pooled[0] * pooled[1], CNN_HIDDEN),
            nn.ReLU(),
            nn.Linear(CNN_HIDDEN, num_classes),
        )

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """Class logits (N, classes) for images (N, 1, H, W)."""
        return self.layers(images)


class BasicBlock(nn.Module):
    """ResNet's basic block (He et al. 2016) with GroupNorm: x + F(x), F = conv3x3 -> GN -> ReLU -> conv3x3 -> GN;
    a strided 1x1 convolution matches the shortcut when the block halves the side or changes the channels."""

    def __init__(self, inputs: int, outputs: int, stride: int) -> None:
        super().__init__()
        self.residual = nn.Sequential(
            nn.Conv2d(inputs, outputs, 3, stride=stride, padding=1, bias=False),
            nn.GroupNorm(GROUP_NORM_GROUPS, outputs),
            nn.ReLU(),
            nn.Conv2d(outputs, outputs, 3, padding=1, bias=False),
            nn.GroupNorm(GROUP_NORM_GROUPS, outputs),
        )
        same = stride == 1 and inputs == outputs
        self.shortcut = nn.Identity() if same else nn.Conv2d(inputs, outputs, 1, stride=stride, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.residual(x) + self.shortcut(x))


class ResNet8(nn.Module):
    """conv3x3(16) -> GN -> ReLU -> blocks of 16, 32 (stride 2), 64 (stride 2) channels -> global average pool ->
    FC(classes): ResNet-8 for small gray images, ~78k parameters whatever their size."""

    def __init__(self, num_classes: int) -> None:
        super().__init__()
        first = RESNET_CHANNELS[0]
        blocks, inputs = [], first
        for i, outputs in enumerate(RESNET_CHANNELS):
            blocks.append(BasicBlock(inputs, outputs, stride=1 if i == 0 else 2))
            inputs = outputs
        self.layers = nn.Sequential(
            nn.Conv2d(1, first, 3, padding=1, bias=False),
            nn.GroupNorm(GROUP_NORM_GROUPS, first),
            nn.ReLU(),
            *blocks,
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Linear(RESNET_CHANNELS[-1], num_classes),
        )

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """Class logits (N, classes) for images (N, 1, H, W)."""
        return self.layers(images)


class CharLSTM(nn.Module):
    """Next-character model: Embedding(vocab, 8) -> LSTM(hidden) x layers -> Linear(vocab) on the last step.
    ``char-lstm`` is one layer of 128; ``leaf-lstm`` LEAF's two layers of 256."""

    def __init__(self, vocab_size: int, hidden: int = CHAR_HIDDEN, layers: int = 1) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocab_size, CHAR_EMBEDDING_DIM)
        self.lstm = nn.LSTM(CHAR_EMBEDDING_DIM, hidden, num_layers=layers, batch_first=True)
        self.output = nn.Linear(hidden, vocab_size)

    def forward(self, chars: torch.Tensor) -> torch.Tensor:
        """Logits (N, vocab) of the character following each int64 sequence in (N, SEQ_LEN)."""
        hidden, _ = self.lstm(self.embedding(chars))
        return self.output(hidden[:, -1])


def build_model(dataset: Dataset, seed: int, model: str = AUTO) -> nn.Module:
    """The model ``model`` (a name in ``ml.catalog.MODELS``, or ``auto``) for ``dataset``, initialised
    deterministically from ``seed`` (global RNG state untouched); raises ModelError if it does not fit the data."""
    if dataset.kind not in ("image", "text"):
        raise ModelError(f"no model for data set kind {dataset.kind!r}: expected 'image' or 'text'")
    name = resolve_model(model, dataset.kind, dataset.name).name
    if dataset.kind == "image":
        channels, height, width = dataset.x_train.shape[1:]
        if channels != 1 or min(height, width) < MIN_IMAGE_SIDE:
            raise ModelError(
                f"images must be 1 x H x W with H, W >= {MIN_IMAGE_SIDE}, got {channels} x {height} x {width}"
            )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return _BUILDERS[name](dataset)


_BUILDERS: dict[str, Callable[[Dataset], nn.Module]] = {  # one per row of ml.catalog.MODELS
    "cnn": lambda data: ImageCNN(*data.x_train.shape[2:], data.num_classes),
    "resnet8": lambda data: ResNet8(data.num_classes),
    "char-lstm": lambda data: CharLSTM(data.num_classes),
    "leaf-lstm": lambda data: CharLSTM(data.num_classes, LEAF_HIDDEN, LEAF_LAYERS),
}
assert set(_BUILDERS) == set(MODELS), "ml.catalog.MODELS and ml.models._BUILDERS name different models"


def param_layout(model: nn.Module) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """(name, shape) of every parameter, in ``model.parameters()`` order (the flat vector's order)."""
    return tuple((name, tuple(param.shape)) for name, param in model.named_parameters())


def get_flat_params(model: nn.Module) -> np.ndarray:
    """A float32 1-D copy of all parameters, concatenated in ``parameters()`` order."""
    return parameters_to_vector(model.parameters()).detach().cpu().numpy().astype(np.float32, copy=True)


def set_flat_params(model: nn.Module, flat: np.ndarray) -> None:
    """Overwrite all parameters from a 1-D vector in ``get_flat_params`` layout (the model keeps a copy)."""
    flat = np.asarray(flat)
    expected = sum(param.numel() for param in model.parameters())
    if flat.ndim != 1 or flat.size != expected:
        raise ModelError(f"parameter vector has shape {flat.shape}, the model needs ({expected},)")
    with torch.no_grad():
        vector_to_parameters(torch.tensor(flat, dtype=torch.float32), model.parameters())
