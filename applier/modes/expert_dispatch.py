"""Expert parallelism (``strategy.ep``): each MoE layer's experts spread over groups of ep ranks.

The layout is Megatron-LM's "allgather" token dispatcher, chosen because it runs the model's own
MoE forward unchanged, whatever its routing looks like (a ``topk`` loop over every expert, a loop
over only the experts that got tokens, an einsum dispatch), and because it needs no all-to-all,
which the CPU wheel's gloo lacks (docs/paddle-notes.md, "Collectives on the CPU wheel"):

- An *ep group* is ``ep`` neighbouring data-parallel ranks (same mp coordinate, dp indices
  ``k*ep .. k*ep + ep - 1``). The rank at index ``j`` of its group holds experts
  ``j*E/ep .. (j+1)*E/ep - 1`` of each MoE layer, whole; the other experts' parameters are dropped
  on it and their forward answers zeros.
- ``expert_dispatch`` (before the MoE layer): the group's tokens are gathered, so every rank of
  the group routes all of them with the layer's own code and runs its own experts on those
  routed to them. Inside the layer every parameter is used as a plain local tensor.
- ``expert_combine`` (after it): each rank's output holds its experts' share of every token;
  the shares are summed over the group and each rank keeps its own tokens. Further tensors the
  layer returns (router logits) were computed on the gathered tokens: each rank keeps its rows.
- Shared experts (``expert_dispatch``'s ``shared``: MLPs beside the routed experts whose output
  is added to theirs) run on the first rank of each group only and answer zeros elsewhere, so
  the combine's sum counts them once.
- Gradients, before each optimizer update (:class:`ExpertGradSync`): a rank's router gradient
  covers only the routes to its experts, so the MoE layer's other parameters sum theirs over the
  whole dp axis; an expert's gradient covers its group's tokens, so it is summed over the dp/ep
  ranks that hold the same expert.

Why the sums are right: backward of "sum over the group, keep my rows" is "gather the rows'
gradients", so every rank sees the gradient of every gathered token; backward of the gather is
"sum over the group, keep my rows" again. The result is the single-device gradient exactly
(tests/test_train_experts.py trains to single-device losses).

Example::

    >>> ExpertLayout.of([0, 1, 2, 3], ["dp"], rank=2, ep=2)
    ExpertLayout(ep=2, index=0, group=[2, 3], replicas=[0, 2], dp=[0, 1, 2, 3])
    >>> held_experts(8, ep=2, index=1)
    range(4, 8)
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import paddle
import paddle.distributed as dist
from paddle.autograd import PyLayer
from paddle.distributed.auto_parallel.api import dtensor_from_local, dtensor_to_local

from autodist.schemas import ExpertDispatch, Plan
from autodist.schemas.experts import ep_index, held_experts
from autodist.schemas.parallel_dims import expert_limit
from autodist.schemas.vocabulary import expert_number

from autodist.applier.placement.clip import sum_over
from autodist.applier.placement.hooks import first_tensor, map_first_input, map_tensors
from autodist.applier.placement.mesh import mesh_ids, stage_mesh
from autodist.applier.placement.shard import parameter_owners


@dataclass(frozen=True)
class ExpertLayout:
    """This rank's place in expert parallelism: its index in its ep group (which experts it
    holds), the group's ranks, the ranks holding the same experts, and its dp axis's ranks."""

    ep: int
    index: int
    group: list[int]
    replicas: list[int]
    dp: list[int]

    @classmethod
    def of(cls, ids: Any, axes: list[str], rank: int, ep: int) -> ExpertLayout:
        """The layout of ``rank`` on a mesh of process ``ids`` over ``axes`` (no pp axis)."""
        line = _dp_line(np.asarray(ids), axes, rank)
        index = ep_index(line.index(rank), ep)
        start = line.index(rank) - index
        return cls(ep, index, line[start : start + ep], line[index::ep], line)

    @classmethod
    def of_plan(cls, plan: Plan, rank: int) -> ExpertLayout:
        return cls.of(mesh_ids(plan), list(plan.mesh.axes), rank, plan.strategy.ep)


def dropped_parameters(plan: Plan, rank: int) -> set[str]:
    """The planned parameters this rank does not hold: the experts of other ranks of its group."""
    if plan.strategy.ep == 1:
        return set()
    return _dropped_at(plan, ExpertLayout.of_plan(plan, rank).index)


def expert_holders(plan: Plan) -> dict[str, list[int]]:
    """Each expert parameter the plan spreads over ep ranks, with the ranks holding it
    (ascending): those that do not drop it (:func:`dropped_parameters`). Empty without ep."""
    if plan.strategy.ep == 1:
        return {}
    ranks = sorted(int(r) for r in mesh_ids(plan).flat)
    index = {r: ExpertLayout.of_plan(plan, r).index for r in ranks}
    dropped = {j: _dropped_at(plan, j) for j in range(plan.strategy.ep)}
    experts = set().union(*dropped.values())  # each expert is dropped at every other index
    return {fqn: [r for r in ranks if fqn not in dropped[index[r]]] for fqn in sorted(experts)}


def _dropped_at(plan: Plan, index: int) -> set[str]:
    """The expert parameters the rank at ``index`` of an ep group does not hold."""
    dropped = set()
    for container, count in _containers(plan).items():
        held = held_experts(count, plan.strategy.ep, index)
        for fqn in plan.params:
            number = _expert_of(fqn, container)
            if number is not None and number not in held:
                dropped.add(fqn)
    return dropped


def _expert_of(fqn: str, container: str) -> int | None:
    """Which expert of ``container`` the parameter ``fqn`` belongs to, or None."""
    if not fqn.startswith(container + "."):
        return None
    return expert_number(fqn[len(container) + 1 :].split(".")[0])


def expert_structure_problems(model: paddle.nn.Layer, plan: Plan) -> list[str]:
    """What the model must have for the plan's expert hooks: the shared experts named, and, where
    ranks drop the experts they do not hold (ep > 1), numbered experts under each container, as
    many as the plan's blocks say. At ep 1 every rank runs the layer whole, whatever holds its
    experts (numbered layers, or one layer's batched weights: GPT-OSS's)."""
    layers = dict(model.named_sublayers())
    problems = [
        f'experts: no sub-layer "{shared}" in the model (a shared expert of {hook.layer})'
        for hook in plan.hooks
        if isinstance(hook, ExpertDispatch)
        for shared in hook.shared
        if shared not in layers
    ]
    for container, count in sorted(_containers(plan).items()) if plan.strategy.ep > 1 else ():
        held = layers.get(container)
        if held is None:
            continue  # hook_problems names a missing layer
        numbered = sorted(n for n in (expert_number(name) for name, _ in held.named_children()) if n is not None)
        if numbered != list(range(count)):
            problems.append(
                f'experts: "{container}" has {len(numbered)} numbered sub-layers, the plan spreads {count} '
                "experts over ep ranks"
            )
    return problems


def runs_moe_locally(plan: Plan) -> bool:
    """Whether the plan runs its MoE layers between an expert dispatch and combine (the plan's
    hooks say it): under expert parallelism, and (ep 1) under the data parallelism the planner
    gives MoE models, or under mp alone for MoE layers holding an op Paddle runs on plain tensors
    only (``autodist.schemas.parallel_dims.runs_moe_locally`` says why)."""
    return any(isinstance(hook, ExpertDispatch) for hook in plan.hooks)


def expert_problems(plan: Plan) -> list[str]:
    """Strategies expert parallelism (and MoE layers run locally) do not run with yet
    (:func:`~autodist.schemas.parallel_dims.expert_limit`, the rule the planner and check_plan use)."""
    if not runs_moe_locally(plan):
        return []
    problem = expert_limit(plan.strategy, moe=True, hooks=True)
    return [f"strategy: {problem}"] if problem else []


# -- applying it ---------------------------------------------------------------------------------------


def spread_experts(model: paddle.nn.Layer, plan: Plan, groups: ExpertGroups) -> None:
    """Turn the experts this rank does not hold (and the shared experts, but on the first rank of
    each ep group) into zero answers and wrap each MoE layer in its dispatch and combine
    (:meth:`_MoeLayer.wrap`). Call after :func:`~autodist.applier.placement.shard.shard_parameters` (with
    :func:`dropped_parameters` left out)."""
    layers = dict(model.named_sublayers())
    moe_layers = {}
    for hook in plan.hooks:
        if isinstance(hook, ExpertDispatch):
            count = _containers(plan)[hook.experts]
            held = held_experts(count, plan.strategy.ep, groups.layout.index)
            for name, expert in layers[hook.experts].named_children():
                number = expert_number(name)
                if number is not None and number not in held:
                    expert.forward = _answer_zeros
            if groups.layout.index:  # the first rank of the group runs the shared experts for it
                for shared in hook.shared:
                    layers[shared].forward = _answer_zeros
            moe_layers[hook.layer] = _MoeLayer(layers[hook.layer], groups)
    for layer, moe in moe_layers.items():  # check_plan pairs every combine with a dispatch on its layer
        moe.wrap(layers[layer])


class ExpertGroups:
    """The ranks this rank shares work with under expert parallelism, as one-axis meshes: its
    ep group, its dp axis, and the ranks holding the same experts (None when it is alone).

    Collectives go through ``dist.reshard`` on these meshes, which creates each group's
    communicator among its own ranks; ``dist.new_group`` on the CPU wheel's gloo fails at random
    once a job creates several groups (docs/paddle-notes.md, "Expert parallelism")."""

    def __init__(self, plan: Plan, rank: int):
        self.layout = layout = ExpertLayout.of_plan(plan, rank)
        # The MoE layers' inputs and outputs live on the plan's mesh (ep and the local run go
        # without pp). Built here, not read off the input: Paddle's ``x.process_mesh`` lives only
        # as long as ``x``, gone by the combine when nothing else holds the layer's input
        # (``moe.forward(norm(h))``: 'basic_string::_M_create', then a segfault).
        self.mesh = stage_mesh(plan, 0)
        self.group = dist.ProcessMesh(layout.group, dim_names=["ep"])
        self.dp = dist.ProcessMesh(layout.dp, dim_names=["dp"])
        self.replicas = dist.ProcessMesh(layout.replicas, dim_names=["dp"]) if len(layout.replicas) > 1 else None


class ExpertGradSync:
    """Before each update, sums the MoE layers' gradients over the ranks that share them (module
    docstring); anything else is the wrapped optimizer's. Clipping by global norm, which must
    count each rank's own experts as part of the ep group's, is :mod:`autodist.applier.placement.clip`'s
    (``apply_plan`` wraps it inside this, so it clips the summed gradients)."""

    def __init__(self, optimizer: Any, model: paddle.nn.Layer, plan: Plan, groups: ExpertGroups):
        self._inner, self._groups = optimizer, groups
        self._experts, self._shared = moe_parameters(model, plan)

    def step(self) -> None:
        with paddle.no_grad():
            for param in self._shared:
                _sum_gradient(param, self._groups.dp)
            if self._groups.replicas is not None:
                for param in self._experts:
                    _sum_gradient(param, self._groups.replicas)
        self._inner.step()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def moe_parameters(model: paddle.nn.Layer, plan: Plan) -> tuple[list[paddle.Tensor], list[paddle.Tensor]]:
    """The MoE layers' parameters on this rank: the experts' (each rank its own), and the
    others (routers, shared experts)."""
    params = {slot.fqn: model_param for model_param, slots in _params_by_object(model) for slot in slots}
    moe_layers = tuple(h.layer + "." for h in plan.hooks if isinstance(h, ExpertDispatch))
    containers = tuple(h.experts + "." for h in plan.hooks if isinstance(h, ExpertDispatch))
    inside = sorted(fqn for fqn in params if fqn.startswith(moe_layers))
    return [params[f] for f in inside if f.startswith(containers)], [
        params[f] for f in inside if not f.startswith(containers)
    ]


def refuse_training_without_optimizer(model: paddle.nn.Layer, plan: Plan) -> None:
    """For a model applied with no optimizer: a backward through its MoE layers raises
    ``ValueError``. Their gradients are summed over the ranks that share them only by the
    optimizer ``apply_plan`` returns (:class:`ExpertGradSync`), so one built afterwards would
    train each rank's copies apart, with no message. Evaluation runs no backward: unaffected."""
    experts, shared = moe_parameters(model, plan)

    def refuse(grad: paddle.Tensor) -> paddle.Tensor:
        raise ValueError(
            "this model was applied without an optimizer, but its MoE layers' gradients are summed over the "
            "ranks that share them only by the optimizer apply_plan returns; pass yours: "
            "model, opt, loader = apply_plan(model, opt, loader, plan)"
        )

    for param in experts + shared:
        if not param.stop_gradient:
            param.register_hook(refuse)


