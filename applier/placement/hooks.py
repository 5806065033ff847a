"""The plan's forward hooks: reshards, sequence-parallel transposes, pipeline stage hand-offs.

Each hook acts on its layer's inputs (``pre``) or outputs (``post``):

- ``reshard``: the first tensor (the activation; masks and caches pass through) is resharded
  to the hook's placements on the layer's stage mesh;
- ``sequence_parallel_begin``: the first tensor goes from ``[b, s, h]`` to ``[s, b, h]`` and is
  split over ``mp`` along the sequence, as Paddle's ``SequenceParallelBegin`` does;
- ``sequence_parallel_end``: the reverse, gathering the sequence (``SequenceParallelEnd``);
- ``stage_handoff``: every tensor moves, placements kept, onto stage ``to_stage``'s mesh.

All reshards go through one function, ``reshard_fn`` (``dist.reshard`` by default), so a test
harness may substitute another. On Paddle 3.3.1's CPU wheel some transitions have no kernel
(Partial->Shard needs reduce_scatter, Shard(i)->Shard(j) needs all_to_all) and a reshard
between two meshes (the stage hand-off) segfaults; see docs/paddle-notes.md, "Collectives on the CPU wheel". The library does not
hide that: a CPU harness passes its own clearly labelled ``reshard_fn``, hand-offs need a GPU.

Example::

    >>> handles = register_hooks(model, plan)              # doctest: +SKIP
    >>> for h in handles: h.remove()                        # undo  # doctest: +SKIP
"""

from __future__ import annotations

from typing import Any, Callable

import paddle
import paddle.distributed as dist

from autodist.schemas import ExpertCombine, ExpertDispatch, Hook, Plan, Reshard, StageHandoff
from autodist.schemas.schedules import PIPELINING_SCHEDULES

from autodist.applier.placement.mesh import stage_mesh, stage_placements

#: ``reshard_fn(tensor, mesh, placements) -> tensor``, the signature of ``dist.reshard``.
ReshardFn = Callable[[paddle.Tensor, dist.ProcessMesh, list], paddle.Tensor]


def register_hooks(model: paddle.nn.Layer, plan: Plan, reshard_fn: ReshardFn | None = None) -> list[Any]:
    """Register every hook of ``plan`` on its layer; returns the handles (``.remove()`` undoes)."""
    reshard_fn = reshard_fn or dist.reshard
    layers = dict(model.named_sublayers())
    handles = []
    for hook in plan.hooks:
        if isinstance(hook, (ExpertDispatch, ExpertCombine)):
            continue  # expert parallelism's own (experts.py)
        if hook.action == "stage_handoff" and plan.strategy.schedule in PIPELINING_SCHEDULES:
            continue  # the schedule sends activations between stages itself
        transform = _transform(hook, plan, reshard_fn)
        layer = layers[hook.layer]
        if hook.when == "pre":
            handles.append(layer.register_forward_pre_hook(_pre_hook(transform, hook), with_kwargs=True))
        else:
            handles.append(layer.register_forward_post_hook(_post_hook(transform, hook)))
    return handles


def layer_stage(plan: Plan, layer: str) -> int:
    """The pipeline stage a layer runs on: that of its parameters, else of the block that
    contains it, else 0."""
    prefix = layer + "."
    stages = [p.stage for fqn, p in plan.params.items() if fqn.startswith(prefix)]
    if stages:
        return min(stages)
    blocks = [b for b in plan.blocks if layer == b.layer or layer.startswith(b.layer + ".")]
    return blocks[0].stage if blocks else 0


