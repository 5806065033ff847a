"""Local-view tensor parallelism (``plan.local_view``): a sub-layer run on plain local tensors.

Inside a sub-layer the plan lists (a GPT-2 ``attn`` with a fused ``c_attn``, a Phi-3 ``mlp`` with
a fused ``gate_up_proj``), each rank runs the model's own forward, unchanged, at 1/mp width —
Megatron-LM's tensor parallelism:

- its input: the rank's local value of the activation (replicated over mp, split over dp by the
  batch), through an identity whose backward sums the mp ranks' input gradients (Megatron's ``f``);
- its parameters: each rank's local shard, for the duration of the call (a fused weight's shard
  is the rank's slice of each segment, ``q_r|k_r|v_r`` or ``gate_r|up_r``:
  :meth:`LocalViews.to_local_layout` laid the distributed parameter out that way when it was
  sharded); a row bias (``summed``) enters as
  1/mp of itself, its gradient the whole one (:func:`share_of`); a gradient comes back Partial over dp, summed by
  the optimizer as any data-parallel gradient (docs/paddle-notes.md, "Local-view tensor parallelism");
  a parameter read by the forward itself (timm BEiT's ``F.linear(x, weight=self.qkv.weight)``)
  is the rank's shard too: the call swaps the parameter, however the forward reads it;
- the buffers the plan cuts (``LocalView.buffers``: BEiT's zero ``k_bias``): the rank's slice of
  each, for the duration of the call (the buffer itself stays whole);
- the size attributes it reads (``self.num_heads``, ``self.split_size``, ``c_attn.nf``, an MLP's
  ``self.intermediate_size``) set to their local values, restored when the call returns or raises;
- its output: each rank's partial sum, summed over the rank's mp line (one all-reduce, Megatron's
  ``g``; its backward hands every rank the whole gradient) and handed back as a DistTensor placed
  as the input was; under sequence parallelism, where the plan's post hook splits it over the
  sequence again, left Partial over mp for that hook (:func:`summed`): Megatron's reduce-scatter.
  A view whose row projection is a layer beside it (``output`` ``joined``: BERT's
  ``attention.self`` with ``attention.output.dense`` outside) hands back its heads instead, split
  over mp along the last dim (:func:`joined`), for that row projection's ``S(0)`` weight.

Checkpoints hold the model's own layout: :meth:`LocalViews.own_boxes` says which boxes of it a
rank's piece of a fused weight holds (applier/checkpoint/save_load.py saves and reads those).

The scores, softmax and context therefore run on each rank's heads only, a gated activation on
each rank's intermediate features only. The forward is replaced on the instance (as experts.py
does), so ``layer.forward(x)`` runs local too.

Example::

    >>> views = LocalViews(plan)                               # doctest: +SKIP
    >>> views.wrap(model)                                      # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Mapping
from typing import Any

import numpy as np
import paddle
import paddle.distributed as dist
from paddle.autograd import PyLayer
from paddle.distributed.auto_parallel.api import dtensor_from_local, dtensor_to_local
from paddle.distributed.auto_parallel.auto_dp_utils import in_auto_dp_mode

from autodist.schemas import CallInput, LocalBuffer, LocalView, LocalWeight, Plan
from autodist.schemas.describe import strategy_text
from autodist.schemas.local_view import (
    attribute_owner,
    buffer_positions,
    head_positions,
    hidden_output,
    local_order,
    mp_placement,
    own_order,
    rank_positions,
    reordered,
)
from autodist.schemas.parallel_dims import local_views_refused

from autodist.applier.placement.clip import sum_over
from autodist.applier.placement.hooks import first_input, map_first_input, sequence_split_sides
from autodist.applier.placement.mesh import mesh_ids
from autodist.applier.modes.recompute import recomputed_inside_views, recomputing


#: Why a ``joined`` view does not run under sequence parallelism (the planner's note, the applier's refusal).
JOINED_UNDER_SEQUENCE_PARALLEL = (
    "its row projection is a layer beside it, and no sequence-parallel hooks around such a pair are built"
)


class LocalViews:
    """The plan's local-view sub-layers, by layer, and their weights by parameter name."""

    def __init__(self, plan: Plan | None):
        self.plan = plan
        self.mp = plan.strategy.mp if plan is not None else 1
        self.weights: dict[str, LocalWeight] = (
            {w.param: w for view in plan.local_view for w in view.weights} if plan is not None else {}
        )

    def to_local_layout(self, fqn: str, value: paddle.Tensor) -> paddle.Tensor:
        """``value`` (a parameter in the model's own layout) with a fused weight's segments
        reordered rank by rank (schemas.local_view), ready for an ordinary ``S(dim)`` shard."""
        weight = self.weights.get(fqn)
        if weight is None or weight.dim is None or not reordered(weight):
            return value
        order = local_order(weight, value.shape[weight.dim], self.mp)
        return paddle.index_select(value, paddle.to_tensor(order, dtype="int64"), axis=weight.dim)

    def own_layout(self, fqn: str, whole: np.ndarray) -> np.ndarray:
        """The inverse of :meth:`to_local_layout` on a whole value (what a reader of the
        parameters, or a checkpoint, wants: the model's own layout)."""
        weight = self.weights.get(fqn)
        if weight is None or weight.dim is None or not reordered(weight):
            return whole
        return np.take(whole, own_order(weight, whole.shape[weight.dim], self.mp), axis=weight.dim)

    def own_boxes(
        self, fqn: str, offset: list[int], shape: list[int], whole: list[int]
    ) -> list[tuple[list[int], list[int], int]]:
        """A box of the distributed (rank-by-rank) layout of a tensor of shape ``whole``, as boxes
        of the model's own layout: ``(offset, shape, start)`` with ``start`` where each begins
        along the split dim inside the given box (a checkpoint saves and reads those).

        >>> from autodist.schemas import LocalView, LocalWeight          # doctest: +SKIP
        >>> views.own_boxes("attn.c_attn.weight", [0, 6], [4, 6], [4, 12])  # rank 1 of mp2, q|k|v  # doctest: +SKIP
        [([0, 2], [4, 2], 0), ([0, 6], [4, 2], 2), ([0, 10], [4, 2], 4)]
        """
        weight = self.weights.get(fqn)
        planned = self.plan.params[fqn].shape if self.plan is not None and fqn in self.plan.params else None
        # not a reordered weight, or a state of another shape (an optimizer's beta powers)
        if weight is None or weight.dim is None or not reordered(weight) or list(whole) != planned:
            return [(list(offset), list(shape), 0)]
        dim = weight.dim
        order = local_order(weight, whole[dim], self.mp)[offset[dim] : offset[dim] + shape[dim]]
        boxes = []
        start = 0
        for i in range(1, len(order) + 1):  # runs of consecutive positions of the model's layout
            if i == len(order) or order[i] != order[i - 1] + 1:
                box_offset, box_shape = list(offset), list(shape)
                box_offset[dim], box_shape[dim] = order[start], i - start
                boxes.append((box_offset, box_shape, start))
                start = i
        return boxes

    def wrap(self, model: paddle.nn.Layer) -> None:
        """Replace the forward of every local-view sub-layer of ``model`` on the instance."""
        if self.plan is None or not self.plan.local_view:
            return
        layers = dict(model.named_sublayers())
        line = mp_line(self.plan, dist.get_rank())
        recomputed = recomputed_inside_views(self.plan)
        for view in self.plan.local_view:
            _wrap(layers[view.layer], view, line, sequence_split_sides(self.plan, view.layer), view.layer in recomputed)


