"""Activation recompute: the layers the plan lists in ``recompute`` keep only their inputs in
the forward pass and run their forward again during backward.

The planner priced the memory this saves and the forward it repeats (``strategy.recompute``:
``full`` lists every block, ``selective`` each block's attention sub-layer); this module does
what the plan lists, with Paddle's own ``paddle.distributed.fleet.utils.recompute``, which
works on distributed tensors and restores the random state, so dropout draws the same mask
twice (docs/paddle-notes.md).

Example::

    >>> plan.strategy.recompute, plan.recompute[:1]                 # doctest: +SKIP
    ('full', ['llama.layers.0'])
    >>> wrap_recompute(model, plan)                                 # doctest: +SKIP
"""

from __future__ import annotations

import functools
from typing import Any

import paddle
from paddle.distributed.fleet.utils import recompute

from autodist.schemas import Plan


def recompute_problems(model: paddle.nn.Layer, plan: Plan) -> list[str]:
    """Listed layers that the model does not have."""
    layers = dict(model.named_sublayers())
    return [
        f'$.recompute[{i}]: no sub-layer "{fqn}" in the model'
        for i, fqn in enumerate(plan.recompute)
        if fqn not in layers
    ]


def wrap_recompute(model: paddle.nn.Layer, plan: Plan) -> None:
    """Make each layer in ``plan.recompute`` recompute its forward in backward. The layer's
    own hooks (the plan's reshards, sequence-parallel hand-offs) stay outside the recompute:
    they wrap ``forward``, which is what is replaced."""
    layers = dict(model.named_sublayers())
    for fqn in plan.recompute:
        layer = layers[fqn]
        layer.forward = _recomputed(layer.forward)


def _recomputed(forward: Any) -> Any:
    @functools.wraps(forward)
    def run(*args: Any, **kwargs: Any) -> Any:
        if not paddle.is_grad_enabled():  # evaluation: nothing to save, nothing to redo
            return forward(*args, **kwargs)
        return recompute(forward, *args, **kwargs)

    return run
