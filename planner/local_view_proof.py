"""Local-view tensor parallelism, proven at plan time (``plan.local_view``; the applier's
``applier/modes/local_calls.py`` runs it).

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
Every run goes through the applier's own call (``applier/modes/local_calls.LocalCall``: parameters and
attributes swapped, the forward run, both restored), so a proof that holds has run that code.

Which integer attributes to localise is found by the proof too (:func:`discover`): the global
run records which integer attributes its forward reads (of the sub-layer, of every child of it,
of every config-like object they hold), those that split over mp are the candidates, and sets of
them are proven in turn, the first that holds kept. Values only order the tries (a set of those
equal to a head count or a width first), so a KV-group count or a rotary width that happens to
equal a head count is left whole once the proof refuses it localised. The proof runs at a batch
and sequence of its own (:func:`proof_sizes`: small primes no size of the sub-layer equals), not
at the user's input spec, so the decision is the same whatever spec the model was traced at.
A sub-layer that cannot be proven keeps the gather hook, with the reason in one note.

Example::

    >>> views, notes = local_views(analysis, model, Strategy(mp=2))   # doctest: +SKIP
    >>> views[0].layer, [(a.name, a.local) for a in views[0].attributes]  # doctest: +SKIP
    ('transformer.h.0.attn', [('num_heads', 2), ('split_size', 16), ('nf', 48)])
"""

from __future__ import annotations

import ast
import inspect
import itertools
import math
import textwrap
import typing
from dataclasses import dataclass

import msgspec
import numpy as np
import paddle

from autodist.schemas.plan import DTYPE_BYTES, DType
from autodist.schemas.fingerprint import dtype_name
from autodist.schemas.vocabulary import FLOAT_DTYPES
from autodist.schemas import CallInput, LocalAttribute, LocalBuffer, LocalView, LocalWeight, Plan, Strategy
from autodist.schemas.local_view import (
    buffer_positions,
    head_positions,
    hidden_output,
    rank_positions,
    segment_sizes,
)
from autodist.schemas.parallel_dims import local_views_refused

from autodist.applier.modes.local_calls import JOINED_UNDER_SEQUENCE_PARALLEL, LocalCall, share_of
from autodist.planner.contained import Crashed, run_forked
from autodist.planner.errors import source_place
from autodist.planner.recognise.analysis import ModelAnalysis, stopped_reason
from autodist.planner.recognise.reshards import local_view_candidates, local_weights
from autodist.planner.recognise.roles import SubLayer
from autodist.planner.recognise.spmd import dynamic
from autodist.planner.trace import LayerCall, Opaque, TracedTensor, in_mode

#: Equal within: the local runs reassembled against the global run, float32, each difference
#: against the largest entry of the global run's array (a gradient summed over thousands of tokens
#: rounds at the scale of its largest entries, not of each entry: Swin's windows at 224 px).
RTOL, ATOL = 1e-4, 1e-5
#: The most weight elements a proof runs with: its random weights, gradients and slices are held
#: on the planning machine at once (about five float32 copies: ~1.3 GB at this bound). A larger
#: sub-layer keeps the gather, with a note.
MAX_PROOF_ELEMENTS = 2**26
#: The most tokens x sequence (one head's scores) a proof runs at for a forward whose sequence is
#: written into it (BEiT's 197 tokens at 224 px, Swin's windows of 49): for 64 heads, the scores are
#: then at most :data:`MAX_PROOF_ELEMENTS` elements, the weights' own bound.
MAX_TRACED_PROOF_SCORES = 2**20


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
        return f"replicated: {stopped_reason(op)}" if op else "fused projection gathered"


def candidates(analysis: ModelAnalysis, mp: int) -> list[Candidate]:
    """The sub-layers that may run as local views at ``mp``
    (:func:`~autodist.planner.recognise.reshards.local_view_candidates`), with their weights' views."""
    return [
        Candidate(layer, sub, local_weights(sub, analysis.params, mp))
        for block in analysis.blocks
        for layer, sub in local_view_candidates(block)
    ]


def local_views(
    analysis: ModelAnalysis,
    model: paddle.nn.Layer,
    strategy: Strategy,
    calls: dict[str, list[LayerCall]],
    again: typing.Callable[[], Rebatched | str],
) -> tuple[list[LocalView], list[str]]:
    """The proven local views of ``model``'s candidate sub-layers under ``strategy``, and one note
    per candidate that stays gathered, with the reason. Each is proven called as the trace called
    it (``calls``: :func:`call_inputs`), which of its inputs follow the batch read from the model
    traced ``again`` at a batch of the planner's own (:func:`rebatched`, called only for a call
    with inputs beside the hidden one). Sub-layers of one class with the same weights' shapes,
    attribute values and call are proven once. Only where the strategy runs local views
    (:func:`~autodist.schemas.parallel_dims.runs_local_views`)."""
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
                (stopped, "whose split the global view stops stay replicated"),
            )
            if group
        ]
    layers = dict(model.named_sublayers())
    params = dict(analysis.params)
    views: list[LocalView] = []
    unproven: dict[str, tuple[str, str]] = {}  # layer: (how it runs instead, why)
    proven: dict[tuple, LocalView | NotProven] = {}  # by sub-layer kind, names relative to the sub-layer
    for candidate in found:
        layer = layers.get(candidate.layer)
        if layer is None:
            unproven[candidate.layer] = (candidate.otherwise, "not a layer of the model")
            continue
        if candidate.sublayer.joined and strategy.sequence_parallel:
            unproven[candidate.layer] = (candidate.otherwise, JOINED_UNDER_SEQUENCE_PARALLEL)
            continue
        try:
            call, dropped = call_inputs(candidate.layer, calls, again, strategy.dp)
            plausible = plausible_sizes(candidate, params, mp)
        except (NotProven, ValueError) as exc:  # ValueError: a fused width whose segments do not split over mp
            unproven[candidate.layer] = (candidate.otherwise, str(exc))
            continue
        view = LocalView(
            layer=candidate.layer,
            weights=list(candidate.weights),
            call=call,
            dropped_outputs=dropped,
            output="joined" if candidate.sublayer.joined else "summed",
        )
        key = _kind(layer, view, params, mp)
        if key not in proven:
            try:
                variants = call_variants(call, candidate.sublayer.num_heads, mp)
                # In a child of its own: a Paddle crash leaves this kind gathered, not every kind.
                sub = candidate.sublayer
                layouts = [
                    fused + extra
                    for fused in _layouts(candidate)
                    for extra in per_head_cuts(layer, view, params, per_unit_sizes(sub), mp)
                ]
                found_view = run_forked(
                    "the local-view proof", discover, layer, view, params, mp, plausible, layouts, variants
                )
                proven[key] = _relative(found_view, "")
            except NotProven as exc:  # said once per sub-layer kind, its names relative to the sub-layer
                why = str(exc).replace(candidate.layer + ".", "").rstrip(", ")
                proven[key] = NotProven(why + input_width_reads(layer))
            except Crashed as crash:
                proven[key] = NotProven(
                    f"{crash} in Paddle, so no local view was proven (a Paddle bug: please report it with the model)"
                )
        outcome = proven[key]
        if isinstance(outcome, NotProven):
            unproven[candidate.layer] = (candidate.otherwise, str(outcome))
        else:
            views.append(_relative(outcome, candidate.layer))
    by_reason: dict[tuple[str, str], list[str]] = {}
    for layer_name, reason in unproven.items():
        by_reason.setdefault(reason, []).append(layer_name)
    notes = [
        f"local view: {names[0]}{f' and {len(names) - 1} more like it' if len(names) > 1 else ''} "
        f"stay{'s' if len(names) == 1 else ''} global ({otherwise}): {reason}"
        for (otherwise, reason), names in by_reason.items()
    ]
    return views, notes


