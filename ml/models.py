"""Models small enough to train on a Raspberry Pi 4, and their parameters as one flat float32 vector.

The models have parameters only (no BatchNorm, no buffers), so the flat vector describes a model completely,
and they use only ops that ``torch.onnx.export`` supports.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from contract.errors import EdgeflError
from ml.data import Dataset

MIN_IMAGE_SIDE = 8
POOLED_MIN_SIDE = 4
CNN_CHANNELS = (16, 32)
CNN_HIDDEN = 64
EARLY_POOL_MIN_SIDE = 16
CHAR_EMBEDDING_DIM = 8
CHAR_HIDDEN = 128


class ModelError(EdgeflError):
    """A user-facing model problem; str(e) is one clear line."""


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


class CharLSTM(nn.Module):
    """Next-character model: Embedding(vocab, 8) -> 1-layer LSTM(128) -> Linear(vocab) on the last step."""

    def __init__(self, vocab_size: int) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocab_size, CHAR_EMBEDDING_DIM)
        self.lstm = nn.LSTM(CHAR_EMBEDDING_DIM, CHAR_HIDDEN, batch_first=True)
        self.output = nn.Linear(CHAR_HIDDEN, vocab_size)

    def forward(self, chars: torch.Tensor) -> torch.Tensor:
        """Logits (N, vocab) of the character following each int64 sequence in (N, SEQ_LEN)."""
        hidden, _ = self.lstm(self.embedding(chars))
        return self.output(hidden[:, -1])


def build_model(dataset: Dataset, seed: int) -> nn.Module:
    """The model for ``dataset``, initialised deterministically from ``seed`` (global RNG state untouched)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if dataset.kind == "text":
            return CharLSTM(dataset.num_classes)
        if dataset.kind != "image":
            raise ModelError(f"no model for data set kind {dataset.kind!r}: expected 'image' or 'text'")
        channels, height, width = dataset.x_train.shape[1:]
        if channels != 1 or min(height, width) < MIN_IMAGE_SIDE:
            raise ModelError(
                f"images must be 1 x H x W with H, W >= {MIN_IMAGE_SIDE}, got {channels} x {height} x {width}"
            )
        return ImageCNN(height, width, dataset.num_classes)


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
