"""One training step of a model file, owned once: ``examples/train.py`` trains with it and
``autodist-plan calibrate --model`` times it, so the step calibrate measures is the step training runs.

A model file (the contract ``autodist-plan`` and ``examples/train.py`` share) gives its loss one of
two ways (:func:`model_loss`): a module-level ``loss_fn(output, labels)`` beside a
``forward(input_ids)`` that returns logits, or a ``forward(input_ids=, labels=)`` that returns the
loss (or a tuple whose first item is the loss). A step (:func:`train_step`) is that loss, its value
read on this rank (:func:`loss_value`: under a plan a collective, on every rank, each step), the
backward and the optimizer's step. The data is random token ids (:func:`token_loader`).

Example, on one device::

    >>> import paddle
    >>> class TinyLM(paddle.nn.Layer):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.embed, self.head = paddle.nn.Embedding(32, 8), paddle.nn.Linear(8, 32)
    ...     def forward(self, input_ids, labels=None):
    ...         logits = self.head(self.embed(input_ids))
    ...         return paddle.nn.functional.cross_entropy(logits, labels.unsqueeze(-1)).mean(), logits
    >>> _ = paddle.seed(0); model = TinyLM()
    >>> optimizer = paddle.optimizer.AdamW(parameters=model.parameters())
    >>> loader = token_loader(vocab_size(model), batch=2, seq=4, steps=2, seed=0)
    >>> gives_loss(model, loss_fn=None)
    True
    >>> [3.0 < train_step(model_loss(model, None), optimizer, batch) < 4.0 for batch in loader]   # about ln(32)
    [True, True]
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

import numpy as np
import paddle

from autodist.applier.modes.whole_metrics import whole_value

#: ``(batch) -> loss``: the loss of one batch from the loader (:func:`model_loss`).
LossOf = Callable[[Any], paddle.Tensor]


def gives_loss(model: paddle.nn.Layer, loss_fn: Callable | None) -> bool:
    """Whether the model file gives a loss (:func:`model_loss`'s two ways): a ``loss_fn`` beside
    the model, or a ``forward`` that takes ``labels``."""
    return callable(loss_fn) or "labels" in inspect.signature(model.forward).parameters


def model_loss(model: paddle.nn.Layer, loss_fn: Callable | None) -> LossOf:
    """``(input_ids, labels) -> loss``: ``loss_fn(model(input_ids), labels)`` when the model file
    defines ``loss_fn``, else the loss ``model(input_ids=, labels=)`` computes (its first item)."""

    def loss_of(batch: Any) -> paddle.Tensor:
        input_ids, labels = batch
        if callable(loss_fn):
            return loss_fn(model(input_ids), labels)
        out = model(input_ids=input_ids, labels=labels)
        return out[0] if isinstance(out, (tuple, list)) else out

    return loss_of


def loss_value(tensor: paddle.Tensor) -> float:
    """A scalar's value on this rank, gathered first when it is distributed (every rank reads it)."""
    return float(whole_value(tensor).numpy())


def train_step(loss_of: LossOf, optimizer: Any, batch: Any) -> float:
    """One step on ``batch``: the loss, its value read (returned), backward, the optimizer's step
    and cleared gradients (a plan that accumulates steps the optimizer on its last micro-batch)."""
    loss = loss_of(batch)
    value = loss_value(loss)
    loss.backward()
    optimizer.step()
    optimizer.clear_grad()
    return value


def vocab_size(model: paddle.nn.Layer) -> int | None:
    """Rows of the first embedding table: the token ids the random data may use (None: no ``nn.Embedding``)."""
    for layer in model.sublayers(include_self=True):
        if isinstance(layer, paddle.nn.Embedding):
            return int(layer.weight.shape[0])
    return None


def token_loader(vocab: int, batch: int, seq: int, steps: int, seed: int) -> paddle.io.DataLoader:
    """``steps`` batches of ``batch`` x ``seq`` random token ids below ``vocab`` from ``seed``, with
    their labels (the ids shifted by one)."""
    tokens = np.random.RandomState(seed).randint(0, vocab, size=(steps * batch, seq + 1)).astype("int64")
    dataset = paddle.io.TensorDataset([paddle.to_tensor(tokens[:, :-1]), paddle.to_tensor(tokens[:, 1:])])
    sampler = paddle.io.BatchSampler(dataset, batch_size=batch, shuffle=False, drop_last=True)
    return paddle.io.DataLoader(dataset, batch_sampler=sampler)