def sequence_split_sides(plan: Plan, layer: str) -> tuple[bool, bool]:
    """Under sequence parallelism, whether the plan's hooks on ``layer`` gather its first input
    over mp from the sequence split (``pre``: a ``sequence_parallel_end``, or a ``reshard`` to
    Replicate on mp) and split its output over mp again (``post``: a ``sequence_parallel_begin``,
    or a ``reshard`` to a Shard on mp). A sub-layer run on local tensors (a local view, a
    vocabulary-split lookup) then leaves its partial output Partial over mp for the post hook,
    whose reshard to the sequence split is Megatron's reduce-scatter, and hands its input
    gradient back Partial over mp to the pre hook, whose backward reduce-scatters it too
    (where it would otherwise all-reduce and then keep a slice).

    >>> from types import SimpleNamespace
    >>> from autodist.schemas import Mesh, Strategy, SequenceParallelBegin, SequenceParallelEnd
    >>> hooks = [SequenceParallelEnd(layer="h.0.attn", when="pre"), SequenceParallelBegin(layer="h.0.attn", when="post"),
    ...          SequenceParallelBegin(layer="wte", when="post")]
    >>> plan = SimpleNamespace(mesh=Mesh(axes=["mp"], shape=[2], process_ids=[0, 1]), hooks=hooks,
    ...                        strategy=Strategy(mp=2, sequence_parallel=True))   # the fields it reads of a Plan
    >>> sequence_split_sides(plan, "h.0.attn"), sequence_split_sides(plan, "wte"), sequence_split_sides(plan, "h.0.mlp")
    ((True, True), (False, True), (False, False))
    """
    if not plan.strategy.sequence_parallel or "mp" not in plan.mesh.axes:
        return False, False
    mp = plan.mesh.axes.index("mp")
    sides = {"pre": False, "post": False}
    for hook in plan.hooks:
        if hook.layer != layer:
            continue
        if isinstance(hook, Reshard):
            sides[hook.when] |= (
                hook.placements[mp] == "R" if hook.when == "pre" else hook.placements[mp].startswith("S")
            )
        else:
            sides[hook.when] |= (
                hook.action == {"pre": "sequence_parallel_end", "post": "sequence_parallel_begin"}[hook.when]
            )
    return sides["pre"], sides["post"]


# -- the transforms: Tensor -> Tensor ------------------------------------------------------------------


def _transform(hook: Hook, plan: Plan, reshard_fn: ReshardFn) -> Callable[[paddle.Tensor], paddle.Tensor]:
    mesh = stage_mesh(plan, layer_stage(plan, hook.layer))
    if isinstance(hook, Reshard):
        placements = stage_placements(plan, hook.placements)
        return lambda x: reshard_fn(_as_dist(x, mesh), mesh, placements)
    if isinstance(hook, StageHandoff):
        target = stage_mesh(plan, hook.to_stage)
        return lambda x: _hand_off(x, target, reshard_fn)
    mp = mesh.dim_names.index("mp")
    if hook.action == "sequence_parallel_begin":
        return lambda x: _split_sequence(_as_dist(x, mesh), mesh, mp, reshard_fn)
    return lambda x: _gather_sequence(_as_dist(x, mesh), mesh, mp, reshard_fn)


def _hand_off(x, target: dist.ProcessMesh, reshard_fn: ReshardFn):
    """Move ``x`` onto the next stage's mesh; stage meshes have the same dims, so the
    placements carry over unchanged. A dense tensor (made in the model's own forward, like a
    mask) is whole on every rank: it is placed on the target directly, with no communication."""
    if not x.is_dist():
        return dist.shard_tensor(x, target, _replicated(target))
    if x.process_mesh == target:
        return x
    return reshard_fn(x, target, list(x.placements))


def _split_sequence(x, mesh, mp: int, reshard_fn: ReshardFn):
    """[b, s, h] -> [s, b, h], sequence split over mp (Paddle's SequenceParallelBegin)."""
    x = paddle.transpose(x, perm=[1, 0, 2])
    placements = list(x.placements)
    placements[mp] = dist.Shard(0)
    return reshard_fn(x, mesh, placements)


