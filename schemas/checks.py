"""Rules that tie several fields of a plan together, which the types alone cannot express.

Each rule returns readable problems (``"$.path: what is wrong"``); :func:`check_plan`
collects all of them so one error lists everything at once.
"""

from __future__ import annotations

import math

from autodist.schemas.parallel_dims import combination_problems, expert_limit
from autodist.schemas.plan import ExpertCombine, ExpertDispatch, Plan, Reshard, StageHandoff
from autodist.schemas.vocabulary import MESH_AXES, shard_dim  # noqa: F401 (shard_dim re-exported)


def check_mesh(plan: Plan) -> list[str]:
    mesh, strategy, cluster = plan.mesh, plan.strategy, plan.cluster
    problems = []
    if len(mesh.axes) != len(mesh.shape):
        problems.append(f"$.mesh: {len(mesh.axes)} axes for {len(mesh.shape)} sizes in shape")
    if not mesh.axes:
        problems.append("$.mesh.axes: a mesh needs at least one axis")
    order = [a for a in MESH_AXES if a in mesh.axes]
    if list(mesh.axes) != order:
        problems.append(f"$.mesh.axes: {mesh.axes} must be unique and ordered pp, dp, mp")
    size = math.prod(mesh.shape)
    if size != len(mesh.process_ids):
        shape = " x ".join(map(str, mesh.shape))
        problems.append(f"$.mesh.shape: {shape} = {size} ranks but {len(mesh.process_ids)} process ids")
    if sorted(mesh.process_ids) != list(range(len(mesh.process_ids))):
        problems.append("$.mesh.process_ids: must be 0 .. N-1, each once")
    world = cluster.nodes * cluster.devices_per_node
    if size != world:
        problems.append(
            f"$.mesh: {size} ranks but the cluster has {cluster.nodes} x {cluster.devices_per_node} = {world} devices"
        )
    sizes: dict[str, int] = dict(zip(mesh.axes, mesh.shape))
    for axis in MESH_AXES:
        degree = getattr(strategy, axis)
        if sizes.get(axis, 1) != degree:
            problems.append(f"$.strategy.{axis}: {degree} but the mesh's {axis} axis has size {sizes.get(axis, 1)}")
    if strategy.ep > 1:
        counts = {b.num_experts for b in plan.blocks if b.experts}
        if not counts:
            problems.append(f"$.strategy.ep: {strategy.ep} but no block has experts")
        problems += [
            f"$.strategy.ep: {strategy.ep} does not divide the {n} experts of a block"
            for n in sorted(counts)
            if n % strategy.ep
        ]
    if strategy.pp == 1 and strategy.schedule != "none":
        problems.append(f"$.strategy.schedule: {strategy.schedule!r} needs pp > 1")
    if strategy.pp > 1 and strategy.schedule == "none":
        problems.append("$.strategy.schedule: pp > 1 needs a schedule (sequential, 1F1B or VPP)")
    return problems


def check_params(plan: Plan) -> list[str]:
    mesh_axes = plan.mesh.axes
    sizes = dict(zip(mesh_axes, plan.mesh.shape))
    problems = []
    for fqn in sorted(plan.params):
        param = plan.params[fqn]
        where = f'$.params["{fqn}"]'
        if param.stage >= plan.strategy.pp:
            problems.append(f"{where}.stage: {param.stage} but pp is {plan.strategy.pp}")
        for alias, stage in sorted(param.tied_stages.items()):
            if alias not in param.tied_to and alias != fqn:
                problems.append(f'{where}.tied_stages: "{alias}" is neither one of its tied_to names nor its own')
            if stage >= plan.strategy.pp or stage == param.stage:
                problems.append(
                    f'{where}.tied_stages["{alias}"]: {stage} must be another stage below pp={plan.strategy.pp}'
                )
        if len(param.placements) != len(mesh_axes):
            problems.append(
                f"{where}.placements: {len(param.placements)} placements for a mesh of {len(mesh_axes)} axes {mesh_axes}"
            )
            continue
        for i, (axis, placement) in enumerate(zip(mesh_axes, param.placements)):
            if placement == "P":
                problems.append(f"{where}.placements[{i}]: a parameter cannot be partial")
            split = shard_dim(placement)
            if split is None:
                continue
            if axis == "pp":
                problems.append(f"{where}.placements[{i}]: parameters are not split over pp (use stage)")
            elif split >= len(param.shape):
                problems.append(f"{where}.placements[{i}]: {placement} but the parameter has {len(param.shape)} dims")
            elif axis in sizes and param.shape[split] % sizes[axis]:  # (an axis without a size is reported above)
                problems.append(
                    f"{where}.placements[{i}]: {placement} splits size {param.shape[split]} over {axis}={sizes[axis]} unevenly"
                )
    return problems