def mp_line(plan: Plan, rank: int) -> dist.ProcessMesh:
    """The ranks along the mp axis through ``rank``: those whose partial outputs add up.

    >>> from autodist.schemas import load_plan                       # doctest: +SKIP
    >>> mp_line(plan_dp2_mp2, rank=2).process_ids                    # doctest: +SKIP
    [2, 3]
    """
    ids = mesh_ids(plan)
    where = tuple(int(i) for i in np.argwhere(ids == rank)[0])
    axis = plan.mesh.axes.index("mp")
    line = [int(ids[where[:axis] + (k,) + where[axis + 1 :]]) for k in range(ids.shape[axis])]
    return dist.ProcessMesh(line, dim_names=["mp"])


def param_local(param: paddle.Tensor, rows: list) -> paddle.Tensor:
    """A parameter's local value for a call whose input is placed ``rows`` (the hidden input's
    placements). Its gradient comes back Partial on every axis but mp the parameter is replicated
    on and the input split (dp: each rank's gradient covers its own rows of the batch; the
    optimizer sums it, as for any data-parallel gradient, and ZeRO's gradient hook reshards that
    one Partial axis to the rank's dp shard), whole where the input is (:func:`summed_over_ranks`).
    A parameter ZeRO stage 3 split over dp is gathered over dp for the call first
    (:class:`_GatheredOverDp`).

    Under Paddle's auto-dp mode (``dist.enable_auto_dp()``, which PaddleFormers' ``Trainer.train``
    turns on) it comes back Replicate there instead, as every other gradient does in that mode:
    each dp rank's activations are a Replicate holding that rank's own batch, and the optimizer
    relabels each gradient that is not Partial on the mesh's first axis as Partial there
    (``auto_dp_utils._convert_fake_replicate_grad_to_partial``), summing it over dp once. A
    Partial gradient added to such a one (an LM head tied to a table looked up on local tensors)
    trained off the plain Trainer (Llama at dp2 x mp2: 1.7e-3 by step 3, docs/paddle-notes.md)."""
    mesh = param.process_mesh
    whole_but_mp = [p if name == "mp" else dist.Replicate() for name, p in zip(mesh.dim_names, param.placements)]
    if whole_but_mp != list(param.placements):
        param = _GatheredOverDp.apply(param, whole_but_mp)
    return dtensor_to_local(param, mesh, summed_over_ranks(mesh, param.placements, rows))