#: The calls whose arguments are sizes: a width read from the input's shape there sizes a tensor.
SIZING_CALLS = frozenset({"reshape", "reshape_", "view", "expand", "broadcast_to", "split", "tile"})


def input_width_reads(layer: paddle.nn.Layer) -> str:
    """Where ``layer``'s forward sizes tensors with its input's width read from the input's shape,
    read from its source (nanoGPT's ``B, T, C = x.shape`` then ``k.reshape([B, T, self.n_head,
    C // self.n_head])``; timm's ``B, N, C = x.shape`` then ``reshape([B, N, C])``): a rank of a
    local view takes the input whole, so ``C`` is the whole width while the rank computes with 1/mp
    of it. :func:`discover` then also proves the view with that read made 1/mp
    (``LocalView.input_width``); when neither holds (the width sizes both a rank's 1/mp tensors and
    whole ones), this is said as the rest of the reason, with the lines and the smallest rewrite
    (``-1`` there, which a reshape infers); "" when the forward has no such read, or Python has no
    source of it.

    >>> class Attention(paddle.nn.Layer):
    ...     def forward(self, x):
    ...         B, T, C = x.shape
    ...         return x.reshape([B, T, 2, C // 2]).reshape([B, T, C])
    >>> print(input_width_reads(Attention()))  # doctest: +ELLIPSIS +NORMALIZE_WHITESPACE
    ; its forward reads its input's width from the input's shape (`B, T, C = x.shape`, ...:3) and
    sizes tensors with it (...: line 4: `C // 2`, `C`), which no proof held with, read whole or as
    the 1/mp a rank computes with; to split it: write -1 for each of those (a reshape infers it)
    """
    try:
        forward = inspect.unwrap(type(layer).forward)
        lines, first = inspect.getsourcelines(forward)
        where, _ = source_place(forward)
        tree = ast.parse(textwrap.dedent("".join(lines)))
    except (OSError, TypeError, SyntaxError):
        return ""
    function = tree.body[0]
    if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)) or len(function.args.args) < 2:
        return ""
    source = textwrap.dedent("".join(lines))
    x = function.args.args[1].arg

    def shape_of_x(node: ast.AST) -> bool:  # x.shape or x.size()
        if isinstance(node, ast.Call) and not node.args:
            node = node.func
        return (
            isinstance(node, ast.Attribute)
            and node.attr in ("shape", "size")
            and isinstance(node.value, ast.Name)
            and node.value.id == x
        )

    read, width = None, ""
    for node in ast.walk(function):
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and shape_of_x(node.value):
            target = node.targets[0]
            if isinstance(target, ast.Tuple) and target.elts and isinstance(target.elts[-1], ast.Name):
                read, width = node, target.elts[-1].id
                break
    if read is None:
        return ""
    parents = {child: node for node in ast.walk(function) for child in ast.iter_child_nodes(node)}
    uses = []
    for node in ast.walk(function):
        if not (isinstance(node, ast.Name) and node.id == width and isinstance(node.ctx, ast.Load)):
            continue
        used: ast.expr = node
        outer = parents.get(node)
        if isinstance(outer, ast.BinOp) and isinstance(outer.op, ast.FloorDiv) and outer.left is node:
            used = outer
        sizing = outer
        while sizing is not None and not (
            isinstance(sizing, ast.Call) and isinstance(sizing.func, ast.Attribute) and sizing.func.attr in SIZING_CALLS
        ):
            sizing = parents.get(sizing)
        if sizing is not None:
            uses.append((node.lineno + first - 1, node.col_offset, ast.get_source_segment(source, used) or width))
    if not uses:
        return ""
    uses.sort()
    at = ", ".join(str(line) for line in dict.fromkeys(line for line, _, _ in uses))
    said = ", ".join(f"`{text}`" for text in dict.fromkeys(text for _, _, text in uses))
    return (
        f"; its forward reads its input's width from the input's shape (`{ast.get_source_segment(source, read)}`, "
        f"{where}:{read.lineno + first - 1}) and sizes tensors with it ({where}: line{'s' * (',' in at)} {at}: {said}), "
        "which no proof held with, read whole or as the 1/mp a rank computes with; to split it: write -1 for each of those "
        "(a reshape infers it)"
    )


def _kind(layer: paddle.nn.Layer, view: LocalView, params: dict, mp: int) -> tuple:
    """What a proof of ``view`` depends on, its names relative to the sub-layer: the class, the
    weights (views and shapes), the call, the buffers (shapes and dtypes) and every integer
    attribute the proof may localise."""
    return (
        type(layer).__qualname__,
        tuple(
            (
                msgspec.json.encode(msgspec.structs.replace(w, param=w.param.removeprefix(view.layer))),
                tuple(params[w.param][0]),
            )
            for w in view.weights
        ),
        msgspec.json.encode(view.call),
        tuple(view.dropped_outputs),
        tuple((fqn.removeprefix(view.layer), tuple(params[fqn][0])) for fqn, _, _ in LocalCall(layer, view).slots),
        tuple(
            (fqn.removeprefix(view.layer), tuple(b.shape), dtype_name(b.dtype))
            for fqn, b in layer.named_buffers(prefix=view.layer)
        ),
        tuple((a.layer.removeprefix(view.layer), a.name, a.whole) for a in _integer_attributes(layer, view.layer, mp)),
    )


def _relative(view: LocalView, layer: str) -> LocalView:
    """``view`` moved to sub-layer ``layer`` ("": its names made relative to its own layer)."""
    old = view.layer

    def moved(name: str) -> str:
        return layer + name.removeprefix(old)

    return msgspec.structs.replace(
        view,
        layer=layer,
        weights=[msgspec.structs.replace(w, param=moved(w.param)) for w in view.weights],
        buffers=[msgspec.structs.replace(b, name=moved(b.name)) for b in view.buffers],
        attributes=[msgspec.structs.replace(a, layer=moved(a.layer)) for a in view.attributes],
    )


#: The most ways of cutting a sub-layer's per-head parameters and buffers :func:`per_head_cuts` offers.
MAX_PER_HEAD = 4


@dataclass(frozen=True)
class Layout:
    """One way each rank takes a local view's tensors, as :func:`discover` proves it: its
    parameters' views (``LocalView.weights``) and the buffers it cuts (``LocalView.buffers``)."""

    weights: list[LocalWeight]
    buffers: list[LocalBuffer]

    def __add__(self, other: Layout) -> Layout:
        return Layout(self.weights + other.weights, self.buffers + other.buffers)


def per_unit_sizes(sub: SubLayer) -> set[int]:
    """The sizes of a sub-layer's dims that hold its units, which each rank takes 1/mp of: an
    attention's heads and the heads' width (``heads * head_dim``), an MLP's intermediate features.

    >>> from autodist.planner.recognise.roles import Projection
    >>> q = Projection("a.q", "a.q.weight", None, "column", 1, name="q")
    >>> sorted(per_unit_sizes(SubLayer("attention", (q,), q, num_heads=4, head_dim=6)))
    [4, 24]
    >>> per_unit_sizes(SubLayer("mlp", (q,), q, intermediate_size=128))
    {128}
    """
    if sub.kind == "attention":
        return {sub.num_heads, sub.num_heads * sub.head_dim} if sub.num_heads > 0 else set()
    return {sub.intermediate_size} if sub.intermediate_size > 0 else set()


