"""Local-view tensor parallelism, proven at plan time (``plan.local_view``; the applier's
``applier/local_view.py`` runs it).

Today a sub-layer with a fused column projection (an attention's ``q|k|v``, an MLP's
``gate|up``) gets a ``post reshard -> R`` hook on that projection (recognise/reshards.py): what
follows it (the attention core, the gated activation) then runs whole on every rank. Instead, the
sub-layer can run on local tensors, Megatron's way: each rank runs the model's own forward at 1/mp
width on its slice of each segment (``q_r|k_r|v_r``, ``gate_r|up_r``), with the size attributes
it reads set to local values, and the ranks' outputs are summed.

Nothing is assumed about the forward: the planner *proves* each such sub-layer by running it. A
copy with random weights runs once whole (the global run) and ``mp`` times as each rank would
(its slices, its attribute values); the summed outputs and the reassembled gradients (weights
and input, for a random output gradient) must equal the global run's within float tolerance.
The attributes to localise are read off the sub-layer: every integer attribute of it or of its
column projections whose value is a head count or a width the local run divides, such as an
MLP's ``intermediate_size`` (never the head dim, never the row projection's, whose output stays
whole). A sub-layer that cannot be proven keeps the gather hook, with the reason in one note.

Example::

    >>> views, notes = local_views(analysis, model, Strategy(mp=2))   # doctest: +SKIP
    >>> views[0].layer, [(a.name, a.local) for a in views[0].attributes]  # doctest: +SKIP
    ('transformer.h.0.attn', [('num_heads', 2), ('split_size', 16), ('nf', 48)])
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import paddle

from autodist.schemas import LocalAttribute, LocalView, LocalWeight, Plan, Strategy
from autodist.schemas.local_view import hidden_output, local_order, own_order, runs_local_views

from autodist.planner.recognise.analysis import ModelAnalysis
from autodist.planner.recognise.reshards import local_view_candidates
from autodist.planner.recognise.roles import SubLayer

#: Equal within: the local runs reassembled against the global run, float32.
RTOL, ATOL = 1e-4, 1e-5
#: The most weight elements a proof runs with: its random weights, gradients and slices are held
#: on the planning machine at once (about five float32 copies: ~1.3 GB at this bound). A larger
#: sub-layer keeps the gather, with a note.
MAX_PROOF_ELEMENTS = 2**26


class NotProven(Exception):
    """A local view that does not reproduce the global run (or cannot be run); the message says how."""


@dataclass(frozen=True)
class Candidate:
    """A sub-layer (attention or MLP) whose fused column is gathered today, and its weights' local views."""

    layer: str
    sublayer: SubLayer
    weights: tuple[LocalWeight, ...]


def candidates(analysis: ModelAnalysis) -> list[Candidate]:
    """The sub-layers that may run as local views
    (:func:`~autodist.planner.recognise.reshards.local_view_candidates`), with their weights' views."""
    found = []
    for block in analysis.blocks:
        for layer, sub in local_view_candidates(block):
            weights = []
            for column in sub.columns:
                weights.append(LocalWeight(param=column.weight, dim=column.split_dim, segments=column.fused))
                if column.bias:
                    weights.append(LocalWeight(param=column.bias, dim=0, segments=column.fused))
            weights.append(LocalWeight(param=sub.row.weight, dim=sub.row.split_dim))
            if sub.row.bias:
                weights.append(LocalWeight(param=sub.row.bias, summed=True))
            found.append(Candidate(layer, sub, tuple(weights)))
    return found