def summed_over_ranks(mesh: dist.ProcessMesh, placements: list, rows: list) -> list:
    """The placements of the gradient of a local value taken from a DistTensor placed
    ``placements``, read by a call whose input is placed ``rows``: on an axis but mp the value is
    replicated on, Partial where the input is split (each rank's gradient covers only its own rows:
    the ranks' gradients add up; the mp ranks' are summed in the view's backward already,
    :class:`_CopyToRanks`), Replicate where the input is whole (every rank computed from the whole
    batch, so its gradient is the whole one: HF Wav2Vec2's encoder attention, whose input comes
    whole over dp out of an op Paddle runs replicated, trained off one device at dp2 x mp2 with it
    summed) and under Paddle's auto-dp mode (:func:`param_local`).

    >>> mesh = dist.ProcessMesh([[0, 1], [2, 3]], dim_names=["dp", "mp"])
    >>> whole = [dist.Replicate(), dist.Replicate()]
    >>> summed_over_ranks(mesh, whole, [dist.Shard(0), dist.Replicate()])[0], summed_over_ranks(mesh, whole, whole)[0]
    (Partial(reduce_type=SUM), Replicate())
    """
    split = [isinstance(r, dist.Shard) and not in_auto_dp_mode() for r in rows]
    return [
        p if name == "mp" or not isinstance(p, dist.Replicate) else dist.Partial() if cut else dist.Replicate()
        for name, p, cut in zip(mesh.dim_names, placements, split)
    ]


def _call_value(
    param: paddle.Tensor, weight: LocalWeight | None, line: dist.ProcessMesh, rank: int, rows: list
) -> paddle.Tensor:
    """Mp rank ``rank``'s value of a parameter for the call (``line``: the ranks along mp; ``rows``:
    the placements of the call's input, :func:`param_local`): its
    local shard (a reordered fused weight's is already ``q_r|k_r|v_r``); 1/mp of a summed bias; of
    a weight held whole with segments computed whole (``replicated``: a multi-query ``q|k|v``),
    its columns ``q_r|k|v`` (:func:`~autodist.schemas.local_view.rank_positions`). The last one's
    gradient is each rank's share, landing on the columns it took (its slice of q, its heads' part
    of K's and V's): summed over the mp line in the backward (:class:`_CopyToRanks`, the proof's
    reassembly, planner/local_view_proof.py ``_reassembled``), it re-enters whole over mp, Partial over
    dp only, like any data-parallel gradient (Paddle's ZeRO hook reshards one Partial axis; with
    two it shards the gradient over mp and the update splits the weight)."""
    mp = len(line.process_ids)
    if weight is not None and weight.replicated and weight.dim is not None:
        local = _CopyToRanks.apply(param_local(param, rows), line)
        positions = rank_positions(weight, local.shape[weight.dim], mp, rank)
        return paddle.index_select(local, paddle.to_tensor(positions, dtype="int64"), axis=weight.dim)
    local = param_local(param, rows)
    return share_of(local, mp) if weight is not None and weight.summed else local