def per_head_cuts(layer: paddle.nn.Layer, view: LocalView, params: dict, per_unit: set[int], mp: int) -> list[Layout]:
    """The ways each rank may take the sub-layer's tensors that are no projection's weights, in
    the order :func:`discover` proves them (at most :data:`MAX_PER_HEAD`): each such parameter cut
    to the rank's units along a dim of one of the ``per_unit`` sizes (:func:`per_unit_sizes`:
    ``heads`` entries or the heads' width, a slice of ``head_dim`` per head; an MLP's intermediate
    features), each such dim in turn, like a per-head input (:func:`call_variants`): Swin's
    relative-position-bias table ``[(2W-1)^2, heads]`` read at a buffer of indices and permuted
    onto the scores' heads, GPT-OSS's sinks ``[heads]`` concatenated to them, BEiT's ``q_bias``
    and ``v_bias`` concatenated into its fused projection's bias, SegFormer's Mix-FFN depthwise
    conv ``[intermediate, 1, 3, 3]`` over the intermediate features. Each float buffer with such a
    dim is cut the same way, then taken whole (BEiT's zero ``k_bias`` between those two); the
    others are read whole, as they are. The sizes only name candidates: the proof runs the
    sub-layer with random values of them and holds only where each unit's entries meet that
    unit's alone. One empty layout when there is none, or a parameter has no such dim (the proof
    refuses it then, naming it).

    >>> layer = paddle.nn.Layer(); layer.table = layer.create_parameter([9, 4])
    >>> layer.register_buffer("k_bias", paddle.zeros([8]))
    >>> view = LocalView(layer="attn", weights=[])
    >>> for cut in per_head_cuts(layer, view, {"attn.table": ([9, 4], "float32")}, {4, 8}, mp=2):
    ...     [(w.param, w.dim) for w in cut.weights], [(b.name, b.dim) for b in cut.buffers]
    ([('attn.table', 1)], [('attn.k_bias', 0)])
    ([('attn.table', 1)], [])
    """
    if not per_unit or any(size % mp for size in per_unit):
        return [Layout([], [])]
    per_head = per_unit
    listed = {w.param for w in view.weights}
    others = [fqn for fqn, _, _ in LocalCall(layer, view).slots if fqn not in listed]
    weights = [
        [LocalWeight(param=fqn, dim=d) for d, size in enumerate(params[fqn][0]) if size in per_head] for fqn in others
    ]
    if not all(weights):
        return [Layout([], [])]
    buffers: list[list[LocalBuffer | None]] = [
        [
            LocalBuffer(name=fqn, dim=d, shape=list(value.shape))
            for d, size in enumerate(value.shape)
            if size in per_head
        ]
        + [None]
        for fqn, value in layer.named_buffers(prefix=view.layer)
        if dtype_name(value.dtype) in FLOAT_DTYPES
    ]
    choices = itertools.product(itertools.product(*weights), itertools.product(*buffers))
    return [
        Layout(list(cut), [b for b in kept if b is not None]) for cut, kept in itertools.islice(choices, MAX_PER_HEAD)
    ]


def _layouts(candidate: Candidate) -> list[Layout]:
    """The fused weights' layouts to prove, in order: their segments as recognised
    (``q_r|k_r|v_r``), then, when that differs, each fused weight whole-head contiguous
    (``segments`` 1: GPT-NeoX lays ``query_key_value`` out head by head, ``[q_h k_h v_h]`` for each
    head, so a rank's contiguous slice holds its heads' q, k and v). The proof decides."""
    recognised = list(candidate.weights)
    contiguous = [msgspec.structs.replace(w, segments=1, sizes=[], replicated=[]) for w in recognised]
    return [Layout(w, []) for w in ([recognised] if contiguous == recognised else [recognised, contiguous])]


@dataclass(frozen=True)
class Rebatched:
    """The model traced again with the batch of every input spec set to ``batch``, a prime no dim
    of the first trace's inputs or sub-layer calls equals: its sub-layers' calls by layer. A
    tensor whose dim 0 moved with it (:func:`_follows_batch`) follows the batch by the model's
    own dataflow, whatever sizes the first trace had (a batch of 1, or one equal to the heads)."""

    batch: int
    calls: dict[str, list[LayerCall]]
    traced_batch: int


def rebatched(model: paddle.nn.Layer, input_specs: list, calls: dict[str, list[LayerCall]]) -> Rebatched | str:
    """``model`` traced again at a batch of the planner's own (:class:`Rebatched`), or why it
    does not trace there (a forward that runs at the traced batch only)."""
    from autodist.planner.trace import trace_model

    sizes = {d for spec in input_specs for d in spec.shape}
    sizes |= {d for layer in calls.values() for call in layer for t in _tensors(call) for d in t.shape}
    batch = next(n for n in itertools.count(3) if all(n % k for k in range(2, n)) and n not in sizes)
    specs = [paddle.static.InputSpec([batch, *spec.shape[1:]], spec.dtype, spec.name) for spec in input_specs]
    if not specs or any(not spec.shape for spec in input_specs):
        return "its model has no input spec with a batch dim to trace it again at another batch"
    try:
        program = trace_model(model, specs)
    except Exception as exc:  # noqa: BLE001 -- any failure: the batch cannot be told apart
        return f"the model does not trace at batch {batch} ({_first_line(exc)}), so which inputs follow the batch is unknown"
    return Rebatched(batch=batch, calls=program.layer_calls, traced_batch=input_specs[0].shape[0])


def _tensors(value) -> list[TracedTensor]:
    """Every :class:`TracedTensor` in a call, argument or nested tuple, list or dict."""
    if isinstance(value, TracedTensor):
        return [value]
    if isinstance(value, LayerCall):
        value = [*value.args, *value.kwargs.values()]
    if isinstance(value, dict):
        value = list(value.values())
    return [t for item in value for t in _tensors(item)] if isinstance(value, (tuple, list)) else []


def _follows_batch(traced: TracedTensor, again: object, rebatch: Rebatched) -> bool:
    """Whether ``traced``'s dim 0 follows the batch: traced again at :class:`Rebatched`'s batch,
    it moved with it in proportion (``[B, ...]``, or BLOOM's ``[B * H, ...]``: batch rows of
    ``H`` each). A dim that did not move (a broadcast ``[1, ...]``, a table) does not, whatever it
    equalled in the first trace."""
    if not isinstance(again, TracedTensor) or not traced.shape or len(again.shape) != len(traced.shape):
        raise NotProven("the model traced at another batch calls it with other arguments")
    rows, moved = traced.shape[0], again.shape[0]
    return moved != rows and moved % rebatch.batch == 0 and moved // rebatch.batch * rebatch.traced_batch == rows


