"""Local-view tensor parallelism, proven at plan time (``plan.local_view``; the applier's
``applier/local_view.py`` runs it).

Today a sub-layer with a fused column projection (an attention's ``q|k|v``, an MLP's
``gate|up``) gets a ``post reshard -> R`` hook on that projection (recognise/reshards.py): what
follows it (the attention core, the gated activation) then runs whole on every rank. Instead, the
sub-layer can run on local tensors, Megatron's way: each rank runs the model's own forward at 1/mp
width on its slice of each segment (``q_r|k_r|v_r``, ``gate_r|up_r``), with the size attributes
it reads set to local values, and the ranks' outputs are summed. So can a sub-layer whose split
only ops with no SPMD rule stop (``as_complex``, ``masked_fill``: ``BlockInfo.stopped``), which
the global view leaves replicated: proven, the plan splits it.

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
import typing
from dataclasses import dataclass

import msgspec
import numpy as np
import paddle

from autodist.schemas.plan import DTYPE_BYTES, DType
from autodist.schemas.vocabulary import FLOAT_DTYPES
from autodist.schemas import CallInput, LocalAttribute, LocalView, LocalWeight, Plan, Strategy
from autodist.schemas.local_view import (
    attribute_owner,
    hidden_output,
    local_views_refused,
    rank_positions,
    segment_sizes,
)

from autodist.planner.recognise.analysis import ModelAnalysis
from autodist.planner.recognise.reshards import local_view_candidates, local_weights
from autodist.planner.recognise.roles import SubLayer
from autodist.planner.trace import LayerCall, Opaque, TracedTensor

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
    """A sub-layer (attention or MLP) whose fused column is gathered today, or whose split ops with
    no SPMD rule stop, and its weights' local views."""

    layer: str
    sublayer: SubLayer
    weights: tuple[LocalWeight, ...]

    @property
    def otherwise(self) -> str:
        """How it runs when not a local view: ``fused projection gathered`` or ``replicated: ...``."""
        op = self.sublayer.stopped_by
        return f"replicated: Paddle has no SPMD rule for {op}" if op else "fused projection gathered"


def candidates(analysis: ModelAnalysis, mp: int) -> list[Candidate]:
    """The sub-layers that may run as local views at ``mp``
    (:func:`~autodist.planner.recognise.reshards.local_view_candidates`), with their weights' views."""
    return [
        Candidate(layer, sub, local_weights(sub, analysis.params, mp))
        for block in analysis.blocks
        for layer, sub in local_view_candidates(block)
    ]