def _gather_sequence(x, mesh, mp: int, reshard_fn: ReshardFn):
    """[s/mp, b, h] -> [b, s, h], sequence gathered (Paddle's SequenceParallelEnd). Transposed
    first, gathered last: a Partial gradient coming back (a column projection's input gradient,
    a local view's) then reaches the gather's backward as it is, a reduce-scatter, where
    Paddle's transpose backward would all-reduce it first."""
    x = paddle.transpose(x, perm=[1, 0, 2])
    placements = list(x.placements)
    placements[mp] = dist.Replicate()
    return reshard_fn(x, mesh, placements)


def _as_dist(x: paddle.Tensor, mesh: dist.ProcessMesh) -> paddle.Tensor:
    """A dense tensor (a loader batch the user did not shard) becomes replicated on ``mesh``."""
    return x if x.is_dist() else dist.shard_tensor(x, mesh, _replicated(mesh))


def _replicated(mesh: dist.ProcessMesh) -> list:
    return [dist.Replicate() for _ in mesh.dim_names]


# -- applying a transform to a layer's inputs or outputs -----------------------------------------------


def _pre_hook(transform, hook: Hook):
    def pre(layer, args, kwargs):
        if hook.action == "stage_handoff":
            return map_tensors(args, transform), map_tensors(kwargs, transform)
        return map_first_input(args, kwargs, transform)

    return pre


def _post_hook(transform, hook: Hook):
    def post(layer, args, output):
        if hook.action == "stage_handoff":
            return map_tensors(output, transform)
        return map_first(output, transform)

    return post


def map_tensors(value: Any, fn: Callable) -> Any:
    """Apply ``fn`` to every Tensor in a (nested) tuple / list / dict; leave the rest."""
    if isinstance(value, paddle.Tensor):
        return fn(value)
    if isinstance(value, (tuple, list)):
        return type(value)(map_tensors(v, fn) for v in value)
    if isinstance(value, dict):
        return {k: map_tensors(v, fn) for k, v in value.items()}
    return value


def map_first(value: Any, fn: Callable, kind: type = paddle.Tensor) -> Any:
    """Apply ``fn`` to the first top-level Tensor of ``value`` (a Tensor, tuple, list or dict).
    ``kind``: what counts as a tensor (the planner asks with ``paddle.pir.Value`` while tracing)."""
    if isinstance(value, kind):
        return fn(value)
    if isinstance(value, dict):
        key = next((k for k, v in value.items() if isinstance(v, kind)), None)
        return value if key is None else {**value, key: fn(value[key])}
    index = _first_tensor_index(value, kind)
    if index is None:
        return value
    items = list(value)
    items[index] = fn(items[index])
    return type(value)(items)


def map_first_input(args: tuple, kwargs: dict, fn: Callable) -> tuple[tuple, dict]:
    """Apply ``fn`` to a layer's first Tensor input: the first positional one, else the first
    keyword one. Returns ``(args, kwargs)``."""
    if _first_tensor_index(args) is not None:
        return map_first(args, fn), kwargs
    return args, map_first(kwargs, fn)


def first_input(args: tuple, kwargs: dict, kind: type = paddle.Tensor) -> Any:
    """A layer's first Tensor input, the one :func:`map_first_input` maps (a pipeline stage's
    received activation replaces it), or None.

    >>> x, mask = paddle.ones([1]), paddle.zeros([1])
    >>> first_input((None,), {"mask": mask, "x": x}) is mask
    True
    """
    return first_tensor(args, kind) if _first_tensor_index(args, kind) is not None else first_tensor(kwargs, kind)


def first_tensor(value: Any, kind: type = paddle.Tensor) -> Any:
    """The first top-level Tensor of a layer's output (a Tensor, tuple, list or dict), or None."""
    found: list[Any] = []

    def keep(tensor: Any) -> Any:
        found.append(tensor)
        return tensor

    map_first(value, keep, kind)
    return found[0] if found else None


def _first_tensor_index(value: Any, kind: type = paddle.Tensor) -> int | None:
    if isinstance(value, (tuple, list)):
        return next((i for i, v in enumerate(value) if isinstance(v, kind)), None)
    return None