def check_stages_and_hooks(plan: Plan) -> list[str]:
    pp, naxes = plan.strategy.pp, len(plan.mesh.axes)
    problems = []
    for i, block in enumerate(plan.blocks):
        if block.stage >= pp:
            problems.append(f"$.blocks[{i}].stage: {block.stage} but pp is {pp}")
    for i, hook in enumerate(plan.hooks):
        if isinstance(hook, StageHandoff) and hook.to_stage >= pp:
            problems.append(f"$.hooks[{i}].to_stage: {hook.to_stage} but pp is {pp}")
        if isinstance(hook, Reshard) and len(hook.placements) != naxes:
            problems.append(f"$.hooks[{i}].placements: {len(hook.placements)} placements for a mesh of {naxes} axes")
    for name in ("input_stage", "label_stage"):
        if getattr(plan.data, name) >= pp:
            problems.append(f"$.data.{name}: {getattr(plan.data, name)} but pp is {pp}")
    for axis in plan.data.shard_axes:
        if axis not in plan.mesh.axes:
            problems.append(f"$.data.shard_axes: {axis!r} is not a mesh axis {plan.mesh.axes}")
    batch, divisor = plan.data.global_batch_size, plan.strategy.dp * plan.strategy.micro_batches
    if batch and batch % divisor:
        problems.append(
            f"$.data.global_batch_size: {batch} does not divide over dp={plan.strategy.dp} x "
            f"{plan.strategy.micro_batches} micro-batches"
        )
    return problems


def check_stage_agreement(plan: Plan) -> list[str]:
    """``blocks[].stage``, ``params[].stage`` and the ``stage_handoff`` hooks tell one story:
    a block's parameters live on its stage, and a hand-off follows only a block whose next block
    runs on another stage, to that stage (under the ``sequential`` schedule, which moves
    activations by these hooks alone, every such block has one)."""
    problems = []
    for block in plan.blocks:
        prefix = block.layer + "."
        for fqn, param in plan.params.items():
            if fqn.startswith(prefix) and param.stage != block.stage:
                problems.append(
                    f'$.params["{fqn}"].stage: {param.stage} but its block {block.layer} is on stage {block.stage}'
                )
    expected = {(a.layer, b.stage) for a, b in zip(plan.blocks, plan.blocks[1:]) if a.stage != b.stage}
    handoffs = [(i, (h.layer, h.to_stage)) for i, h in enumerate(plan.hooks) if isinstance(h, StageHandoff)]
    for i, (layer, to_stage) in handoffs:
        if (layer, to_stage) not in expected:
            problems.append(
                f"$.hooks[{i}]: a stage_handoff after {layer} to stage {to_stage}, but the blocks do not "
                "change stage there"
            )
    missing = expected - {handoff for _, handoff in handoffs} if plan.strategy.schedule == "sequential" else set()
    for layer, to_stage in sorted(missing):
        problems.append(f"$.hooks: no stage_handoff after {layer}, whose next block runs on stage {to_stage}")
    return problems


def check_combination(plan: Plan) -> list[str]:
    """Strategies no runtime builds (:func:`~autodist.schemas.parallel_dims.combination_problems`):
    ``check_plan``'s and ``apply_plan``'s refusal of a plan built in Python or edited by hand."""
    tied = any(p.tied_stages for p in plan.params.values())
    moe = any(b.experts for b in plan.blocks)
    return [f"$.strategy: {p}" for p in combination_problems(plan.strategy, moe=moe, tied=tied)]


def check_plan(plan: Plan) -> list[str]:
    """Every cross-field problem of ``plan``; empty when it is consistent."""
    return (
        check_mesh(plan)
        + check_combination(plan)
        + check_params(plan)
        + check_stages_and_hooks(plan)
        + check_stage_agreement(plan)
        + check_recompute(plan)
        + check_experts(plan)
    )


