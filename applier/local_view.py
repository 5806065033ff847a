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
  1/mp of itself, its gradient the whole one; a gradient comes back Partial over dp, summed by
  the optimizer as any data-parallel gradient (docs/paddle-notes.md, "Local-view tensor parallelism");
- the size attributes it reads (``self.num_heads``, ``self.split_size``, ``c_attn.nf``, an MLP's
  ``self.intermediate_size``) set to their local values, restored when the call returns or raises;
- its output: each rank's partial sum, summed over the rank's mp line (one all-reduce, Megatron's
  ``g``; its backward hands every rank the whole gradient) and handed back as a DistTensor placed
  as the input was.

Checkpoints hold the model's own layout: :meth:`LocalViews.own_boxes` says which boxes of it a
rank's piece of a fused weight holds (applier/checkpoint.py saves and reads those).

The scores, softmax and context therefore run on each rank's heads only, a gated activation on
each rank's intermediate features only. The forward is replaced on the instance (as experts.py
does), so ``layer.forward(x)`` runs local too.

Example::

    >>> views = LocalViews(plan)                               # doctest: +SKIP
    >>> views.wrap(model)                                      # doctest: +SKIP
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import paddle
import paddle.distributed as dist
from paddle.autograd import PyLayer
from paddle.distributed.auto_parallel.api import dtensor_from_local, dtensor_to_local

from autodist.schemas import CallInput, LocalView, LocalWeight, Plan
from autodist.schemas.describe import strategy_text
from autodist.schemas.local_view import (
    attribute_owner,
    hidden_output,
    local_order,
    local_views_refused,
    own_order,
    rank_positions,
    reordered,
)

from autodist.applier.clip import sum_over
from autodist.applier.hooks import map_first_input
from autodist.applier.mesh import mesh_ids
from autodist.applier.recompute import recomputed_inside_views, recomputing


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
            _wrap(layers[view.layer], view, layers, line, view.layer in recomputed)


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


def param_local(param: paddle.Tensor) -> paddle.Tensor:
    """A parameter's local value for this call. Its gradient comes back Partial on every axis
    the parameter is replicated on but mp (dp: each rank's gradient covers its own rows of the
    batch; the optimizer sums it, as for any data-parallel gradient, and ZeRO's gradient hook
    reshards that one Partial axis to the rank's dp shard)."""
    mesh = param.process_mesh
    backward = [
        p if name == "mp" or not isinstance(p, dist.Replicate) else dist.Partial()
        for name, p in zip(mesh.dim_names, param.placements)
    ]
    return dtensor_to_local(param, mesh, backward)


def _call_value(param: paddle.Tensor, weight: LocalWeight | None, line: dist.ProcessMesh, rank: int) -> paddle.Tensor:
    """Mp rank ``rank``'s value of a parameter for the call (``line``: the ranks along mp): its
    local shard (a reordered fused weight's is already ``q_r|k_r|v_r``); 1/mp of a summed bias; of
    a weight held whole with segments computed whole (``replicated``: a multi-query ``q|k|v``),
    its columns ``q_r|k|v`` (:func:`~autodist.schemas.local_view.rank_positions`). The last one's
    gradient is each rank's share, landing on the columns it took (its slice of q, its heads' part
    of K's and V's): summed over the mp line in the backward (:class:`_CopyToRanks`, the proof's
    reassembly, planner/local_view.py ``_reassembled``), it re-enters whole over mp, Partial over
    dp only, like any data-parallel gradient (Paddle's ZeRO hook reshards one Partial axis; with
    two it shards the gradient over mp and the update splits the weight)."""
    mp = len(line.process_ids)
    if weight is not None and weight.replicated and weight.dim is not None:
        local = _CopyToRanks.apply(param_local(param), line)
        positions = rank_positions(weight, local.shape[weight.dim], mp, rank)
        return paddle.index_select(local, paddle.to_tensor(positions, dtype="int64"), axis=weight.dim)
    local = param_local(param)
    return _Scaled.apply(local, 1.0 / mp) if weight is not None and weight.summed else local


