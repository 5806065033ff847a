"""Activation recompute: the layers the plan lists in ``recompute`` keep only their inputs in
the forward pass and run their forward again during backward.

The planner priced the memory this saves and the forward it repeats (``strategy.recompute``:
``full`` lists every block, ``selective`` each block's attention sub-layer); this module does
what the plan lists, with Paddle's own ``paddle.distributed.fleet.utils.recompute``, which
works on distributed tensors and restores the random state, so dropout draws the same mask
twice (docs/paddle-notes.md).

A listed layer that is also a local view (``plan.local_view``: selective recompute of an
attention run on each rank's heads) is recomputed inside the view, as Megatron-LM recomputes:
applier/modes/local_calls.py hands :func:`recomputing` the sub-layer's forward on the rank's local
input and parameter values, so the backward runs that forward again on local tensors while the
view's all-reduces (its output's sum over mp, its input gradient's) run once, outside.

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


def recomputed_inside_views(plan: Plan) -> frozenset[str]:
    """The layers of ``plan.recompute`` that are local views: recomputed inside the view, on
    local tensors (applier/modes/local_calls.py), not by :func:`wrap_recompute`."""
    return frozenset(plan.recompute) & {view.layer for view in plan.local_view}


def wrap_recompute(model: paddle.nn.Layer, plan: Plan) -> None:
    """Make each layer in ``plan.recompute`` recompute its forward in backward, but those
    :func:`recomputed_inside_views`. The layer's own hooks (the plan's reshards,
    sequence-parallel hand-offs) stay outside the recompute: they wrap ``forward``, which is what
    is replaced."""
    layers = dict(model.named_sublayers())
    for fqn in sorted(set(plan.recompute) - recomputed_inside_views(plan)):
        layer = layers[fqn]
        layer.forward = _recomputed(layer.forward)


def recomputing(function: Any, *args: Any, **kwargs: Any) -> Any:
    """``function(*args, **kwargs)`` keeping only its inputs, run again in backward (the tensors
    among ``args`` get their gradients); a plain call where no gradient is taken (evaluation:
    nothing to save, nothing to redo). A tuple or list it returns with None items (HF's
    ``(hidden_states, None)``, DeBERTa-v2's layers) comes back as returned: Paddle's recompute
    hands its backward one gradient per tensor output and asserts they match its outputs, so
    the Nones are left out of what it sees and put back after.

    >>> x = paddle.ones([2], dtype="float32"); x.stop_gradient = False
    >>> def scaled(t, scale=1.0, shift=0.0):
    ...     return t * scale - shift, None
    >>> out = recomputing(scaled, x, shift=paddle.full([2], 1.0), scale=paddle.full([2], 3.0))
    >>> out[0].sum().backward(); out[0].tolist(), out[1], x.grad.tolist()
    ([2.0, 2.0], None, [3.0, 3.0])
    """
    if not paddle.is_grad_enabled():
        return function(*args, **kwargs)
    holes: list[tuple[type, list[bool]]] = []  # the first run's: its sequence type, where it held None

    # Paddle's recompute binds the call to the function's signature (keywords put in their
    # places) and calls it positionally: the wrapper shows it the function's own.
    @functools.wraps(function)
    def without_nones(*inner_args: Any, **inner_kwargs: Any) -> Any:
        out = function(*inner_args, **inner_kwargs)
        if type(out) not in (tuple, list) or all(item is not None for item in out):
            return out
        holes[:] = holes or [(type(out), [item is None for item in out])]
        return tuple(item for item in out if item is not None)

    out = recompute(without_nones, *args, **kwargs)
    if not holes:
        return out
    kind, nones = holes[0]
    items = iter(out if isinstance(out, (tuple, list)) else (out,))
    return kind(None if none else next(items) for none in nones)


def _recomputed(forward: Any) -> Any:
    @functools.wraps(forward)
    def run(*args: Any, **kwargs: Any) -> Any:
        return recomputing(forward, *args, **kwargs)

    return run