def local_views(
    analysis: ModelAnalysis, model: paddle.nn.Layer, strategy: Strategy
) -> tuple[list[LocalView], list[str]]:
    """The proven local views of ``model``'s candidate sub-layers under ``strategy``, and one note
    per candidate that stays gathered, with the reason. Sub-layers of one class with the same
    weights' shapes and attribute values are proven once. Only under tensor (and data)
    parallelism alone (:func:`~autodist.schemas.local_view.runs_local_views`)."""
    mp = strategy.mp
    found = candidates(analysis)
    if not found or mp == 1:
        return [], []
    if not runs_local_views(strategy):
        return [], [
            f"local view: {_counted(found)} with a fused projection stay global (gathered): "
            "local views run under tensor and data parallelism alone (no pipeline, sequence parallelism, ZeRO, "
            "recompute or micro-batches)"
        ]
    layers = dict(model.named_sublayers())
    params = dict(analysis.params)
    views: list[LocalView] = []
    unproven: dict[str, str] = {}
    proven: dict[tuple, str | NotProven] = {}
    for candidate in found:
        layer = layers.get(candidate.layer)
        if layer is None:
            unproven[candidate.layer] = "not a layer of the model"
            continue
        attributes = size_attributes(layer, candidate, params, mp)
        view = LocalView(layer=candidate.layer, weights=list(candidate.weights), attributes=attributes)
        key = (
            type(layer).__qualname__,
            tuple((w.param.removeprefix(candidate.layer), tuple(params[w.param][0])) for w in view.weights),
            tuple((a.layer.removeprefix(candidate.layer), a.name, a.whole) for a in attributes),
        )
        if key not in proven:
            try:
                proven[key] = verify(layer, view, params, mp, _input_shape(analysis, candidate, params))
            except NotProven as exc:  # said once per sub-layer kind, its names relative to the sub-layer
                proven[key] = NotProven(str(exc).replace(candidate.layer + ".", ""))
        outcome = proven[key]
        if isinstance(outcome, NotProven):
            unproven[candidate.layer] = str(outcome)
        else:
            views.append(LocalView(layer=view.layer, weights=view.weights, attributes=attributes, verified=outcome))
    by_reason: dict[str, list[str]] = {}
    for layer_name, reason in unproven.items():
        by_reason.setdefault(reason, []).append(layer_name)
    notes = [
        f"local view: {names[0]}{f' and {len(names) - 1} more like it' if len(names) > 1 else ''} "
        f"stay{'s' if len(names) == 1 else ''} global (fused projection gathered): {reason}"
        for reason, names in by_reason.items()
    ]
    return views, notes


def _counted(found: list[Candidate]) -> str:
    """``12 attention sub-layer(s)``, ``2 attention and 2 mlp sub-layer(s)``."""
    kinds = [c.sublayer.kind for c in found]
    return " and ".join(f"{kinds.count(kind)} {kind}" for kind in sorted(set(kinds))) + " sub-layer(s)"