def _buffer_value(value: paddle.Tensor, buffer: LocalBuffer, mp: int, rank: int) -> paddle.Tensor:
    """Mp rank ``rank``'s slice of a cut buffer for the call (:func:`~autodist.schemas.local_view.buffer_positions`);
    the buffer is whole on every rank."""
    positions = paddle.to_tensor(buffer_positions(buffer, mp, rank), dtype="int64")
    return paddle.index_select(local_value(value), positions, axis=buffer.dim)


class LocalCall:
    """A sub-layer's own forward run as one rank runs it: each of its parameters and of ``view``'s
    buffers replaced by the value given for it, each of ``view``'s size attributes set to its local
    value, all restored when the call returns or raises. The one place that does so: a local view's
    every call runs through it (:func:`_wrap`), and so do the planner's proofs
    (planner/local_view_proof.py), so a proof that holds has run this code.

    ``forward`` is the layer's own, read when made (before :func:`_wrap` replaces it on the
    instance); ``slots`` lists ``(fqn, sub-layer, key)`` of every parameter, ``buffers`` of each of
    ``view.buffers``, the names as the plan's (``view.layer`` + the path in it).

    >>> from autodist.schemas import LocalAttribute
    >>> layer = paddle.nn.Linear(4, 6); layer.heads = 2
    >>> view = LocalView(layer="proj", weights=[], attributes=[LocalAttribute(layer="proj", name="heads", whole=2, local=1)])
    >>> call = LocalCall(layer, view)
    >>> [fqn for fqn, _, _ in call.slots]
    ['proj.weight', 'proj.bias']
    >>> half = {"proj.weight": paddle.ones([4, 3]), "proj.bias": paddle.zeros([3])}
    >>> list(call(half, paddle.ones([1, 4])).shape), list(layer.weight.shape), layer.heads
    ([1, 3], [4, 6], 2)
    """

    def __init__(self, layer: paddle.nn.Layer, view: LocalView, mp: int = 1):
        self.forward = layer.forward
        self.local_width = view.input_width == "local" and mp > 1
        self.mp = mp

        def fqn(name: str, key: str) -> str:
            return f"{view.layer}.{name}.{key}" if name else f"{view.layer}.{key}"

        subs = list(layer.named_sublayers(include_self=True))
        self.slots = [
            (fqn(name, key), sub, key)
            for name, sub in subs
            for key, param in sub._parameters.items()
            if param is not None
        ]
        cut = {b.name for b in view.buffers}
        self.buffers = [
            (fqn(name, key), sub, key) for name, sub in subs for key in sub._buffers if fqn(name, key) in cut
        ]
        layers = {
            (f"{view.layer}.{name}" if name else view.layer): sub
            for name, sub in layer.named_sublayers(include_self=True)
        }
        self.attributes = [(*attribute_owner(layers[a.layer], a.name), a.local) for a in view.attributes]

    def __call__(self, values: Mapping[str, paddle.Tensor], *args: Any, **kwargs: Any) -> Any:
        """The forward called with ``args`` and ``kwargs``, each parameter and cut buffer ``values[fqn]``."""
        params = [(sub, key, sub._parameters[key]) for _, sub, key in self.slots]
        buffers = [(sub, key, sub._buffers[key]) for _, sub, key in self.buffers]
        saved = [(owner, name, getattr(owner, name)) for owner, name, _ in self.attributes]
        try:
            for fqn, sub, key in self.slots:
                sub._parameters[key] = values[fqn]
            for fqn, sub, key in self.buffers:
                sub._buffers[key] = values[fqn]
            for owner, name, value in self.attributes:
                setattr(owner, name, value)
            if not self.local_width:
                return self.forward(*args, **kwargs)
            with local_width(first_input(args, kwargs), self.mp):
                return self.forward(*args, **kwargs)
        finally:
            for sub, key, param in params:
                sub._parameters[key] = param
            for sub, key, buffer in buffers:
                sub._buffers[key] = buffer
            for owner, name, value in saved:
                setattr(owner, name, value)