def local_views(
    analysis: ModelAnalysis, model: paddle.nn.Layer, strategy: Strategy, calls: dict[str, list[LayerCall]]
) -> tuple[list[LocalView], list[str]]:
    """The proven local views of ``model``'s candidate sub-layers under ``strategy``, and one note
    per candidate that stays gathered, with the reason. Each is proven called as the trace called
    it (``calls``: :func:`call_inputs`). Sub-layers of one class with the same weights' shapes,
    attribute values and call are proven once. Only where the strategy runs local views
    (:func:`~autodist.schemas.local_view.runs_local_views`)."""
    mp = strategy.mp
    found = candidates(analysis, mp)
    if not found or mp == 1:
        return [], []
    refused = local_views_refused(strategy)
    if refused:
        fused = [c for c in found if not c.sublayer.stopped_by]
        stopped = [c for c in found if c.sublayer.stopped_by]
        return [], [
            f"local view: {_counted(group)} {how}: local views do not run with {refused}"
            for group, how in (
                (fused, "with a fused projection stay global (gathered)"),
                (stopped, "whose split ops with no SPMD rule stop stay replicated"),
            )
            if group
        ]
    layers = dict(model.named_sublayers())
    params = dict(analysis.params)
    specs = [s.shape for s in analysis.input_specs]
    views: list[LocalView] = []
    unproven: dict[str, tuple[str, str]] = {}  # layer: (how it runs instead, why)
    proven: dict[tuple, str | NotProven] = {}
    for candidate in found:
        layer = layers.get(candidate.layer)
        if layer is None:
            unproven[candidate.layer] = (candidate.otherwise, "not a layer of the model")
            continue
        try:
            call, dropped = call_inputs(calls.get(candidate.layer, []))
            attributes = size_attributes(layer, candidate, params, mp)
        except (NotProven, ValueError) as exc:  # ValueError: a fused width whose segments do not split over mp
            unproven[candidate.layer] = (candidate.otherwise, str(exc))
            continue
        outcomes: list[str | NotProven] = []
        for weights in _layouts(candidate):
            view = LocalView(
                layer=candidate.layer, weights=weights, attributes=attributes, call=call, dropped_outputs=dropped
            )
            key = (
                type(layer).__qualname__,
                tuple(
                    (
                        msgspec.json.encode(msgspec.structs.replace(w, param=w.param.removeprefix(candidate.layer))),
                        tuple(params[w.param][0]),
                    )
                    for w in weights
                ),
                tuple((a.layer.removeprefix(candidate.layer), a.name, a.whole) for a in attributes),
                msgspec.json.encode(call),
                tuple(dropped),
            )
            if key not in proven:
                try:
                    proven[key] = verify(layer, view, params, mp, proof_shape(view, specs, params))
                except NotProven as exc:  # said once per sub-layer kind, its names relative to the sub-layer
                    proven[key] = NotProven(str(exc).replace(candidate.layer + ".", ""))
            outcome = proven[key]
            outcomes.append(outcome)
            if not isinstance(outcome, NotProven):
                views.append(msgspec.structs.replace(view, verified=outcome))
                break
        else:  # the recognised layout's reason is told: the other is only tried after it
            unproven[candidate.layer] = (candidate.otherwise, str(outcomes[0]))
    by_reason: dict[tuple[str, str], list[str]] = {}
    for layer_name, reason in unproven.items():
        by_reason.setdefault(reason, []).append(layer_name)
    notes = [
        f"local view: {names[0]}{f' and {len(names) - 1} more like it' if len(names) > 1 else ''} "
        f"stay{'s' if len(names) == 1 else ''} global ({otherwise}): {reason}"
        for (otherwise, reason), names in by_reason.items()
    ]
    return views, notes


def _layouts(candidate: Candidate) -> list[list[LocalWeight]]:
    """The fused weights' layouts to prove, in order: their segments as recognised
    (``q_r|k_r|v_r``), then, when that differs, each fused weight whole-head contiguous
    (``segments`` 1: GPT-NeoX lays ``query_key_value`` out head by head, ``[q_h k_h v_h]`` for each
    head, so a rank's contiguous slice holds its heads' q, k and v). The proof decides."""
    recognised = list(candidate.weights)
    contiguous = [msgspec.structs.replace(w, segments=1, sizes=[], replicated=[]) for w in recognised]
    return [recognised] if contiguous == recognised else [recognised, contiguous]