# -- inside -------------------------------------------------------------------------------------------------


class _MoeLayer:
    """One MoE layer's dispatch (pre-hook) and combine (post-hook)."""

    def __init__(self, layer: paddle.nn.Layer, groups: ExpertGroups):
        self.groups = groups
        self.slots = [
            (sub, key, p)
            for sub in layer.sublayers(include_self=True)
            for key, p in sub._parameters.items()
            if p is not None
        ]

    def wrap(self, layer: paddle.nn.Layer) -> None:
        """Run ``layer``'s forward between :meth:`dispatch` and :meth:`combine`. Not as forward
        hooks: Paddle runs those only for ``layer(x)``, and Mistral's reference code calls its
        MoE layer as ``self.feed_forward.forward(h)`` (tests/models/zoo/mixtral_mistral_ref.py),
        which would skip them and train on the wrong tokens. The forward replaced on the
        instance runs for both spellings, as recompute's and the dropped experts' do."""
        forward = layer.forward

        @functools.wraps(forward)
        def run(*args: Any, **kwargs: Any) -> Any:
            args, kwargs = self.dispatch(layer, args, kwargs)
            return self.combine(layer, args, forward(*args, **kwargs))

        layer.forward = run

    def dispatch(self, layer, args, kwargs):
        def gather(x):
            if not x.is_dist() or list(x.placements) != _tokens_split(x.process_mesh):
                # Each rank's rows must be its own tokens: a batch copied to every dp rank would
                # train each expert on every copy.
                got = x.placements if x.is_dist() else "a plain tensor"
                raise RuntimeError(
                    f"expert parallelism: {type(layer).__name__} needs its input split over dp by the batch "
                    f"and whole on every other mesh axis, got {got}"
                )
            local = dtensor_to_local(x, x.process_mesh, x.placements)
            layout = self.groups.layout
            gathered = _GatherRows.apply(local, self.groups.group, layout.index, layout.ep) if layout.ep > 1 else local
            # Rows of the gathered tokens, however the layer flattens them: [b, ...], [b*s, ...]
            self.row_counts = {math.prod(gathered.shape[:k]) for k in range(1, gathered.ndim)}
            return gathered

        # The layer computes on plain local tensors: its parameters too, for this call.
        for sub, key, param in self.slots:
            sub._parameters[key] = dtensor_to_local(param, param.process_mesh, param.placements)
        return map_first_input(args, kwargs, gather)

    def combine(self, layer, args, output):
        for sub, key, param in self.slots:
            sub._parameters[key] = param
        ep, index, group = self.groups.layout.ep, self.groups.layout.index, self.groups.group
        mesh = self.groups.mesh
        tokens = _tokens_split(mesh)  # the input's placements, as dispatch checked them
        # The first tensor is the experts' output: each rank holds its experts' share of every
        # token. Any other tensor of rows (router logits) is whole on every rank of the group.
        summed = first_tensor(output)

        def back_to_dist(tensor):
            if tensor.is_dist() or tensor.ndim == 0 or tensor.shape[0] not in self.row_counts:
                return tensor  # not of the gathered tokens (a scalar auxiliary loss): as it is
            if ep == 1:  # the rank's own tokens: its output is whole already
                mine = tensor
            elif tensor is summed:
                mine = _SumRows.apply(tensor, group, index, ep)
            else:
                mine = _my_rows(tensor, index, ep)
            return dtensor_from_local(mine, mesh, tokens if tensor is summed else _rows(tokens, tensor.ndim))

        return map_tensors(output, back_to_dist)