def call_inputs(
    layer: str, calls: dict[str, list[LayerCall]], again: typing.Callable[[], Rebatched | str], dp: int
) -> tuple[list[CallInput], list[int]]:
    """How the trace called a sub-layer (the plan's ``LocalView.call``) and which items of its
    output a local view returns as None (``dropped_outputs``): the tensors beside the hidden
    state that nothing outside the call read. Raises :class:`NotProven` for a call a proof cannot
    make or a local view cannot serve: no call, calls with different arguments, an argument that
    is an object (a cache), an extra output read after the call (a rank holds only its heads'
    part of it). A float tensor beside the hidden input that carries a gradient is recorded so
    (``gradient``), how each rank takes it left to the proof (:func:`call_variants`). Which
    tensors beside the hidden input follow the batch (``batch``) the model traced ``again`` at a
    batch of the planner's own says (:func:`_follows_batch`). A model that does not trace there
    (its batch written into its code) is refused at ``dp`` > 1, where each rank takes its rows of
    those; at dp 1 no rank takes rows, and a dim 0 equal to the traced batch only picks the
    proof's first reading of the inputs' sizes (the proof judges)."""
    calls_of = calls.get(layer, [])
    if not calls_of:
        raise NotProven("the trace did not call it")
    first = calls_of[0]
    hidden = _first_tensor(first)
    if hidden is None:
        raise NotProven("it takes no tensor input")
    rebatch: Rebatched | None = None
    seen: LayerCall | None = None
    found = again() if [t for t in _tensors(first) if t is not hidden] else None
    if isinstance(found, str) and dp > 1:
        raise NotProven(f"{found}: at dp {dp} each rank takes its batch rows of them")
    if isinstance(found, Rebatched):
        rebatch, seen = found, next(iter(found.calls.get(layer, [])), None)
        if seen is None or len(seen.args) != len(first.args) or set(seen.kwargs) != set(first.kwargs):
            raise NotProven("the model traced at another batch calls it with other arguments")
    recorded = [
        _call_input(value, "", hidden, seen.args[i] if seen else None, rebatch, top=True)
        for i, value in enumerate(first.args)
    ] + [
        _call_input(value, keyword, hidden, seen.kwargs[keyword] if seen else None, rebatch, top=True)
        for keyword, value in first.kwargs.items()
    ]
    if any(
        _first_tensor(call) != hidden or call.args != first.args or call.kwargs != first.kwargs for call in calls_of
    ):
        raise NotProven(f"the trace calls it {len(calls_of)} times with different arguments")
    dropped = set()
    for call in calls_of:
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


def _call_input(
    value, keyword: str, hidden: TracedTensor, again: object, rebatch: Rebatched | None, top: bool = False
) -> CallInput:
    """One argument as the plan records it, its role decided here (:class:`CallInput`); ``again``
    is the same argument in the model traced at :class:`Rebatched`'s batch."""
    if isinstance(value, TracedTensor):
        name = keyword or "a positional argument"
        if value.dtype not in DTYPE_BYTES:
            raise NotProven(f"its input {name} is a {value.dtype} tensor")
        if dynamic([value.shape]):  # a proof runs at fixed sizes
            raise NotProven(
                f"its input {keyword or '(positional)'} has a size known only at run time ({list(value.shape)} in "
                "the trace: a None in the input spec or a size read with paddle.shape); give the input spec fixed sizes"
            )
        dtype = typing.cast(DType, value.dtype)
        if top and value is hidden:
            return CallInput(role="hidden", keyword=keyword, shape=list(value.shape), dtype=dtype, batch=True)
        role: typing.Literal["positions", "mask", "tensor"]
        if value.dtype.startswith(("int", "uint")):
            role = "positions"
        elif value.dtype == "bool":  # a selector: the proof fills it causal, never a float (:class:`_Proof`)
            role = "mask"
        else:
            role = "tensor"
        if rebatch is not None:
            batch = _follows_batch(value, again, rebatch)
        else:  # not traced again (dp 1, call_inputs): orders the proof's readings only
            batch = bool(value.shape) and value.shape[0] == hidden.shape[0]
        # an integer or bool tensor has no gradient; how a float one's is taken the proof finds (call_variants)
        gradient: typing.Literal["", "whole"] = (
            "whole" if not value.stop_gradient and value.dtype in FLOAT_DTYPES else ""
        )
        return CallInput(
            role=role, keyword=keyword, shape=list(value.shape), dtype=dtype, batch=batch, gradient=gradient
        )
    if isinstance(value, (tuple, list)):
        seen = again if isinstance(again, (tuple, list)) else value
        if rebatch is not None and (seen is value or len(seen) != len(value)):
            raise NotProven("the model traced at another batch calls it with other arguments")
        items = [_call_input(item, "", hidden, other, rebatch) for item, other in zip(value, seen)]
        return CallInput(role="tuple" if isinstance(value, tuple) else "list", keyword=keyword, items=items)
    if value is None or isinstance(value, (bool, int, float, str)):
        return CallInput(role="literal", keyword=keyword, value=value)
    what = value.type_name if isinstance(value, Opaque) else type(value).__name__
    raise NotProven(f"its argument {keyword or '(positional)'} is a {what}, which a proof cannot make")


def _counted(found: list[Candidate]) -> str:
    """``12 attention sub-layer(s)``, ``2 attention and 2 mlp sub-layer(s)``."""
    kinds = [c.sublayer.kind for c in found]
    return " and ".join(f"{kinds.count(kind)} {kind}" for kind in sorted(set(kinds))) + " sub-layer(s)"