def call_inputs(calls: list[LayerCall]) -> tuple[list[CallInput], list[int]]:
    """How the trace called a sub-layer (the plan's ``LocalView.call``) and which items of its
    output a local view returns as None (``dropped_outputs``): the tensors beside the hidden
    state that nothing outside the call read. Raises :class:`NotProven` for a call a proof cannot
    make or a local view cannot serve: no call, calls with different arguments, an argument that
    is an object (a cache) or carries a gradient besides the hidden input (each rank's gradient
    of it would be its heads' share), an extra output read after the call (a rank holds only its
    heads' part of it)."""
    if not calls:
        raise NotProven("the trace did not call it")
    first = calls[0]
    hidden = _first_tensor(first)
    if hidden is None:
        raise NotProven("it takes no tensor input")
    recorded = [_call_input(value, "", hidden, top=True) for value in first.args] + [
        _call_input(value, keyword, hidden, top=True) for keyword, value in first.kwargs.items()
    ]
    if any(_first_tensor(call) != hidden or call.args != first.args or call.kwargs != first.kwargs for call in calls):
        raise NotProven(f"the trace calls it {len(calls)} times with different arguments")
    dropped = set()
    for call in calls:
        if call.outputs[0] not in ("read", "unread"):
            raise NotProven("its forward returns no tensor first")
        for i, read in enumerate(call.outputs[1:], start=1):
            if read == "read":
                raise NotProven(
                    f"item {i} of its output, a tensor beside the hidden state, is read after it "
                    "(a local view would hold only each rank's heads of it)"
                )
            if read == "other":
                raise NotProven(f"item {i} of its output is neither a tensor nor None")
            if read == "unread":
                dropped.add(i)
    return recorded, sorted(dropped)


def _first_tensor(call: LayerCall) -> TracedTensor | None:
    """The hidden input: the first positional tensor, else the first keyword one (the applier's
    ``map_first_input``)."""
    for value in (*call.args, *call.kwargs.values()):
        if isinstance(value, TracedTensor):
            return value
    return None


def _call_input(value, keyword: str, hidden: TracedTensor, top: bool = False) -> CallInput:
    """One argument as the plan records it, its role decided here (:class:`CallInput`)."""
    if isinstance(value, TracedTensor):
        name = keyword or "a positional argument"
        if value.dtype not in DTYPE_BYTES:
            raise NotProven(f"its input {name} is a {value.dtype} tensor")
        dtype = typing.cast(DType, value.dtype)
        if top and value is hidden:
            return CallInput(role="hidden", keyword=keyword, shape=list(value.shape), dtype=dtype, batch=True)
        if not value.stop_gradient and value.dtype in FLOAT_DTYPES:  # an integer or bool tensor has no gradient
            raise NotProven(
                f"its input {name} carries a gradient (each rank's gradient of it would be its heads' share only)"
            )
        seq = hidden.shape[1] if len(hidden.shape) > 1 else None
        role: typing.Literal["positions", "mask", "tensor"]
        if value.dtype.startswith(("int", "uint")):
            role = "positions"
        elif value.dtype == "bool" or (seq is not None and list(value.shape).count(seq) >= 2):  # selector; seq x seq
            role = "mask"
        else:
            role = "tensor"
        batch = len(value.shape) > 0 and value.shape[0] == hidden.shape[0]
        return CallInput(role=role, keyword=keyword, shape=list(value.shape), dtype=dtype, batch=batch)
    if isinstance(value, (tuple, list)):
        items = [_call_input(item, "", hidden) for item in value]
        return CallInput(role="tuple" if isinstance(value, tuple) else "list", keyword=keyword, items=items)
    if value is None or isinstance(value, (bool, int, float, str)):
        return CallInput(role="literal", keyword=keyword, value=value)
    what = value.type_name if isinstance(value, Opaque) else type(value).__name__
    raise NotProven(f"its argument {keyword or '(positional)'} is a {what}, which a proof cannot make")


def _counted(found: list[Candidate]) -> str:
    """``12 attention sub-layer(s)``, ``2 attention and 2 mlp sub-layer(s)``."""
    kinds = [c.sublayer.kind for c in found]
    return " and ".join(f"{kinds.count(kind)} {kind}" for kind in sorted(set(kinds))) + " sub-layer(s)"