@contextlib.contextmanager
def local_width(x: paddle.Tensor, mp: int):
    """Within it, ``x.shape`` reads ``x``'s last dim as 1/mp of it: the width a rank of a local view
    computes with, for a forward that sizes its output with its input's width
    (``bsz, tgt_len, embed_dim = hidden_states.shape`` ... ``reshape([bsz, tgt_len, embed_dim])``,
    ``LocalView.input_width``). Only that one tensor's ``shape`` reads so; its values, and every
    other tensor's shape, are unchanged.

    >>> x, y = paddle.ones([3, 8]), paddle.ones([3, 8])
    >>> with local_width(x, 2):
    ...     list(x.shape), list(y.shape)
    ([3, 4], [3, 8])
    >>> list(x.shape)
    [3, 8]
    """
    whole = paddle.Tensor.__dict__["shape"]

    def shape(tensor: paddle.Tensor) -> Any:
        size = whole.__get__(tensor)
        return type(size)([*size[:-1], size[-1] // mp]) if tensor is x else size

    paddle.Tensor.shape = property(shape)
    try:
        yield
    finally:
        paddle.Tensor.shape = whole


def _wrap(
    layer: paddle.nn.Layer, view: LocalView, mesh: dist.ProcessMesh, split: tuple[bool, bool], recomputed: bool
) -> None:
    """Replace ``layer.forward`` by its run on local tensors (the module docstring). ``split``: the
    plan's hooks split the sub-layer's input and output over mp (sequence parallelism);
    ``recomputed``: that run keeps only its local inputs and runs again in backward
    (applier/modes/recompute.py), the all-reduces around it once."""
    weights = {w.param: w for w in view.weights}
    buffers = {b.name: b for b in view.buffers}
    rank, mp = mesh.process_ids.index(dist.get_rank()), len(mesh.process_ids)
    call = LocalCall(layer, view, mp)

    @functools.wraps(call.forward)
    def run(*args: Any, **kwargs: Any) -> Any:
        # The first input, whose mesh and placements the output takes. The tensor itself is kept,
        # not its process_mesh: that dies with the tensor (docs/paddle-notes.md), and the input is
        # often a temporary (``self.attn(self.ln_1(h))``) that nothing else holds once replaced.
        placed: list[paddle.Tensor] = []
        local: list[paddle.Tensor] = []

        def first(x: paddle.Tensor) -> paddle.Tensor:
            if not x.is_dist():
                raise RuntimeError(f"local view: {view.layer} got a plain tensor, not a DistTensor, as its input")
            placed.append(x)
            if split[0]:  # gathered by a pre hook, whose backward reduce-scatters the Partial gradient
                local.append(dtensor_to_local(x, x.process_mesh, partial_over_mp(x.process_mesh, x.placements)))
            else:
                local.append(_CopyToRanks.apply(local_value(x), mesh))
            return local[0]

        args, kwargs = map_first_input(args, kwargs, first)
        args, kwargs = _called_as_proven(view, args, kwargs, placed[0], mesh)
        fqns = [fqn for fqn, _, _ in call.slots + call.buffers]

        def on_rank(x: paddle.Tensor, *values: paddle.Tensor) -> Any:
            """The model's own forward on this rank's input ``x`` and parameter ``values``."""
            call_args, call_kwargs = map_first_input(args, kwargs, lambda _: x)
            return call(dict(zip(fqns, values)), *call_args, **call_kwargs)

        rows = list(placed[0].placements)
        values = [_call_value(sub._parameters[key], weights.get(fqn), mesh, rank, rows) for fqn, sub, key in call.slots]
        values += [_buffer_value(sub._buffers[key], buffers[fqn], mp, rank) for fqn, sub, key in call.buffers]
        output = recomputing(on_rank, local[0], *values) if recomputed else on_rank(local[0], *values)
        found = hidden_output(output, view.dropped_outputs)
        if found is None or not isinstance(found[0], paddle.Tensor):
            raise RuntimeError(
                f"local view: {view.layer} returned {type(output).__name__} with more than one tensor; "
                f"the plan proved it returning one (and None for items {view.dropped_outputs})"
            )
        hidden, index = found
        if view.output == "joined":
            whole = joined(hidden, placed[0].process_mesh, placed[0].placements)
        else:
            whole = summed(hidden, placed[0].process_mesh, placed[0].placements, mesh, split[1])
        # the dropped items (per-head, each rank's heads only) are None: a reader fails, never reads a part
        return whole if index is None else type(output)([whole, *(None for _ in output[1:])])

    layer.forward = run


def summed(
    partial: paddle.Tensor, mesh: dist.ProcessMesh, placements: list, line: dist.ProcessMesh, split: bool
) -> paddle.Tensor:
    """The ranks' ``partial`` outputs summed over the mp ``line``, as a DistTensor on ``mesh``:
    placed as ``placements`` (one all-reduce), or, where a post hook splits it over mp again
    (``split``, sequence parallelism), left Partial over mp for that hook's reshard, Megatron's
    reduce-scatter (its backward all-gathers the gradient, the whole one on every rank)."""
    if split:
        return _LeftPartial.apply(partial, mesh, list(placements))
    return dtensor_from_local(SumOverRanks.apply(partial, line), mesh, placements)


def joined(heads: paddle.Tensor, mesh: dist.ProcessMesh, placements: list) -> paddle.Tensor:
    """A rank's output of a ``joined`` view (its heads, a slice of the last dim) as a DistTensor on
    ``mesh``, split over mp along its last dim and placed as ``placements`` otherwise: the row
    projection after it, a layer beside the view with its weight ``S(0)``, computes each rank's
    partial sum and Paddle all-reduces it (Megatron's row-parallel linear). No collective here;
    backward, each rank takes its slice of the output gradient."""
    last = dist.Shard(len(heads.shape) - 1)
    return dtensor_from_local(heads, mesh, [last if name == "mp" else p for name, p in zip(mesh.dim_names, placements)])


def partial_over_mp(mesh: dist.ProcessMesh, placements: list) -> list:
    """``placements`` on ``mesh`` with mp's Partial: a sum of the mp ranks' values."""
    return [dist.Partial() if name == "mp" else p for name, p in zip(mesh.dim_names, placements)]


class _LeftPartial(PyLayer):
    """A rank's partial output as a DistTensor Partial over mp (``placements`` otherwise); its
    backward hands the rank the whole output gradient, placed as ``placements`` (Paddle's own
    backward of ``dtensor_from_local`` would reshard the gradient to the output's Partial, which
    keeps it on one rank of the mp line and zeroes it on the others)."""

    @staticmethod
    def forward(ctx, partial, mesh, placements):
        # a mesh of its own: a tensor's process_mesh lives only as long as the tensor (docs/paddle-notes.md)
        ctx.mesh = dist.ProcessMesh(np.array(mesh.process_ids).reshape(mesh.shape), dim_names=mesh.dim_names)
        ctx.placements = placements
        return dtensor_from_local(partial, mesh, partial_over_mp(mesh, placements))

    @staticmethod
    def backward(ctx, grad):
        return dtensor_to_local(dist.reshard(grad, ctx.mesh, ctx.placements), ctx.mesh, ctx.placements)


def _called_as_proven(
    view: LocalView, args: tuple, kwargs: dict, hidden: paddle.Tensor, mesh: dist.ProcessMesh
) -> tuple[tuple, dict]:
    """The call's other arguments as this rank's values, after checking the call is the one the
    plan proved (``view.call``, by position and keyword; an empty call is the hidden input alone):
    the same literals, tensors where it had tensors. Each tensor is taken whole over mp
    (:func:`_replicated_local`), then a per-head one cut to the rank's heads, and one that carries
    a gradient (``CallInput.gradient``) taken whole or 1/mp of it, its gradient summed over the mp
    line (``mesh``); the hidden input is already local."""
    call = view.call or [CallInput(role="hidden")]
    positional = [c for c in call if not c.keyword]
    keywords = {c.keyword: c for c in call if c.keyword}
    if len(args) != len(positional) or set(kwargs) != set(keywords):
        raise RuntimeError(
            f"local view: {view.layer} called with {len(args)} positional arguments and keywords {sorted(kwargs)}; "
            f"the plan proved it with {len(positional)} and {sorted(keywords)}"
        )

    def local(value: Any, recorded: CallInput, name: str) -> Any:
        if recorded.role == "hidden":
            return value
        if recorded.role == "literal":
            if isinstance(value, paddle.Tensor) or value != recorded.value or type(value) is not type(recorded.value):
                raise RuntimeError(
                    f"local view: {view.layer} got {name}={value!r}; the plan proved it with {recorded.value!r}"
                )
            return value
        if recorded.role in ("tuple", "list"):
            if not isinstance(value, (tuple, list)) or len(value) != len(recorded.items):
                raise RuntimeError(
                    f"local view: {view.layer} got {name} of {type(value).__name__}; "
                    f"the plan proved a {recorded.role} of {len(recorded.items)}"
                )
            items = zip(value, recorded.items)
            return type(value)(local(v, item, f"{name}[{i}]") for i, (v, item) in enumerate(items))
        if not isinstance(value, paddle.Tensor):
            raise RuntimeError(f"local view: {view.layer} got {name}={value!r}; the plan proved it with a tensor")
        if not value.stop_gradient and not recorded.gradient:
            raise RuntimeError(
                f"local view: {view.layer} input {name} carries a gradient; the plan proved it with one that carries none"
            )
        taken = _replicated_local(value, hidden, recorded.batch, bool(recorded.gradient))
        mp = len(mesh.process_ids)
        if recorded.heads_at is not None:
            at = recorded.heads_at
            rank = mesh.process_ids.index(dist.get_rank())
            positions = head_positions(taken.shape[at], recorded.heads, mp, rank)
            taken = paddle.index_select(taken, paddle.to_tensor(positions, dtype="int64"), axis=at)
        if recorded.gradient == "share":
            return share_of(taken, mp)
        return _CopyToRanks.apply(taken, mesh) if recorded.gradient == "whole" else taken

    args = tuple(local(v, c, f"argument {i}") for i, (v, c) in enumerate(zip(args, positional)))
    return args, {k: local(v, keywords[k], k) for k, v in kwargs.items()}


def _replicated_local(x: paddle.Tensor, hidden: paddle.Tensor, batch: bool, carries: bool) -> paddle.Tensor:
    """This rank's value of an input other than the hidden one: whole over mp (every rank reads
    what the global run reads), and along a ``batch`` dim 0 the rows the hidden input's local
    value holds (its dp shard). A DistTensor placed otherwise is resharded so (a plain tensor is
    the same whole value on every rank: sliced, or taken as it is). One that ``carries`` a
    gradient and is whole over dp (DeBERTa's relative-position table) gets its gradient back
    Partial over dp where the hidden input is split there (:func:`summed_over_ranks`): each dp
    rank's covers only its own rows."""
    mesh = hidden.process_mesh
    placements = [
        p if batch and isinstance(p, dist.Shard) and p.get_dim() == 0 else dist.Replicate() for p in hidden.placements
    ]
    if not x.is_dist():
        if all(isinstance(p, dist.Replicate) for p in placements):
            return x
        x = dist.shard_tensor(x, mesh, placements)
    elif x.process_mesh != mesh or list(x.placements) != placements:
        x = dist.reshard(x, mesh, placements)
    return (
        dtensor_to_local(x, mesh, summed_over_ranks(mesh, placements, hidden.placements)) if carries else local_value(x)
    )


def local_value(x: paddle.Tensor) -> paddle.Tensor:
    """This rank's value of an input (a DistTensor replicated over mp: the whole activation)."""
    return dtensor_to_local(x, x.process_mesh, x.placements) if x.is_dist() else x


class _CopyToRanks(PyLayer):
    """Identity; its backward sums the ranks' gradients (each rank's heads' share of the input's)."""

    @staticmethod
    def forward(ctx, x, mesh):
        ctx.mesh = mesh
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return sum_over(grad, ctx.mesh)


class SumOverRanks(PyLayer):
    """The ranks' partial outputs summed; its backward hands each rank the whole gradient."""

    @staticmethod
    def forward(ctx, x, mesh):
        return sum_over(x, mesh)

    @staticmethod
    def backward(ctx, grad):
        return grad


def share_of(x: paddle.Tensor, mp: int) -> paddle.Tensor:
    """A rank's share of what is added once into a local view's output (a row bias, BLOOM's
    residual): ``x / mp`` forward, so the ranks' partial outputs sum to one whole ``x``; the whole
    gradient backward, which every rank already holds (the output's gradient is whole on every
    rank), so no collective. The planner's proof takes such inputs through it too.

    >>> x = paddle.to_tensor([1.0, 1.0], stop_gradient=False)
    >>> y = share_of(x, 2); y.sum().backward(); y.tolist(), x.grad.tolist()
    ([0.5, 0.5], [1.0, 1.0])
    """
    return _Scaled.apply(x, 1.0 / mp)


class _GatheredOverDp(PyLayer):
    """A parameter ZeRO stage 3 split over dp, gathered whole over dp (ZeRO-3's all-gather before
    the call); its backward hands the gradient on as it comes, Partial over dp: the optimizer's
    ZeRO-3 gradient hook reduce-scatters it to the rank's dp shard, as it does the gradient of a
    parameter read in the global view (a tied LM head's), which it is added to."""

    @staticmethod
    def forward(ctx, param, placements):
        return dist.reshard(param, param.process_mesh, placements)

    @staticmethod
    def backward(ctx, grad):
        return grad


class _Scaled(PyLayer):
    """``x * factor`` forward, identity backward: a bias each rank adds ``1/mp`` of, so the ranks'
    partial outputs sum to one whole bias, while every rank gets the whole bias gradient."""

    @staticmethod
    def forward(ctx, x, factor):
        return x * factor

    @staticmethod
    def backward(ctx, grad):
        return grad


def strategy_problems(field: str, plan: Plan) -> list[str]:
    """Why the plan's ``field`` (local views, vocabulary lookups) cannot run on local tensors under
    its strategy (:func:`~autodist.schemas.parallel_dims.runs_local_views`)."""
    refused = local_views_refused(plan.strategy)
    if not refused:
        return []
    return [
        f"{field}: does not run on local tensors with {refused}; this plan has {strategy_text(plan.strategy)}, "
        f"recompute {plan.strategy.recompute!r}"
    ]


def local_view_problems(model: paddle.nn.Layer, plan: Plan) -> list[str]:
    """Why ``plan.local_view`` cannot run on ``model``: a sub-layer, parameter, buffer or attribute
    the model lacks or has otherwise, a weight whose placement is not its split, or a strategy local
    views do not run under (:func:`~autodist.schemas.parallel_dims.runs_local_views`)."""
    if not plan.local_view:
        return []
    problems = strategy_problems("local_view", plan)
    if plan.strategy.sequence_parallel:
        problems += [
            f"local_view {v.layer}: {JOINED_UNDER_SEQUENCE_PARALLEL}" for v in plan.local_view if v.output == "joined"
        ]
    layers = dict(model.named_sublayers())
    params = {fqn for fqn, _ in model.named_parameters()}
    mp = plan.strategy.mp
    for view in plan.local_view:
        if view.layer not in layers:
            problems.append(f"local_view: the model has no layer {view.layer}")
            continue
        listed = {w.param for w in view.weights}
        unlisted = sorted(p for p in params if p.startswith(view.layer + ".") and p not in listed)
        if unlisted:
            problems.append(f"local_view {view.layer}: parameters {unlisted} are not among its weights")
        for weight in view.weights:
            planned = plan.params.get(weight.param)
            if weight.param not in listed or planned is None or not weight.param.startswith(view.layer + "."):
                problems.append(f"local_view {view.layer}: {weight.param} is not a planned parameter of it")
                continue
            want = mp_placement(weight)
            got = planned.placements[plan.mesh.axes.index("mp")] if "mp" in plan.mesh.axes else "R"
            if got != want or not _splits(weight, planned.shape, mp):
                problems.append(
                    f"local_view {view.layer}: {weight.param} is placed {got} with shape {planned.shape}; "
                    f"its local view needs {want} in {weight.segments} segments "
                    f"of sizes {weight.sizes or 'equal'} (whole: {weight.replicated}) split over {mp} ranks"
                )
        held = dict(layers[view.layer].named_buffers(prefix=view.layer))
        for buffer in view.buffers:
            found = held.get(buffer.name)
            shape = list(found.shape) if found is not None else None
            if shape != buffer.shape or buffer.dim >= len(buffer.shape) or buffer.shape[buffer.dim] % mp:
                problems.append(
                    f"local_view {view.layer}: buffer {buffer.name} should have shape {buffer.shape}, cut along dim "
                    f"{buffer.dim} into {mp} equal slices; the model's is {shape if shape is not None else 'missing'}"
                )
        for attribute in view.attributes:
            if attribute.layer != view.layer and not attribute.layer.startswith(view.layer + "."):
                problems.append(
                    f"local_view {view.layer}: attribute {attribute.layer}.{attribute.name} lies outside it"
                )
                continue
            layer = layers.get(attribute.layer)
            try:
                value = getattr(*attribute_owner(layer, attribute.name)) if layer is not None else None
            except AttributeError:
                value = None
            if type(value) is not int or value != attribute.whole:
                problems.append(
                    f"local_view {view.layer}: {attribute.layer}.{attribute.name} should be the integer "
                    f"{attribute.whole}, the model has {value!r}"
                )
    return problems


def _splits(weight: LocalWeight, shape: list[int], mp: int) -> bool:
    """Whether ``weight``'s segments (of a parameter of ``shape``) lie along its dim and split
    over ``mp`` as listed (:func:`~autodist.schemas.local_view.rank_positions`)."""
    if weight.dim is None:
        return True
    if weight.dim >= len(shape):
        return False
    try:
        rank_positions(weight, shape[weight.dim], mp, 0)
    except ValueError:
        return False
    return True