def check_experts(plan: Plan) -> list[str]:
    """Expert parallelism is one story: with ``ep > 1`` every block's experts have an
    ``expert_dispatch`` (pre) and an ``expert_combine`` (post) on the MoE layer holding them,
    and everything under that layer is whole on each rank (the layer runs on each rank's
    gathered tokens). At ep 1 the pair may still be there (the MoE layers then run on each
    rank's own tokens, under plain data parallelism, or whole on every rank under mp alone, when
    their code holds an op Paddle runs on plain tensors only: ``runs_moe_locally``'s
    ``local_only``); ``ExpertParallel`` parameters only under
    an ``expert_dispatch``. With dp > 1 a model with experts needs the pair even at ep 1: its MoE
    layers run on each rank's own tokens (Paddle 3.3 routes tokens split over dp wrongly, see
    docs/recognition.md, "Experts"), so a plan that leaves them to run as DistTensors there (with
    ZeRO, a pipeline or sequence parallelism, which apply_plan does not run around the hooks) is
    refused; so is sequence parallelism for a model with experts at any dp (it splits the MoE
    layers' tokens over mp). The strategy's part is :func:`~autodist.schemas.parallel_dims.expert_limit`,
    the rule the planner's search and the applier use."""
    ep, problems = plan.strategy.ep, []
    dispatch = {h.layer: (i, h) for i, h in enumerate(plan.hooks) if isinstance(h, ExpertDispatch)}
    combine = {h.layer: i for i, h in enumerate(plan.hooks) if isinstance(h, ExpertCombine)}
    for i, hook in enumerate(plan.hooks):
        if isinstance(hook, (ExpertDispatch, ExpertCombine)):
            wanted = "pre" if isinstance(hook, ExpertDispatch) else "post"
            if hook.when != wanted:
                problems.append(f"$.hooks[{i}].when: an {hook.action} hook runs {wanted!r}, not {hook.when!r}")
    for layer, (i, hook) in sorted(dispatch.items()):
        if not hook.experts.startswith(layer + "." if layer else ""):
            problems.append(f"$.hooks[{i}].experts: {hook.experts!r} is not inside its layer {layer!r}")
        if layer not in combine:
            problems.append(f"$.hooks[{i}]: an expert_dispatch on {layer!r} without an expert_combine on it")
        for j, shared in enumerate(hook.shared):
            if not shared.startswith(layer + ".") or shared.startswith(hook.experts + "."):
                problems.append(f"$.hooks[{i}].shared[{j}]: {shared!r} is not inside {layer!r} beside its experts")
    for layer, i in sorted(combine.items()):
        if layer not in dispatch:
            problems.append(f"$.hooks[{i}]: an expert_combine on {layer!r} without an expert_dispatch on it")
    limit = expert_limit(plan.strategy, moe=any(b.experts for b in plan.blocks), hooks=bool(dispatch))
    if limit:
        problems.append(f"$.strategy: {limit}")
    spread_over = (
        f"$.strategy.ep is {ep}"
        if ep > 1
        else f"$.strategy.dp is {plan.strategy.dp} (under data parallelism the MoE layers run on each rank's own tokens)"
    )
    if ep > 1 or plan.strategy.dp > 1:
        dispatched = {hook.experts for _, hook in dispatch.values()}
        problems += [
            f"$.blocks[{i}].experts: {b.experts!r} has no expert_dispatch hook, but {spread_over}"
            for i, b in enumerate(plan.blocks)
            if b.experts and b.experts not in dispatched
        ]
    inside = tuple(layer + "." for layer in dispatch)
    for fqn in sorted(plan.params):
        param = plan.params[fqn]
        where = f'$.params["{fqn}"]'
        if param.style == "ExpertParallel" and not any(fqn.startswith(h.experts + ".") for _, h in dispatch.values()):
            problems.append(f"{where}.style: ExpertParallel, but no expert_dispatch hook holds it")
        if fqn.startswith(inside) and set(param.placements) != {"R"}:
            problems.append(
                f"{where}.placements: {param.placements}, but an MoE layer under expert parallelism "
                "runs whole on each rank (all R)"
            )
    return problems


def check_recompute(plan: Plan) -> list[str]:
    """Layers to recompute only when the strategy recomputes, each listed once."""
    problems = []
    if plan.strategy.recompute == "none" and plan.recompute:
        problems.append(f"$.recompute: {len(plan.recompute)} layers listed but $.strategy.recompute is 'none'")
    if len(set(plan.recompute)) != len(plan.recompute):
        problems.append("$.recompute: a layer is listed twice")
    return problems