def size_attributes(layer: paddle.nn.Layer, candidate: Candidate, params: dict, mp: int) -> list[LocalAttribute]:
    """The integer attributes of the sub-layer and its column projections whose values are a
    head count or a width that splits over ``mp`` (at 1/mp of their value; a fused column's whole
    width at what a rank computes with, its K and V whole in a multi-query one), not the head dim;
    and the head counts of the objects the sub-layer holds (HF Phi-3 reads
    ``self.config.num_attention_heads``; only head counts there: a config's widths, such as its
    ``hidden_size``, are read whole by the rest of the model). The widths are the heads' and each
    column's, whole and per segment (an MLP's ``intermediate_size`` is its gate|up column's
    segment; it has no heads, whose sizes are 0 and drop out). Tried and verified as a whole by
    :func:`verify`."""
    sub = candidate.sublayer
    widths = {sub.num_heads, sub.num_kv_heads, sub.num_heads * sub.head_dim, sub.num_kv_heads * sub.head_dim}
    local: dict[int, int] = {}  # a fused column's whole width: what a rank computes with
    for column in sub.columns:
        weight = next(w for w in candidate.weights if w.param == column.weight)
        width = params[column.weight][0][column.split_dim]
        sizes = segment_sizes(weight, width)
        widths |= {width, *(size for s, size in enumerate(sizes) if s not in weight.replicated)}
        local[width] = len(rank_positions(weight, width, mp, 0))
    heads = {h for h in (sub.num_heads, sub.num_kv_heads) if h > 0 and h % mp == 0}
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
        path = f"{candidate.layer}.{name}" if name else candidate.layer
        for attribute, value in _int_attributes(vars(owner)):
            if value in widths:
                found.append(
                    LocalAttribute(layer=path, name=attribute, whole=value, local=local.get(value, value // mp))
                )
    for held, value in sorted(vars(layer).items()):
        if _holds_sizes(held, value):
            public = {n: getattr(value, n, None) for n in dir(value) if not n.startswith("_")}
            for attribute, size in _int_attributes(public):
                if size in heads:
                    found.append(
                        LocalAttribute(layer=candidate.layer, name=f"{held}.{attribute}", whole=size, local=size // mp)
                    )
    return found


def _int_attributes(values: dict) -> list[tuple[str, int]]:
    """The integer attributes among ``values`` (an owner's, by name), sorted by name."""
    return [
        (name, value)
        for name, value in sorted(values.items())
        if type(value) is int and name.isidentifier() and name.isascii()
    ]


def _holds_sizes(name: str, value: object) -> bool:
    """An object the layer holds that may hold its sizes (a config): not a layer, tensor,
    container or plain value."""
    plain = (paddle.nn.Layer, paddle.Tensor, int, float, str, bool, tuple, list, dict, set, type(None))
    return (
        name.isidentifier() and name.isascii() and not name.startswith("_")
        and not isinstance(value, plain) and not callable(value)
    )  # fmt: skip


def proof_shape(view: LocalView, spec_shapes: list[list[int]], params: dict) -> list[int]:
    """``[batch, seq, width]`` for the verification: the traced hidden input's, at most 2 by 8
    (its other inputs shrink with it, :func:`_arguments`), or, for a view recorded without its
    call, :func:`input_shape` from the input specs."""
    hidden = next((c for c in view.call if c.role == "hidden"), None)
    if hidden is not None and len(hidden.shape) == 3:
        batch, seq, width = hidden.shape
        return [min(batch, 2), min(seq, 8), width]
    first = next(w for w in view.weights if w.dim is not None)
    return input_shape(spec_shapes, params[first.param][0], first.dim or 0)


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
        if layer is None or not any(w.dim is not None and w.param in params for w in view.weights):
            reasons.append(f"local view {view.layer}: no such layer with a split weight in the model")
            continue
        try:
            verify(layer, view, params, plan.strategy.mp, proof_shape(view, specs, params))
        except NotProven as exc:
            reasons.append(f"local view {view.layer} no longer holds: {exc}")
    return reasons


def verify(layer: paddle.nn.Layer, view: LocalView, params: dict, mp: int, input_shape: list[int]) -> str:
    """Run ``layer`` with random weights whole and as each of the ``mp`` ranks of ``view``; raise
    :class:`NotProven` naming the first difference. Returns how it was proven. The layer is left
    as it was (parameters, size attributes, train/eval modes).

    It is called as ``view.call`` records (:func:`_arguments`): the hidden input random at
    ``input_shape``, the other inputs at the same batch and sequence. Their values need not be the
    model's: what is proven is that the ranks' summed local runs equal the global run for the
    inputs given, and every input but the hidden one is replicated over mp (not split by heads)
    and carries no gradient, so each rank reads the same value the global run reads, whatever
    it is. They are chosen to exercise the forward as training does: a mask is the causal one
    (no row masked whole), position ids are ``arange`` of the sequence (in range of any table
    they index). Outputs beside the hidden state in ``view.dropped_outputs`` are not compared:
    the local view returns None for them."""
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
    arguments = _arguments(view.call, input_shape, rng)
    # The layer itself runs (a lazily built one cannot be copied), in eval mode (no dropout: the
    # runs must see the same values); its parameters, attributes and modes are restored after.
    modes = [(sub, sub.training) for sub in layer.sublayers(include_self=True)]
    layer.eval()
    try:
        out, grads, x_grad, cotangent = _run(layer, slots, whole, x, arguments, view.dropped_outputs, None, rng)
        outs, local_grads, x_grads = [], [], []
        for rank in range(mp):
            local = {w.param: _local(whole[w.param], w, rank, mp) for w in view.weights}
            with _attributes(layer, view):
                o, g, xg, _ = _run(layer, slots, local, x, arguments, view.dropped_outputs, cotangent, rng)
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
            _reassembled(weight, [g[weight.param] for g in local_grads], mp, grads[weight.param].shape),
            grads[weight.param],
        )
    called = f", called with {_described_call(view.call)}" if len(view.call) > 1 else ""
    return (
        f"{mp} local runs (random weights, input {input_shape}{called}) summed and reassembled equal the global "
        f"run, forward and backward, within rtol {RTOL} and atol {ATOL}"
    )


class _Hidden:
    """Where the hidden input goes in :func:`_arguments`' call (each run makes its own)."""


def _arguments(call: list[CallInput], shape: list[int], rng) -> tuple[tuple, dict]:
    """The proof's ``(args, kwargs)`` for ``call`` (:func:`verify` says why these values): numpy
    arrays for tensors, at the proof's batch and sequence (``shape``'s first two dims) where the
    trace had the hidden input's; the hidden input as :class:`_Hidden`. An empty call: the
    hidden input alone."""
    if not call:
        return (_Hidden,), {}
    traced = next(c.shape for c in call if c.role == "hidden")
    seq = traced[1] if len(traced) > 1 else None

    def shrunk(c: CallInput) -> list[int]:
        dims = [shape[1] if d == seq else d for d in c.shape]
        return [shape[0], *dims[1:]] if c.batch and dims else dims

    def value(c: CallInput):
        if c.role == "hidden":
            return _Hidden
        if c.role == "literal":
            return c.value
        if c.role in ("tuple", "list"):
            items = [value(item) for item in c.items]
            return tuple(items) if c.role == "tuple" else items
        dims = shrunk(c)
        if c.role == "positions":
            return np.ascontiguousarray(np.broadcast_to(np.arange(dims[-1] if dims else 1), dims)).astype(c.dtype)
        if c.role == "mask":
            # causal over its last two sequence dims wherever they lie ([b, 1, q, k], or GPT-BigCode's
            # [1, q, 1, k] with the heads beside the query); all visible without two of them
            at = [i for i, d in enumerate(c.shape) if d == seq][-2:]
            visible = np.ones([dims[i] if i in at else 1 for i in range(len(dims))], bool)
            if len(at) == 2:
                causal = np.tril(np.ones((dims[at[0]], dims[at[1]]), bool))
                visible = causal.reshape(visible.shape)
            mask = visible if c.dtype == "bool" else np.where(visible, 0.0, np.finfo("float32").min)
            return np.ascontiguousarray(np.broadcast_to(mask, dims)).astype("bool" if c.dtype == "bool" else "float32")
        if c.dtype.startswith("complex"):
            return (rng.normal(0.0, 1.0, dims) + 1j * rng.normal(0.0, 1.0, dims)).astype(c.dtype)
        return rng.normal(0.0, 1.0, dims).astype("float32")

    args = tuple(value(c) for c in call if not c.keyword)
    return args, {c.keyword: value(c) for c in call if c.keyword}


def _described_call(call: list[CallInput]) -> str:
    """``hidden, attention_mask=mask [2, 1, 8, 8], position_ids=positions [1, 8]`` (the traced shapes)."""

    def one(c: CallInput) -> str:
        if c.role in ("tuple", "list"):
            return "(" + ", ".join(one(item) for item in c.items) + ")"
        return repr(c.value) if c.role == "literal" else c.role if c.role == "hidden" else f"{c.role} {c.shape}"

    return ", ".join(f"{c.keyword}={one(c)}" if c.keyword else one(c) for c in call)


def _slots(layer: paddle.nn.Layer, view: LocalView) -> list[tuple[str, paddle.nn.Layer, str]]:
    return [
        (f"{view.layer}.{name}.{key}" if name else f"{view.layer}.{key}", sub, key)
        for name, sub in layer.named_sublayers(include_self=True)
        for key, param in sub._parameters.items()
        if param is not None
    ]


def _run(layer, slots, values: dict, x: np.ndarray, arguments: tuple[tuple, dict], dropped, cotangent, rng):
    """One forward and backward of ``layer`` with ``values`` as its parameters (plain leaf
    tensors), called with ``arguments`` (:func:`_arguments`) and ``x`` as the hidden input."""
    leaves = {fqn: paddle.to_tensor(values[fqn], stop_gradient=False) for fqn, _, _ in slots}
    saved = [(sub, key, sub._parameters[key]) for _, sub, key in slots]
    inp = paddle.to_tensor(x, stop_gradient=False)

    def tensors(value):
        if value is _Hidden:
            return inp
        if isinstance(value, np.ndarray):
            return paddle.to_tensor(value)
        if isinstance(value, (tuple, list)):
            return type(value)(tensors(item) for item in value)
        return value

    try:
        for fqn, sub, key in slots:
            sub._parameters[key] = leaves[fqn]
        args, kwargs = arguments
        found = hidden_output(layer(*tensors(args), **{k: tensors(v) for k, v in kwargs.items()}), dropped)
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
    """Rank ``rank``'s value of a weight: its columns (:func:`rank_positions`: its slice of each
    split segment, the whole of each replicated one), or 1/mp of a summed bias."""
    if weight.summed:
        return whole / mp
    if weight.dim is None:
        return whole
    return np.take(whole, rank_positions(weight, whole.shape[weight.dim], mp, rank), axis=weight.dim)


def _reassembled(weight: LocalWeight, grads: list[np.ndarray], mp: int, shape: tuple[int, ...]) -> np.ndarray:
    """The whole gradient (of ``shape``) from the ranks', as the applier makes it: each rank's
    added at the columns it computed with (:func:`rank_positions`) and summed over the ranks, so
    a split segment's slices land side by side and a replicated segment's shares add up (a
    summed bias's gradient is the whole one on each rank, the first rank's is compared)."""
    if weight.summed or weight.dim is None:
        return grads[0]
    whole = np.zeros(shape, grads[0].dtype)
    moved = np.moveaxis(whole, weight.dim, 0)  # a view: adding into it adds into ``whole``
    for rank, grad in enumerate(grads):
        np.add.at(moved, rank_positions(weight, shape[weight.dim], mp, rank), np.moveaxis(grad, weight.dim, 0))
    return whole


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
        self.items = [(*attribute_owner(layers[a.layer], a.name), a.local) for a in view.attributes]
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
