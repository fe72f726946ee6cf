"""Local training and evaluation on the device: minibatch SGD (``SGD``: torch's own update, without
``torch.optim``), whose state (momentum) lives as long as the trainer, across rounds, on the objective the run's
strategy gives (``strategies.strategy.LocalObjective``: FedProx's proximal term, SCAFFOLD's correction)."""

from __future__ import annotations

import time

import numpy as np
import torch
from torch import nn

from contract.errors import PeerError
from ml.data import Dataset, Rows
from strategies.strategy import PLAIN, LocalObjective


class ObjectiveError(PeerError, ValueError):
    """A local objective whose vectors do not fit the model (the drift the server sent with a global model);
    ``str()`` is the one-line reason."""


class SGD:
    """SGD with momentum, the update of ``torch.optim.SGD`` on the CPU (its single-tensor path, op for op, so the
    parameters come out bit for bit the same): v ← g the first step, v ← m·v + g after it; w ← w − η·v.
    ``torch.optim``'s optimizers import ``torch._dynamo`` when they are made and on every step (~70 MB of a
    device's memory, for a compiler the agent never uses); this one does not."""

    def __init__(self, params: list[nn.Parameter], lr: float, momentum: float) -> None:
        self.params = params
        self.lr = lr
        self.momentum = momentum
        self.buffers: list[torch.Tensor | None] = [None] * len(params)

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def step(self) -> None:
        for i, p in enumerate(self.params):
            if p.grad is None:
                continue
            grad = p.grad
            if self.momentum != 0.0:
                buf = self.buffers[i]
                if buf is None:
                    buf = self.buffers[i] = grad.detach().clone()
                else:
                    buf.mul_(self.momentum).add_(grad)
                grad = buf
            p.add_(grad, alpha=-self.lr)


class LocalTrainer:
    """K local steps at a time over one client's partition, reshuffled (seeded) every epoch."""

    def __init__(
        self,
        model: nn.Module,
        x: Rows,
        y: np.ndarray,
        batch_size: int,
        lr: float,
        momentum: float,
        seed: int,
    ) -> None:
        self.model = model
        self.attach(x, y)
        self.batch_size = min(batch_size, len(y))
        self.optimizer = SGD(list(model.parameters()), lr, momentum)
        self._rng = np.random.default_rng(seed)
        self._order = self._rng.permutation(len(y))
        self._pos = 0
        self._loss = nn.CrossEntropyLoss()

    def attach(self, x: Rows, y: np.ndarray) -> None:
        """The partition to train on (compact; each minibatch is made model-ready as it is drawn)."""
        self.x = x
        self.y = torch.from_numpy(y)

    def _next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._pos + self.batch_size > len(self._order):
            self._order = self._rng.permutation(len(self._order))
            self._pos = 0
        idx = self._order[self._pos : self._pos + self.batch_size]
        self._pos += self.batch_size
        return torch.from_numpy(self.x[idx]), self.y[torch.from_numpy(idx)]

    def set_lr(self, lr: float) -> None:
        self.optimizer.lr = lr

    def train_steps(self, steps: int, objective: LocalObjective = PLAIN) -> float:
        """Run ``steps`` optimizer steps, each on the data's loss plus ``objective``'s terms (added to the
        gradient: μ (w − w_anchor) + drift); returns the mean training loss (of the data alone)."""
        self.model.train()
        terms = None if objective.plain else self._terms(objective)
        total = 0.0
        for _ in range(steps):
            xb, yb = self._next_batch()
            self.optimizer.zero_grad()
            loss = self._loss(self.model(xb), yb)
            loss.backward()
            if terms is not None:
                self._add_terms(objective.mu, terms)
            self.optimizer.step()
            total += float(loss.detach())
        return total / max(steps, 1)

    def _terms(self, objective: LocalObjective) -> list[tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]]:
        """Per parameter: the anchor's and the drift's slice of their flat vectors (``get_flat_params`` order)."""
        params = list(self.model.parameters())
        anchor = None if objective.mu == 0.0 or objective.anchor is None else torch.from_numpy(objective.anchor)
        drift = None if objective.drift is None else torch.from_numpy(objective.drift)
        size = sum(p.numel() for p in params)
        for name, flat in (("anchor", anchor), ("drift", drift)):
            if flat is not None and flat.numel() != size:
                raise ObjectiveError(f"the objective's {name} has {flat.numel()} values, the model {size}")
        terms, at = [], 0
        for p in params:
            n = p.numel()
            terms.append((
                p,
                None if anchor is None else anchor[at : at + n].view_as(p),
                None if drift is None else drift[at : at + n].view_as(p),
            ))  # fmt: skip
            at += n
        return terms

    @staticmethod
    @torch.no_grad()
    def _add_terms(mu: float, terms: list[tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]]) -> None:
        for p, anchor, drift in terms:
            if p.grad is None:
                continue
            if anchor is not None:
                p.grad.add_(p - anchor, alpha=mu)
            if drift is not None:
                p.grad.add_(drift)


@torch.no_grad()
def evaluate(model: nn.Module, x: Rows, y: np.ndarray, batch_size: int = 1000) -> tuple[float, float]:
    """Mean cross-entropy and accuracy on (x, y)."""
    model.eval()
    loss_sum, correct = 0.0, 0
    for start in range(0, len(y), batch_size):
        xb = torch.from_numpy(x[start : start + batch_size])
        yb = torch.from_numpy(y[start : start + batch_size])
        logits = model(xb)
        loss_sum += float(nn.functional.cross_entropy(logits, yb, reduction="sum"))
        correct += int((logits.argmax(dim=1) == yb).sum())
    return loss_sum / len(y), correct / len(y)


STEP_SAMPLES = 50  # timed local steps (after 5 untimed) that set a machine's seconds per step


def seconds_per_step(
    model: nn.Module, dataset: Dataset, batch_size: int, lr: float, momentum: float, seed: int,
    window_s: float | None = None,
) -> float:  # fmt: skip
    """Seconds of one local step of ``model`` on ``dataset``'s first rows at ``batch_size``, on the threads torch
    has: the median of ``STEP_SAMPLES`` steps (the clock's unit on the host: ``fl_server.simulation.host_step_s``),
    or with ``window_s`` the mean of the steps that fill that much wall time (under a CPU quota, which a short step
    can run inside uncapped, or on a device: ``edgefl edge bench --write-profile``)."""
    rows = np.arange(min(len(dataset.y_train), 50 * batch_size))
    trainer = LocalTrainer(model, dataset.x_train.subset(rows), dataset.y_train[rows], batch_size, lr, momentum, seed)
    trainer.train_steps(5)
    if window_s is not None:
        steps, start = 0, time.perf_counter()
        while (elapsed := time.perf_counter() - start) < window_s:
            trainer.train_steps(1)
            steps += 1
        return elapsed / steps
    samples = []
    for _ in range(STEP_SAMPLES):
        start = time.perf_counter()
        trainer.train_steps(1)
        samples.append(time.perf_counter() - start)
    return float(np.median(samples))