def _wrap(layer: paddle.nn.Layer, view: LocalView, layers: dict, mesh: dist.ProcessMesh, recomputed: bool) -> None:
    """Replace ``layer.forward`` by its run on local tensors (the module docstring); ``recomputed``:
    that run keeps only its local inputs and runs again in backward (applier/recompute.py), the
    all-reduces around it once."""
    weights = {w.param: w for w in view.weights}
    rank = mesh.process_ids.index(dist.get_rank())
    prefix = view.layer + "."
    slots = [
        (sub, key, param, f"{prefix}{name}.{key}" if name else f"{prefix}{key}")
        for name, sub in layer.named_sublayers(include_self=True)
        for key, param in sub._parameters.items()
        if param is not None
    ]
    attributes = [(*attribute_owner(layers[a.layer], a.name), a.local) for a in view.attributes]
    forward = layer.forward

    @functools.wraps(forward)
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
            local.append(_CopyToRanks.apply(local_value(x), mesh))
            return local[0]

        args, kwargs = map_first_input(args, kwargs, first)
        args, kwargs = _called_as_proven(view, args, kwargs, placed[0])

        def call(x: paddle.Tensor, *values: paddle.Tensor) -> Any:
            """The model's own forward on this rank's input ``x`` and parameter ``values``."""
            saved = [(owner, name, getattr(owner, name)) for owner, name, _ in attributes]
            try:
                for (sub, key, _, _), value in zip(slots, values):
                    sub._parameters[key] = value
                for owner, name, value in attributes:
                    setattr(owner, name, value)
                call_args, call_kwargs = map_first_input(args, kwargs, lambda _: x)
                return forward(*call_args, **call_kwargs)
            finally:
                for sub, key, param, _ in slots:
                    sub._parameters[key] = param
                for owner, name, value in saved:
                    setattr(owner, name, value)

        values = [_call_value(param, weights.get(fqn), mesh, rank) for _, _, param, fqn in slots]
        output = recomputing(call, local[0], *values) if recomputed else call(local[0], *values)
        found = hidden_output(output, view.dropped_outputs)
        if found is None or not isinstance(found[0], paddle.Tensor):
            raise RuntimeError(
                f"local view: {view.layer} returned {type(output).__name__} with more than one tensor; "
                f"the plan proved it returning one (and None for items {view.dropped_outputs})"
            )
        hidden, index = found
        whole = dtensor_from_local(SumOverRanks.apply(hidden, mesh), placed[0].process_mesh, placed[0].placements)
        # the dropped items (per-head, each rank's heads only) are None: a reader fails, never reads a part
        return whole if index is None else type(output)([whole, *(None for _ in output[1:])])

    layer.forward = run


def _called_as_proven(view: LocalView, args: tuple, kwargs: dict, hidden: paddle.Tensor) -> tuple[tuple, dict]:
    """The call's other arguments as this rank's values, after checking the call is the one the
    plan proved (``view.call``, by position and keyword; an empty call is the hidden input alone):
    the same literals, tensors where it had tensors. Each tensor carries no gradient and is taken
    whole over mp (:func:`_replicated_local`); the hidden input is already local."""
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
        return _replicated_local(value, hidden, recorded.batch, f"{view.layer} input {name}")

    args = tuple(local(v, c, f"argument {i}") for i, (v, c) in enumerate(zip(args, positional)))
    return args, {k: local(v, keywords[k], k) for k, v in kwargs.items()}


def _replicated_local(x: paddle.Tensor, hidden: paddle.Tensor, batch: bool, what: str) -> paddle.Tensor:
    """This rank's value of an input other than the hidden one: whole over mp (every rank reads
    what the global run reads), and along a ``batch`` dim 0 the rows the hidden input's local
    value holds (its dp shard). A DistTensor placed otherwise is resharded so (a plain tensor is
    the same whole value on every rank: sliced, or taken as it is). It must carry no gradient:
    each rank's would be its heads' share only, which the proof did not cover."""
    if not x.stop_gradient:
        raise RuntimeError(f"local view: {what} carries a gradient; the plan proved it with inputs that carry none")
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
    return local_value(x)


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
    its strategy (:func:`~autodist.schemas.local_view.runs_local_views`)."""
    refused = local_views_refused(plan.strategy)
    if not refused:
        return []
    return [
        f"{field}: does not run on local tensors with {refused}; this plan has {strategy_text(plan.strategy)}, "
        f"recompute {plan.strategy.recompute!r}"
    ]


def local_view_problems(model: paddle.nn.Layer, plan: Plan) -> list[str]:
    """Why ``plan.local_view`` cannot run on ``model``: a sub-layer, parameter or attribute the
    model lacks or has otherwise, a weight whose placement is not its split, or a strategy local
    views do not run under (:func:`~autodist.schemas.local_view.runs_local_views`)."""
    if not plan.local_view:
        return []
    problems = strategy_problems("local_view", plan)
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
            want = "R" if weight.dim is None or weight.replicated else f"S({weight.dim})"
            got = planned.placements[plan.mesh.axes.index("mp")] if "mp" in plan.mesh.axes else "R"
            if got != want or not _splits(weight, planned.shape, mp):
                problems.append(
                    f"local_view {view.layer}: {weight.param} is placed {got} with shape {planned.shape}; "
                    f"its local view needs {want} in {weight.segments} segments "
                    f"of sizes {weight.sizes or 'equal'} (whole: {weight.replicated}) split over {mp} ranks"
                )
        for attribute in view.attributes:
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