def plausible_sizes(candidate: Candidate, params: dict, mp: int) -> dict[int, int]:
    """The sizes an attribute holding them most plausibly needs localised, each with its local
    value: the head counts, the heads' widths and each column's width, whole and per segment, that
    split over ``mp`` (an MLP's ``intermediate_size`` is its gate|up column's segment; it has no
    heads, whose sizes are 0 and drop out), never the head dim. A fused column's whole width maps to
    what a rank computes with (its K and V whole in a multi-query one), any other size to 1/mp of
    it. These values only order the attribute sets :func:`discover` proves: the proof decides.
    Raises ValueError for a fused width whose segments do not split over ``mp``."""
    sub = candidate.sublayer
    widths = {sub.num_heads, sub.num_kv_heads, sub.num_heads * sub.head_dim, sub.num_kv_heads * sub.head_dim}
    local: dict[int, int] = {}
    for column in sub.columns:
        weight = next(w for w in candidate.weights if w.param == column.weight)
        width = params[column.weight][0][column.split_dim]
        sizes = segment_sizes(weight, width)
        widths |= {width, *(size for s, size in enumerate(sizes) if s not in weight.replicated)}
        local[width] = len(rank_positions(weight, width, mp, 0))
    return {w: local.get(w, w // mp) for w in sorted(widths) if w > 0 and w % mp == 0 and w != sub.head_dim}


def _owners(layer: paddle.nn.Layer, path: str) -> list[tuple[str, str, object]]:
    """``(layer path, attribute prefix, object)`` for every object whose integer attributes a
    sub-layer's forward may read sizes from: the sub-layer, each child of it, and each config-like
    object one of them holds (``config.``; one shared by several is listed once, under the first)."""
    found: list[tuple[str, str, object]] = []
    seen: set[int] = set()
    for name, sub in layer.named_sublayers(include_self=True):
        where = f"{path}.{name}" if name else path
        for prefix, owner in [("", sub)] + [
            (f"{held}.", value) for held, value in sorted(vars(sub).items()) if _holds_sizes(held, value)
        ]:
            if id(owner) not in seen:
                seen.add(id(owner))
                found.append((where, prefix, owner))
    return found


def _integer_attributes(layer: paddle.nn.Layer, path: str, mp: int) -> list[LocalAttribute]:
    """Every positive integer attribute of :func:`_owners` that splits over ``mp``, at 1/mp (a
    layer's own, ``vars``; a config's public ones, its class's too), sorted by owner and name."""
    found = []
    for where, prefix, owner in _owners(layer, path):
        values = (
            vars(owner) if not prefix else {n: getattr(owner, n, None) for n in dir(owner) if not n.startswith("_")}
        )
        for name, value in sorted(values.items()):
            if type(value) is int and value > 0 and value % mp == 0 and name.isidentifier() and name.isascii():
                found.append(LocalAttribute(layer=where, name=prefix + name, whole=value, local=value // mp))
    return found


def _holds_sizes(name: str, value: object) -> bool:
    """An object the layer holds that may hold its sizes (a config): not a layer, tensor,
    container or plain value."""
    plain = (paddle.nn.Layer, paddle.Tensor, int, float, str, bool, tuple, list, dict, set, type(None))
    return (
        name.isidentifier() and name.isascii() and not name.startswith("_")
        and not isinstance(value, plain) and not callable(value)
    )  # fmt: skip


#: The most attribute sets :func:`discover` proves for one sub-layer kind: the plausible set, then
#: every set differing from it in one attribute, then in two (a sub-layer reads a handful of sizes:
#: two coincidences, a KV-group count and a rotary width equal to a head count, are covered). Each
#: try runs the sub-layer ``mp`` times at the proof's small sizes (a few milliseconds each), and a
#: wrong set mostly fails at once (a reshape that cannot run), so the bound keeps a refused
#: sub-layer's cost at a fraction of a second.
MAX_ATTRIBUTE_SETS = 64
#: The most readings of which dims of the call's other inputs follow the traced batch and sequence
#: (:func:`_readings`); only the global run, once each, judges them.
MAX_READINGS = 16


def discover(
    layer: paddle.nn.Layer,
    view: LocalView,
    params: dict,
    mp: int,
    plausible: dict[int, int],
    layouts: list[Layout],
    calls: list[list[CallInput]] | None = None,
) -> LocalView:
    """``view`` proven, with the weights' and buffers' layout (of ``layouts``, in order), the way each rank
    takes the call's other inputs (of ``calls``, :func:`call_variants`; ``view.call`` alone by
    default) and the size attributes (:data:`MAX_ATTRIBUTE_SETS` sets at most, ordered by
    ``plausible``) the first proof that holds takes, and how it was proven; :class:`NotProven`
    with the reason of the first layout's most plausible set, called as traced (the last of
    ``calls``), when none holds."""
    calls = calls or [view.call]
    first: NotProven | None = None
    for layout, call in itertools.product(layouts, calls):
        as_traced = call is calls[-1]
        tried = msgspec.structs.replace(view, weights=layout.weights, buffers=layout.buffers, call=call)
        try:
            proof = _Proof.made(layer, tried, params, mp, proof_sizes(layer, tried, params, mp))
        except NotProven as exc:
            first = first or (exc if as_traced else None)
            continue
        candidates = [
            msgspec.structs.replace(a, local=plausible.get(a.whole, a.local))
            for a in _integer_attributes(layer, view.layer, mp)
            if (a.layer, a.name) in proof.read
        ]
        # the input's width as read, whole; then, for a forward that sizes tensors with it, 1/mp
        widths = ["whole", "local"] if input_width_reads(layer) else ["whole"]
        for input_width, attributes in itertools.product(widths, _attribute_sets(candidates, plausible)):
            try:
                verified = proof.check(attributes, input_width)
            except NotProven as exc:
                first = first or (exc if as_traced else None)
                continue
            return msgspec.structs.replace(
                proof.view, attributes=attributes, input_width=input_width, verified=verified
            )
    assert first is not None
    raise first


#: The most ways of taking a call's per-head and gradient-carrying inputs :func:`discover` proves.
MAX_CALLS = 8


def call_variants(call: list[CallInput], heads: int, mp: int) -> list[list[CallInput]]:
    """The ways each rank may take ``call``'s tensors other than the hidden one, in the order
    :func:`discover` proves them, the call as traced last (the proof decides; at most
    :data:`MAX_CALLS`):

    - a float tensor that carries no gradient and has a dim of ``heads`` entries, or ``heads``
      for each batch row at dim 0 (BLOOM's ``[B * H, 1, S]``), cut to the rank's heads along it
      (``CallInput.heads_at``: each such dim in turn), then whole. The traced shapes only name
      candidates: the proof runs at a batch and sequence no size of the sub-layer equals, so a
      cut holds only where the input is added per head to the scores;
    - one that carries a gradient, a 1/mp ``share`` (added to the output: BLOOM's residual; its
      gradient whole on each rank), then ``whole`` (it feeds the heads; its gradient summed).

    >>> bias = CallInput(role="tensor", shape=[1, 4, 1, 9], dtype="float32")
    >>> hidden = CallInput(role="hidden", shape=[2, 9, 32], dtype="float32", batch=True)
    >>> [[c.heads_at for c in v] for v in call_variants([hidden, bias], heads=4, mp=2)]
    [[None, 1], [None, None]]
    """
    hidden = next((c.shape for c in call if c.role == "hidden"), [])

    def options(c: CallInput) -> list[CallInput]:
        if c.role in ("tuple", "list"):
            return [msgspec.structs.replace(c, items=list(items)) for items in _product([options(i) for i in c.items])]
        if c.role != "tensor" or c.dtype not in FLOAT_DTYPES:
            return [c]
        if c.gradient:
            return [msgspec.structs.replace(c, gradient="share"), msgspec.structs.replace(c, gradient="whole")]
        if heads <= 0 or heads % mp:
            return [c]
        cut = [
            msgspec.structs.replace(c, heads_at=d, heads=heads)
            for d, size in enumerate(c.shape)
            if size == heads and not (d == 0 and c.batch)
        ]
        if c.batch and hidden and c.shape[0] == hidden[0] * heads and heads > 1:
            cut.append(msgspec.structs.replace(c, heads_at=0, heads=heads))
        return [*cut, c]

    variants = [list(v) for v in _product([options(c) for c in call])]
    return variants[: MAX_CALLS - 1] + variants[-1:] if len(variants) > MAX_CALLS else variants


def _product(options: list[list[CallInput]]) -> list[tuple[CallInput, ...]]:
    """Every choice of one option per item, in order: the last, each item's last option."""
    return list(itertools.product(*options))


def _attribute_sets(candidates: list[LocalAttribute], plausible: dict[int, int]) -> list[list[LocalAttribute]]:
    """The sets of ``candidates`` to localise, in the order :func:`discover` proves them: those whose
    value is ``plausible``, then each set differing from it in one candidate, then in two, at most
    :data:`MAX_ATTRIBUTE_SETS`.

    >>> a, b, c = (LocalAttribute(layer="attn", name=n, whole=w, local=w // 2) for n, w in [("h", 4), ("g", 2), ("d", 8)])
    >>> [[x.name for x in s] for s in _attribute_sets([a, b, c], {4: 2, 2: 1})][:5]
    [['h', 'g'], ['g'], ['h'], ['h', 'g', 'd'], []]
    """
    start = frozenset(i for i, a in enumerate(candidates) if a.whole in plausible)
    flips = [()] + [(i,) for i in range(len(candidates))] + list(itertools.combinations(range(len(candidates)), 2))
    sets = [start.symmetric_difference(flip) for flip in flips][:MAX_ATTRIBUTE_SETS]
    return [[candidates[i] for i in sorted(chosen)] for chosen in sets]


def proof_sizes(layer: paddle.nn.Layer, view: LocalView, params: dict, mp: int) -> tuple[int, int]:
    """The batch and sequence a proof runs at: the two smallest primes from 3 that no size of the
    sub-layer (a dim of its weights, an integer attribute of :func:`_owners`, either at 1/mp)
    equals, so no reshape or broadcast can take one for another. Read from the model alone, never
    from the input spec: the proof, hence the plan, is the same whatever shapes the model was
    traced at.

    >>> layer = paddle.nn.Layer(); layer.num_heads = 3
    >>> view = LocalView(layer="attn", weights=[LocalWeight(param="attn.qkv.weight", dim=1)])
    >>> proof_sizes(layer, view, {"attn.qkv.weight": ([10, 14], "float32")}, mp=2)  # not 3, 5, 7
    (11, 13)
    """
    sizes = _sizes(layer, view, params, mp)
    primes = (n for n in itertools.count(3) if all(n % k for k in range(2, n)) and n not in sizes)
    return next(primes), next(primes)


def _sizes(layer: paddle.nn.Layer, view: LocalView, params: dict, mp: int) -> set[int]:
    """Every size of the sub-layer (a dim of its weights and buffers, an integer attribute of
    :func:`_owners`), whole and at 1/mp: what a proof's batch and sequence must not equal."""
    sizes = {d for w in view.weights for d in params[w.param][0]} | {d for b in view.buffers for d in b.shape}
    sizes |= {a.whole for a in _integer_attributes(layer, view.layer, 1)}
    return sizes | {s // mp for s in sizes}


def reverify(plan: Plan, model: paddle.nn.Layer) -> list[str]:
    """``autodist-plan check``: each of the plan's local views proven again on ``model`` as it is
    now; one reason per view that no longer holds."""
    layers = dict(model.named_sublayers())
    params = {fqn: (p.shape, p.dtype) for fqn, p in plan.params.items()}
    reasons = []
    for view in plan.local_view:
        layer = layers.get(view.layer)
        if layer is None or not any(w.dim is not None and w.param in params for w in view.weights):
            reasons.append(f"local view {view.layer}: no such layer with a split weight in the model")
            continue
        try:
            _Proof.made(
                layer, view, params, plan.strategy.mp, proof_sizes(layer, view, params, plan.strategy.mp)
            ).check(view.attributes, view.input_width)
        except NotProven as exc:
            reasons.append(f"local view {view.layer} no longer holds: {exc}")
    return reasons


def verify(layer: paddle.nn.Layer, view: LocalView, params: dict, mp: int, input_shape: list[int]) -> str:
    """Run ``layer`` with random weights whole and as each of the ``mp`` ranks of ``view`` (its
    attributes localised), the hidden input at ``input_shape``'s batch and sequence; raise
    :class:`NotProven` naming the first difference. Returns how it was proven. The layer is left
    as it was (parameters, size attributes, train/eval modes)."""
    return _Proof.made(layer, view, params, mp, (input_shape[0], input_shape[1])).check(
        view.attributes, view.input_width
    )


class _Proof:
    """One sub-layer's proof at one batch and sequence: its global run, made once (recording the
    integer attributes its forward reads, :attr:`read`), against which :meth:`check` proves the
    ranks' local runs for a set of attributes.

    It is called as ``view.call`` records (:func:`_arguments`): the hidden input random, the other
    inputs at the proof's batch and sequence. Their values need not be the model's: what is proven
    is that the ranks' summed local runs equal the global run for the inputs given, and every
    input but the hidden one is replicated over mp (not split by heads) and carries no gradient,
    so each rank reads the same value the global run reads, whatever it is. They are chosen to
    run the forward as training does, without telling what an input is for from its shape: a
    float tensor (an additive mask, a rotary table) random, never ``-inf``; a bool one (a
    selector) causal over the two dims that follow the sequence, so no row is masked whole;
    integer ones (position ids) ``arange`` of the sequence (in range of any table they index).
    Outputs beside the hidden state in ``view.dropped_outputs`` are not compared: the local view
    returns None for them."""

    def __init__(self, layer, view: LocalView, params: dict, mp: int, shape: list[int], reading: dict):
        self.layer, self.view, self.mp, self.shape, self.reading = layer, view, mp, shape, reading
        self.rng = np.random.default_rng(0)
        self.whole = {w.param: _random_weight(self.rng, params[w.param][0]) for w in view.weights}
        self.whole |= {b.name: _random_weight(self.rng, b.shape) for b in view.buffers}
        self.x = self.rng.normal(0.0, 1.0, shape).astype("float32")
        self.arguments = _arguments(view.call, shape, reading, self.rng)
        self.cotangent = None  # the global run's random output gradient, given to every local run
        global_call = LocalCall(layer, msgspec.structs.replace(view, attributes=[], input_width="whole"))  # all whole
        with _Reads(_owners(layer, view.layer)) as self.read:
            self.out, self.grads, self.x_grad, self.given_grads, self.cotangent = self._run(global_call, self.whole)

    @classmethod
    def made(cls, layer, view: LocalView, params: dict, mp: int, batch_seq: tuple[int, int]) -> _Proof:
        """The proof whose global run runs: at ``batch_seq`` (the traced batch and sequence scaled
        to it by the first of :func:`_readings` that runs), else at the traced sequence (a forward
        whose sequence is written into it: BEiT's relative-position bias of its 65 tokens) and its
        batch, then each divisor of the traced batch no size of the sub-layer equals (one whose
        batch must be a multiple of a count written into it: Swin's shifted windows, their mask
        one per window of a sample), else at the traced batch and sequence, each within
        :data:`MAX_TRACED_PROOF_SCORES`. :class:`NotProven` when none runs."""
        listed = {w.param for w in view.weights}
        others = sorted(fqn for fqn, _, _ in LocalCall(layer, view).slots if fqn not in listed)
        if others:
            raise NotProven(f"its parameters {others} are not projections' weights")
        elements = sum(math.prod(params[fqn][0]) for fqn in listed)
        if elements > MAX_PROOF_ELEMENTS:
            raise NotProven(
                f"its weights ({elements} elements) are too large to prove on the planning machine "
                f"(at most {MAX_PROOF_ELEMENTS}, planner/local_view_proof.py MAX_PROOF_ELEMENTS)"
            )
        hidden = next((c.shape for c in view.call if c.role == "hidden"), None)
        width = _width(view, params) if hidden is None else hidden[-1]
        tries: list[tuple[tuple[int, int], dict]] = [(batch_seq, r) for r in _readings(view.call, batch_seq)]
        traced = (hidden[0], hidden[1]) if hidden is not None and len(hidden) == 3 else (batch_seq[0], batch_seq[1])
        sizes = _sizes(layer, view, params, mp)
        divisors = [d for d in range(2, traced[0]) if traced[0] % d == 0 and d not in sizes]
        at_traced_seq = [((batch, traced[1]), True) for batch in [batch_seq[0], *divisors]]
        for fixed, scaled in [*at_traced_seq, (traced, False)]:
            reading = _readings(view.call, fixed)[0] if scaled else {}
            if fixed not in [t for t, _ in tries] and fixed[0] * fixed[1] ** 2 <= MAX_TRACED_PROOF_SCORES:
                tries.append((fixed, reading))
        first: NotProven | None = None
        for (batch, seq), reading in tries:
            try:
                return cls(layer, view, params, mp, [batch, seq, width], reading)
            except NotProven as exc:
                first = first or exc
        assert first is not None
        raise first

    def check(self, attributes: list[LocalAttribute], input_width: str = "whole") -> str:
        view = msgspec.structs.replace(self.view, attributes=attributes, input_width=input_width)
        outs, local_grads, x_grads, given_grads = [], [], [], []
        for rank in range(self.mp):
            local = {w.param: _local(self.whole[w.param], w, rank, self.mp) for w in view.weights}
            local |= {
                b.name: np.take(self.whole[b.name], buffer_positions(b, self.mp, rank), axis=b.dim)
                for b in view.buffers
            }
            o, g, xg, gg, _ = self._run(LocalCall(self.layer, view, self.mp), local, rank)
            outs.append(o)
            local_grads.append(g)
            x_grads.append(xg)
            given_grads.append(gg)
        # a joined view's ranks each return their heads, side by side in rank order; the others' partial sums add up
        _compare("output", np.concatenate(outs, axis=-1) if view.output == "joined" else sum(outs), self.out)
        _compare("input gradient", sum(x_grads), self.x_grad)
        for i, (mode, want) in enumerate(self.given_grads):  # a share's is whole on each rank, else summed
            what = f"gradient of its gradient-carrying input {i}"
            for got in [gg[i][1] for gg in given_grads] if mode == "share" else [sum(gg[i][1] for gg in given_grads)]:
                _compare(what, got, want)
        for weight in view.weights:
            _compare(
                f"gradient of {weight.param}",
                _reassembled(weight, [g[weight.param] for g in local_grads], self.mp, self.grads[weight.param].shape),
                self.grads[weight.param],
            )
        called = f", called with {_described_call(view.call, self.reading)}" if len(view.call) > 1 else ""
        how = "joined along the last dim" if view.output == "joined" else "summed"
        return (
            f"{self.mp} local runs (random weights, input {self.shape}{called}) {how} and reassembled equal the "
            f"global run, forward and backward, within rtol {RTOL} and atol {ATOL}"
        )

    def _run(self, call: LocalCall, values: dict, rank: int | None = None):
        """One forward and backward (:func:`_run`) through ``call`` in eval mode (no dropout: the
        runs must see the same values), as ``rank`` (None: the global run); every sub-layer's
        attributes restored after, so each run starts as the layer was: a table a forward caches
        on its first call (HF Falcon's rotary cos/sin) is made again by each rank's run, from the
        rank's own values, as each rank's first step makes it (reused from the global run, it hid
        a rotary ``inv_freq`` cut by heads, which then trained wrong)."""
        cotangent = self.cotangent
        if cotangent is not None and rank is not None and self.view.output == "joined":
            cotangent = np.split(cotangent, self.mp, axis=-1)[rank]  # the rank's heads of the output gradient
        try:
            with in_mode(self.layer, training=False):  # the attributes as they were, after (trace.py)
                return _run(
                    call, values, self.x, self.arguments, self.view.dropped_outputs, cotangent, self.rng, rank, self.mp
                )
        except NotProven:
            raise
        except Exception as exc:
            raise NotProven(f"running it failed: {type(exc).__name__}: {_first_line(exc)}") from None


def _random_weight(rng, shape) -> np.ndarray:
    """A proof's random value of a weight of ``shape``: a matrix at std 1/sqrt(its smaller dim), a
    projection's fan-in or less, so activations stay of order one at any width (at a fixed std a
    1024-wide attention's scores are in the hundreds: the softmax saturates, hiding a wrong scale,
    and the float32 rounding of the summed partial outputs exceeds :data:`ATOL`); a vector at 0.2.

    >>> float(np.round(_random_weight(np.random.default_rng(0), [4096, 1024]).std() * 32, 1))
    1.0
    """
    std = 1 / math.sqrt(min(shape)) if len(shape) >= 2 else 0.2
    return rng.normal(0.0, std, shape).astype("float32")


def _width(view: LocalView, params: dict) -> int:
    """The hidden input's width for a view recorded without its call: its first split column's
    input width (the dim of its weight other than the split one)."""
    first = next(w for w in view.weights if w.dim is not None)
    shape = params[first.param][0]
    return shape[1 - (first.dim or 0)] if len(shape) == 2 else shape[-1]


class _Hidden:
    """Where the hidden input goes in :func:`_arguments`' call (each run makes its own)."""


@dataclass(frozen=True)
class _Given:
    """A per-head or gradient-carrying input of :func:`_arguments`' call, as the global run takes
    it; :func:`_run` gives each rank its value as the applier does (``CallInput.heads_at``,
    ``gradient``)."""

    input: CallInput
    value: np.ndarray


def _readings(call: list[CallInput], batch_seq: tuple[int, int]) -> list[dict[int, list[int | None]]]:
    """Which dims of the call's other tensors follow the hidden input's traced batch and sequence
    (``{id of its CallInput: [the proof's size per dim, None where it keeps its own]}``), in the
    order :meth:`_Proof.made` tries them: a dim equal to the traced sequence may be one that only
    equals it (a rotary table's head dim at a sequence as long), so every choice of such dims is a
    reading, most dims following first; dim 0 of a ``batch`` tensor follows the batch.
    At most :data:`MAX_READINGS`."""
    hidden = next((c.shape for c in call if c.role == "hidden"), None)
    if hidden is None or len(hidden) < 2:
        return [{}]
    seq = hidden[1]
    tensors = [c for c in _flat(call) if c.role in ("mask", "positions", "tensor")]
    choices = []
    for c in tensors:
        at = [i for i, d in enumerate(c.shape) if d == seq and not (i == 0 and c.batch) and i != c.heads_at]
        subsets = [s for k in range(len(at), -1, -1) for s in itertools.combinations(at, k)]
        choices.append([(c, frozenset(s)) for s in subsets])

    def size(c: CallInput, i: int, following: frozenset) -> int | None:
        batch = batch_seq[0] * (c.heads if i == c.heads_at else 1)  # a per-head dim 0: batch x heads
        return batch if i == 0 and c.batch else batch_seq[1] if i in following else None

    return [
        {id(c): [size(c, i, following) for i in range(len(c.shape))] for c, following in combination}
        for combination in itertools.islice(itertools.product(*choices), MAX_READINGS)
    ]


def _flat(call: list[CallInput]) -> list[CallInput]:
    return [x for c in call for x in ([c] if c.role not in ("tuple", "list") else _flat(c.items))]


def _arguments(call: list[CallInput], shape: list[int], reading: dict, rng) -> tuple[tuple, dict]:
    """The proof's ``(args, kwargs)`` for ``call`` (:class:`_Proof` says why these values): numpy
    arrays for tensors, at the proof's batch and sequence where ``reading`` says (traced shapes
    elsewhere); the hidden input as :class:`_Hidden`. An empty call: the hidden input alone."""
    if not call:
        return (_Hidden,), {}

    def value(c: CallInput):
        if c.role == "hidden":
            return _Hidden
        if c.role == "literal":
            return c.value
        if c.role in ("tuple", "list"):
            items = [value(item) for item in c.items]
            return tuple(items) if c.role == "tuple" else items
        sizes = reading.get(id(c), [None] * len(c.shape))
        dims = [size or d for size, d in zip(sizes, c.shape)]
        if c.role == "positions":
            return np.ascontiguousarray(np.broadcast_to(np.arange(dims[-1] if dims else 1), dims)).astype(c.dtype)
        if c.role == "mask":
            # causal over the last two dims that follow the sequence wherever they lie ([b, 1, q, k],
            # or GPT-BigCode's [1, q, 1, k] with the heads beside the query); all visible without two
            at = [i for i, size in enumerate(sizes) if size is not None and not (i == 0 and c.batch)][-2:]
            visible = np.ones([dims[i] if i in at else 1 for i in range(len(dims))], bool)
            if len(at) == 2:
                visible = np.tril(np.ones((dims[at[0]], dims[at[1]]), bool)).reshape(visible.shape)
            return np.ascontiguousarray(np.broadcast_to(visible, dims))
        if c.dtype.startswith("complex"):
            return (rng.normal(0.0, 1.0, dims) + 1j * rng.normal(0.0, 1.0, dims)).astype(c.dtype)
        random = rng.normal(0.0, 1.0, dims).astype("float32")
        return _Given(c, random) if c.heads_at is not None or c.gradient else random

    args = tuple(value(c) for c in call if not c.keyword)
    return args, {c.keyword: value(c) for c in call if c.keyword}


class _Reads:
    """The integer attributes a run reads of ``owners`` (:func:`_owners`), as ``(layer path,
    attribute name)``: inside the ``with`` block each owner's class is a subclass of its own whose
    ``__getattribute__`` notes them (an object whose class cannot be swapped counts as reading
    all of its integer attributes)."""

    def __init__(self, owners: list[tuple[str, str, object]]):
        self.owners = owners
        self.read: set[tuple[str, str]] = set()
        self.swapped: list[tuple[object, type]] = []

    def __enter__(self) -> set[tuple[str, str]]:
        for where, prefix, owner in self.owners:
            own = type(owner)
            try:
                owner.__class__ = _recording(own)
            except TypeError:
                self.read |= {(where, prefix + n) for n in dir(owner) if type(getattr(owner, n, None)) is int}
                continue
            self.swapped.append((owner, own))
            _NOTED[id(owner)] = (where, prefix, self.read)
        return self.read

    def __exit__(self, *exc) -> None:
        for owner, own in self.swapped:
            owner.__class__ = own
            _NOTED.pop(id(owner), None)


#: While :class:`_Reads` records: an owner's id -> (its layer path, attribute prefix, the reads).
_NOTED: dict[int, tuple[str, str, set]] = {}


def _recording(own: type) -> type:
    """A subclass of ``own`` that notes each integer attribute read (:class:`_Reads`), made once."""
    if own in _RECORDING:
        return _RECORDING[own]

    def __getattribute__(self, name):
        value = own.__getattribute__(self, name)
        noted = _NOTED.get(id(self))
        if noted is not None and type(value) is int:
            noted[2].add((noted[0], noted[1] + name))
        return value

    made = type(own.__name__, (own,), {"__getattribute__": __getattribute__, "__module__": own.__module__})
    return _RECORDING.setdefault(own, made)


_RECORDING: dict[type, type] = {}


def _described_call(call: list[CallInput], reading: dict) -> str:
    """``hidden, attention_mask=tensor [3, 1, 5, 5], position_ids=positions [1, 5]`` (the shapes
    the proof gave them: :func:`_readings`)."""

    def one(c: CallInput) -> str:
        if c.role in ("tuple", "list"):
            return "(" + ", ".join(one(item) for item in c.items) + ")"
        if c.role in ("hidden", "literal"):
            return c.role if c.role == "hidden" else repr(c.value)
        sizes = reading.get(id(c), [None] * len(c.shape))
        heads = f" cut to each rank's heads along dim {c.heads_at}" if c.heads_at is not None else ""
        gradient = {"share": " carrying a gradient, 1/mp of it on each rank", "whole": " carrying a gradient"}
        return f"{c.role} {[size or d for size, d in zip(sizes, c.shape)]}{heads}{gradient.get(c.gradient, '')}"

    return ", ".join(f"{c.keyword}={one(c)}" if c.keyword else one(c) for c in call)


def _run(
    call: LocalCall,
    values: dict,
    x: np.ndarray,
    arguments: tuple[tuple, dict],
    dropped,
    cotangent,
    rng,
    rank: int | None = None,
    mp: int = 1,
):
    """One forward and backward of a sub-layer through the applier's own ``call`` with ``values``
    as its parameters (plain leaf tensors), called with ``arguments`` (:func:`_arguments`) and
    ``x`` as the hidden input: the global run, or as ``rank`` of ``mp`` takes its per-head and
    gradient-carrying inputs (:class:`_Given`: its heads' entries; a 1/mp ``share``). Returns the
    output, the parameters' gradients, the hidden input's, the gradient-carrying inputs' (in call
    order, each with its ``CallInput.gradient``) and the output gradient given."""
    leaves = {fqn: paddle.to_tensor(values[fqn], stop_gradient=False) for fqn, _, _ in call.slots}
    held = {fqn: paddle.to_tensor(values[fqn]) for fqn, _, _ in call.buffers}  # cut buffers: no gradient
    inp = paddle.to_tensor(x, stop_gradient=False)
    carried: list[tuple[str, paddle.Tensor]] = []

    def given(c: CallInput, value: np.ndarray) -> paddle.Tensor:
        if c.heads_at is not None and rank is not None:
            value = np.take(value, head_positions(value.shape[c.heads_at], c.heads, mp, rank), axis=c.heads_at)
        if not c.gradient:
            return paddle.to_tensor(value)
        carried.append((c.gradient, paddle.to_tensor(value, stop_gradient=False)))
        return share_of(carried[-1][1], mp) if c.gradient == "share" and rank is not None else carried[-1][1]

    def tensors(value):
        if value is _Hidden:
            return inp
        if isinstance(value, _Given):
            return given(value.input, value.value)
        if isinstance(value, np.ndarray):
            return paddle.to_tensor(value)
        if isinstance(value, (tuple, list)):
            return type(value)(tensors(item) for item in value)
        return value

    args, kwargs = arguments
    found = hidden_output(call(leaves | held, *tensors(args), **{k: tensors(v) for k, v in kwargs.items()}), dropped)
    if found is None or not isinstance(found[0], paddle.Tensor):
        raise NotProven("its forward returns more than one tensor (a cache or attention weights)")
    out = found[0]
    if cotangent is None:
        cotangent = rng.normal(0.0, 1.0, out.shape).astype("float32")
    (out * paddle.to_tensor(cotangent)).sum().backward()
    grads = {fqn: _numpy(leaf.grad, leaf.shape) for fqn, leaf in leaves.items()}
    given_grads = [(mode, _numpy(leaf.grad, leaf.shape)) for mode, leaf in carried]
    return out.numpy(), grads, _numpy(inp.grad, inp.shape), given_grads, cotangent


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
    scale = float(np.abs(want[np.isfinite(want)]).max(initial=0.0))
    if not np.allclose(got, want, rtol=0.0, atol=ATOL + RTOL * scale):
        raise NotProven(
            f"the local runs' {what} differs from the global run's by up to {float(np.abs(got - want).max()):.3g}"
        )


def _first_line(exc: Exception) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:200] if text else ""