class _GatherRows(PyLayer):
    """Forward: the ep group's tensors stacked along dim 0 (rank order). Backward: the gradient
    summed over the group, this rank's rows."""

    @staticmethod
    def forward(ctx, x, group, index, ep):
        ctx.group, ctx.index, ctx.ep = group, index, ep
        return _gather(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _my_rows(sum_over(grad, ctx.group), ctx.index, ctx.ep)


class _SumRows(PyLayer):
    """Forward: the tensor summed over the ep group, this rank's rows. Backward: the rows'
    gradients of the whole group, stacked (rank order)."""

    @staticmethod
    def forward(ctx, x, group, index, ep):
        ctx.group = group
        return _my_rows(sum_over(x, group), index, ep)

    @staticmethod
    def backward(ctx, grad):
        return _gather(grad, ctx.group)


def _gather(x: paddle.Tensor, mesh: dist.ProcessMesh) -> paddle.Tensor:
    """The tensors of ``mesh``'s ranks stacked along dim 0 (rank order): an all-gather."""
    if len(mesh.process_ids) == 1:
        return x
    whole = dist.reshard(dtensor_from_local(x, mesh, [dist.Shard(0)]), mesh, [dist.Replicate()])
    return whole._local_value()


def _tokens_split(mesh: dist.ProcessMesh) -> list:
    """The placements of an MoE layer's input: the batch split over dp, whole on other axes."""
    return [dist.Shard(0) if axis == "dp" else dist.Replicate() for axis in mesh.dim_names]


def _my_rows(tensor: paddle.Tensor, index: int, ep: int) -> paddle.Tensor:
    rows = tensor.shape[0] // ep
    return tensor[index * rows : (index + 1) * rows]


def _rows(placements: list, ndim: int) -> list:
    """The input's placements for a tensor of rows of the gathered tokens (``ndim`` dims)."""
    return [p if not isinstance(p, dist.Shard) or p.get_dim() < ndim else dist.Replicate() for p in placements]


def _answer_zeros(x, *args, **kwargs):
    """The forward of an expert another rank holds: its share of every token is zero."""
    return paddle.zeros_like(x)


def _sum_gradient(param: paddle.Tensor, group) -> None:
    """Sum ``param``'s gradient over ``group``. A rank where the parameter got none (an expert no
    token of its group reached) contributes zeros and receives the others' sum; when no rank got
    one it keeps none, as one device would (the optimizer then leaves the parameter alone)."""
    grad = param.grad
    local = grad._local_value() if grad is not None else paddle.zeros(param.shape, param.dtype)
    # One collective for both: the gradient, and how many ranks had one.
    had = paddle.full([1], 1.0 if grad is not None else 0.0, local.dtype)
    packed = sum_over(paddle.concat([local.flatten(), had]), group)
    total, holders = packed[:-1].reshape(local.shape), float(packed[-1])
    if grad is not None:
        grad._local_value().copy_(total, False)
    elif holders > 0:
        param._set_grad_ivar(dtensor_from_local(total, param.process_mesh, param.placements))


def _dp_line(ids: np.ndarray, axes: list[str], rank: int) -> list[int]:
    """The ranks along the dp axis through ``rank`` (just ``rank`` without a dp axis)."""
    where = tuple(int(i) for i in np.argwhere(ids == rank)[0])
    if "dp" not in axes:
        return [rank]
    d = axes.index("dp")
    return [int(ids[where[:d] + (k,) + where[d + 1 :]]) for k in range(ids.shape[d])]


def _containers(plan: Plan) -> dict[str, int]:
    """Each expert container under an ``expert_dispatch`` hook, with its number of experts."""
    counts = {b.experts: b.num_experts for b in plan.blocks if b.experts}
    return {h.experts: counts.get(h.experts, 0) for h in plan.hooks if isinstance(h, ExpertDispatch)}


def _params_by_object(model: paddle.nn.Layer):
    held = {}
    for slots in parameter_owners(model).values():
        first = slots[0]
        held[id(first.layer._parameters[first.key])] = (first.layer._parameters[first.key], slots)
    return held.values()