def size_attributes(layer: paddle.nn.Layer, candidate: Candidate, params: dict, mp: int) -> list[LocalAttribute]:
    """The integer attributes of the sub-layer and its column projections whose values are a
    head count or a width that splits over ``mp`` (at 1/mp of their value), not the head dim.
    The widths are the heads' and each column's, whole and per segment (an MLP's
    ``intermediate_size`` is its gate|up column's segment; it has no heads, whose sizes are 0
    and drop out). Tried and verified as a whole by :func:`verify`."""
    sub = candidate.sublayer
    widths = {sub.num_heads, sub.num_kv_heads, sub.num_heads * sub.head_dim, sub.num_kv_heads * sub.head_dim}
    for column in sub.columns:
        width = params[column.weight][0][column.split_dim]
        widths |= {width, width // column.fused}
    widths = {w for w in widths if w > 0 and w % mp == 0 and w != sub.head_dim}
    owners = [("", layer)] + [
        (name, sublayer)
        for name, sublayer in layer.named_sublayers()
        if any(
            f"{candidate.layer}.{name}" == c.layer or c.layer.startswith(f"{candidate.layer}.{name}.")
            for c in sub.columns
        )
    ]
    found = []
    for name, owner in owners:
        for attribute, value in sorted(vars(owner).items()):
            if type(value) is int and value in widths and attribute.isidentifier() and attribute.isascii():
                path = f"{candidate.layer}.{name}" if name else candidate.layer
                found.append(LocalAttribute(layer=path, name=attribute, whole=value, local=value // mp))
    return found


def _input_shape(analysis: ModelAnalysis, candidate: Candidate, params: dict) -> list[int]:
    """``[batch, seq, width]`` for the verification (:func:`input_shape`)."""
    column = candidate.sublayer.columns[0]
    dim = column.split_dim if column.split_dim is not None else 1
    return input_shape([s.shape for s in analysis.input_specs], params[column.weight][0], dim)


def input_shape(spec_shapes: list[list[int]], column_shape: list[int], column_dim: int) -> list[int]:
    """``[batch, seq, width]``: the traced batch (at most 2) and sequence (at most 8), the column
    projection's input width (the dim of its weight other than the split one)."""
    width = column_shape[1 - column_dim] if len(column_shape) == 2 else column_shape[-1]
    spec = spec_shapes[0] if spec_shapes else []
    batch = spec[0] if len(spec) > 0 and spec[0] > 0 else 2
    seq = spec[1] if len(spec) > 1 and spec[1] > 0 else 4
    return [min(batch, 2), min(seq, 8), width]


def reverify(plan: Plan, model: paddle.nn.Layer) -> list[str]:
    """``autodist-plan check``: each of the plan's local views proven again on ``model`` as it is
    now; one reason per view that no longer holds."""
    layers = dict(model.named_sublayers())
    params = {fqn: (p.shape, p.dtype) for fqn, p in plan.params.items()}
    specs = [s.shape for s in plan.model.input_specs]
    reasons = []
    for view in plan.local_view:
        layer = layers.get(view.layer)
        first = next((w for w in view.weights if w.dim is not None and w.param in params), None)
        if layer is None or first is None or first.dim is None:
            reasons.append(f"local view {view.layer}: no such layer with a split weight in the model")
            continue
        try:
            verify(layer, view, params, plan.strategy.mp, input_shape(specs, params[first.param][0], first.dim))
        except NotProven as exc:
            reasons.append(f"local view {view.layer} no longer holds: {exc}")
    return reasons


def verify(layer: paddle.nn.Layer, view: LocalView, params: dict, mp: int, input_shape: list[int]) -> str:
    """Run ``layer`` with random weights whole and as each of the ``mp`` ranks of ``view``; raise
    :class:`NotProven` naming the first difference. Returns how it was proven. The layer is left
    as it was (parameters, size attributes, train/eval modes)."""
    rng = np.random.default_rng(0)
    slots = _slots(layer, view)
    listed = {w.param for w in view.weights}
    others = sorted(fqn for fqn, _, _ in slots if fqn not in listed)
    if others:
        raise NotProven(f"its parameters {others} are not projections' weights")
    elements = sum(math.prod(params[fqn][0]) for fqn in listed)
    if elements > MAX_PROOF_ELEMENTS:
        raise NotProven(
            f"its weights ({elements} elements) are too large to prove on the planning machine "
            f"(at most {MAX_PROOF_ELEMENTS}, planner/local_view.py MAX_PROOF_ELEMENTS)"
        )
    whole = {fqn: rng.normal(0.0, 0.2, params[fqn][0]).astype("float32") for fqn in listed}
    x = rng.normal(0.0, 1.0, input_shape).astype("float32")
    # The layer itself runs (a lazily built one cannot be copied), in eval mode (no dropout: the
    # runs must see the same values); its parameters, attributes and modes are restored after.
    modes = [(sub, sub.training) for sub in layer.sublayers(include_self=True)]
    layer.eval()
    try:
        out, grads, x_grad, cotangent = _run(layer, slots, whole, x, None, rng)
        outs, local_grads, x_grads = [], [], []
        for rank in range(mp):
            local = {w.param: _local(whole[w.param], w, rank, mp) for w in view.weights}
            with _attributes(layer, view):
                o, g, xg, _ = _run(layer, slots, local, x, cotangent, rng)
            outs.append(o)
            local_grads.append(g)
            x_grads.append(xg)
    except NotProven:
        raise
    except Exception as exc:
        raise NotProven(f"running it failed: {type(exc).__name__}: {_first_line(exc)}") from None
    finally:
        for sub, training in modes:
            sub.training = training
    _compare("output", sum(outs), out)
    _compare("input gradient", sum(x_grads), x_grad)
    for weight in view.weights:
        _compare(
            f"gradient of {weight.param}",
            _reassembled(weight, [g[weight.param] for g in local_grads], mp),
            grads[weight.param],
        )
    return (
        f"{mp} local runs (random weights, input {input_shape}) summed and reassembled equal the global run, "
        f"forward and backward, within rtol {RTOL} and atol {ATOL}"
    )


def _slots(layer: paddle.nn.Layer, view: LocalView) -> list[tuple[str, paddle.nn.Layer, str]]:
    return [
        (f"{view.layer}.{name}.{key}" if name else f"{view.layer}.{key}", sub, key)
        for name, sub in layer.named_sublayers(include_self=True)
        for key, param in sub._parameters.items()
        if param is not None
    ]


def _run(layer, slots, values: dict, x: np.ndarray, cotangent, rng):
    """One forward and backward of ``layer`` with ``values`` as its parameters (plain leaf tensors)."""
    leaves = {fqn: paddle.to_tensor(values[fqn], stop_gradient=False) for fqn, _, _ in slots}
    saved = [(sub, key, sub._parameters[key]) for _, sub, key in slots]
    try:
        for fqn, sub, key in slots:
            sub._parameters[key] = leaves[fqn]
        inp = paddle.to_tensor(x, stop_gradient=False)
        found = hidden_output(layer(inp))
        if found is None or not isinstance(found[0], paddle.Tensor):
            raise NotProven("its forward returns more than one tensor (a cache or attention weights)")
        out = found[0]
        if cotangent is None:
            cotangent = rng.normal(0.0, 1.0, out.shape).astype("float32")
        (out * paddle.to_tensor(cotangent)).sum().backward()
    finally:
        for sub, key, param in saved:
            sub._parameters[key] = param
    grads = {fqn: _numpy(leaf.grad, leaf.shape) for fqn, leaf in leaves.items()}
    return out.numpy(), grads, _numpy(inp.grad, inp.shape), cotangent


def _numpy(grad, shape) -> np.ndarray:
    return np.zeros(shape, "float32") if grad is None else grad.numpy()


def _local(whole: np.ndarray, weight: LocalWeight, rank: int, mp: int) -> np.ndarray:
    """Rank ``rank``'s value of a weight: its slice of each segment, or 1/mp of a summed bias."""
    if weight.summed:
        return whole / mp
    if weight.dim is None:
        return whole
    size = whole.shape[weight.dim]
    order = local_order(size, weight.segments, mp)
    width = size // mp
    return np.take(whole, order[rank * width : (rank + 1) * width], axis=weight.dim)


def _reassembled(weight: LocalWeight, grads: list[np.ndarray], mp: int) -> np.ndarray:
    """The whole gradient from the ranks' (the applier's: slices in the model's own layout; a
    summed bias's gradient is the whole one on each rank, the first rank's is compared)."""
    if weight.summed or weight.dim is None:
        return grads[0]
    joined = np.concatenate(grads, axis=weight.dim)
    return np.take(joined, own_order(joined.shape[weight.dim], weight.segments, mp), axis=weight.dim)


def _compare(what: str, got: np.ndarray, want: np.ndarray) -> None:
    if got.shape != want.shape:
        raise NotProven(f"the local runs' {what} has shape {list(got.shape)}, the global run's {list(want.shape)}")
    if not np.allclose(got, want, rtol=RTOL, atol=ATOL):
        raise NotProven(
            f"the local runs' {what} differs from the global run's by up to {float(np.abs(got - want).max()):.3g}"
        )


class _attributes:
    """Set the view's attributes (on the layer) to their local values for a ``with`` block."""

    def __init__(self, layer: paddle.nn.Layer, view: LocalView):
        layers = {
            (f"{view.layer}.{name}" if name else view.layer): sub
            for name, sub in layer.named_sublayers(include_self=True)
        }
        self.items = [(layers[a.layer], a.name, a.local) for a in view.attributes]
        self.saved: list = []

    def __enter__(self):
        self.saved = [(owner, name, getattr(owner, name)) for owner, name, _ in self.items]
        for owner, name, value in self.items:
            setattr(owner, name, value)

    def __exit__(self, *exc):
        for owner, name, value in self.saved:
            setattr(owner, name, value)


def _first_line(exc: Exception) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:200] if text else ""
