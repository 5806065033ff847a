"""Check a plan against the live model, optimizer and loader before anything is changed.

Every check only reads: no tensor is touched and nothing is communicated, so a bad plan fails
on every rank within moments instead of leaving some ranks blocked in a collective. All
problems are collected and raised as one :class:`~autodist.schemas.PlanError`.

Example::

    >>> problems = plan_problems(model, optimizer, loader, plan, world_size=4)   # doctest: +SKIP
    >>> problems[0]  # doctest: +SKIP
    "world size: the plan's mesh dp2 x mp2 needs 4 ranks but this job has 8 (PADDLE_TRAINERS_NUM); ..."
"""

from __future__ import annotations

from typing import Any, Callable

import paddle
import paddle.distributed as dist

from autodist.schemas import Plan, parameter_diff, parameter_fingerprint, parameter_table
from autodist.schemas.checks import check_combination
from autodist.schemas.fingerprint import ParameterDiff

from autodist.applier.placement.data import uneven_problem
from autodist.applier.modes.accumulate import accumulate_problems
from autodist.applier.modes.expert_dispatch import expert_problems, expert_structure_problems
from autodist.applier.placement.layout import rank_coords
from autodist.applier.modes.local_calls import local_view_problems
from autodist.applier.placement.mesh import mesh_ids
from autodist.applier.placement.optimizer import optimizer_problems
from autodist.applier.modes.pipeline import pipeline_problems
from autodist.applier.modes.recompute import recompute_problems
from autodist.applier.placement.shard import parameter_owners
from autodist.applier.modes.vocab_lookup import vocab_lookup_problems

#: How many names a message lists before it says "and N more".
_MAX_NAMES = 8


def plan_problems(
    model: paddle.nn.Layer,
    optimizer: Any,
    dataloader: Any,
    plan: Plan,
    *,
    world_size: int,
    loss_fn: Callable | None = None,
) -> list[str]:
    """Every reason ``plan`` cannot be applied to these objects on a job of ``world_size``
    ranks; empty when it can."""
    return (
        world_problems(plan, world_size)
        + expert_problems(plan)
        + parameter_problems(model, plan)
        + structure_problems(model, plan)
        + optimizer_problems(model, optimizer, plan)
        + accumulate_problems(optimizer, dataloader, plan)
        + data_problems(plan, dataloader)
        + pipeline_problems(model, plan, loss_fn)
        + local_view_problems(model, plan)
        + vocab_lookup_problems(model, plan)
    )


def world_problems(plan: Plan, world_size: int) -> list[str]:
    size = len(plan.mesh.process_ids)
    if size == world_size:
        return []
    mesh = " x ".join(f"{d}{n}" for d, n in zip(plan.mesh.axes, plan.mesh.shape))
    return [
        f"world size: the plan's mesh {mesh} needs {size} ranks but this job has {world_size} "
        f"(PADDLE_TRAINERS_NUM); launch {size} ranks or re-plan for {world_size} device(s)"
    ]


def parameter_problems(model: paddle.nn.Layer, plan: Plan) -> list[str]:
    """The model's parameters against the plan's: names, shapes, dtypes, fingerprint, ties."""
    inner = getattr(model, "_layers", None)  # paddle.DataParallel and fleet's wrappers keep the model here
    if isinstance(inner, paddle.nn.Layer) and type(inner).__name__ == plan.model.class_name:
        return [
            f"model: a {type(model).__name__} around the {plan.model.class_name} the plan was made for: pass the "
            f"{plan.model.class_name} itself (drop the fleet.distributed_model / paddle.DataParallel line: the plan "
            "runs the parallelism)"
        ]
    actual = parameter_table(model.named_parameters())
    tied = {t for p in plan.params.values() for t in p.tied_to}
    diff = parameter_diff({fqn: (p.shape, p.dtype) for fqn, p in plan.params.items()}, actual, tied)
    problems = _table_differences(diff)
    fingerprint = parameter_fingerprint(actual)
    if not problems and fingerprint != plan.model.param_fingerprint:
        problems.append(
            f"model: parameter fingerprint {fingerprint[:12]}... differs from the plan's "
            f"{plan.model.param_fingerprint[:12]}... although every planned parameter matches: "
            "the plan was edited by hand or made by another planner; re-plan this model"
        )
    if problems:
        made = (plan.model.class_name, len(plan.params), plan.provenance.arguments.get("target", ""))
        problems.insert(0, _not_this_model(made, type(model).__name__, diff))
    already = [fqn for fqn, p in model.named_parameters() if p.is_dist()]
    if already:
        problems.append(
            f"model: already distributed parameters {_names(already)}: apply a plan to the plain model, once"
        )
    return problems


def _not_this_model(made: tuple[str, int, str], class_name: str, diff: ParameterDiff) -> str:
    """The first line of a parameter mismatch: what differs, counted, and how to re-plan.
    ``made``: the plan's class name, number of planned parameters and target.

    >>> diff = ParameterDiff(removed=[], added=[], renamed=[], resized=[("w", [8], [4])], retyped=[])
    >>> print(_not_this_model(("TinyLM", 21, "model.py"), "TinyLM", diff))  # doctest: +NORMALIZE_WHITESPACE
    model: this is not the model the plan was made for: another TinyLM, its parameters differ from the 21
    planned (1 resized); re-plan this model: autodist-plan model.py ... (with its sizes), or autodist.plan(model, ...)
    """
    counted = [
        f"{len(items)} {word}"
        for items, word in (
            (diff.resized, "resized"),
            (diff.retyped, "of another dtype"),
            (diff.renamed, "renamed"),
            (diff.removed, "missing"),
            (diff.added, "added"),
        )
        if items
    ]
    planned, count, target = made
    which = f"a {class_name}, not a {planned}" if class_name != planned else f"another {class_name}"
    again = f"autodist-plan {target} ... (with its sizes), or " if target and not target.startswith("<") else ""
    what = ", ".join(counted) or "same names, shapes and dtypes, another fingerprint"
    return (
        f"model: this is not the model the plan was made for: {which}, its parameters differ from the {count} "
        f"planned ({what}); re-plan this model: {again}autodist.plan(model, ...)"
    )


def _table_differences(diff: ParameterDiff) -> list[str]:
    """The parameter diff (:func:`~autodist.schemas.parameter_diff`) name by name, as JSON paths."""
    problems = [
        f'$.params["{old}"]: not in the model; renamed to "{new}"? (same shape and dtype)' for old, new in diff.renamed
    ]
    if diff.removed:
        problems.append(f"parameters removed (planned, not in the model): {_names(diff.removed)}")
    if diff.added:
        problems.append(f"parameters added (in the model, not planned): {_names(diff.added)}")
    changes = [
        (fqn, f'$.params["{fqn}"].shape: planned {p} but the model has {a} (resized)') for fqn, p, a in diff.resized
    ]
    changes += [(fqn, f'$.params["{fqn}"].dtype: planned {p} but the model has {a}') for fqn, p, a in diff.retyped]
    return problems + [message for _, message in sorted(changes, key=lambda c: c[0])]


def structure_problems(model: paddle.nn.Layer, plan: Plan) -> list[str]:
    """What the model must have for ``plan`` whatever the job (no world, optimizer or loader):
    the planned ties, hook sites, the strategy's combination and recompute. ``autodist-plan check`` runs exactly these too, so a
    plan it calls valid is not refused here for its model."""
    return (
        tie_problems(model, plan)
        + hook_problems(model, plan)
        + check_combination(plan)
        + recompute_problems(model, plan)
        + expert_structure_problems(model, plan)
    )


def tie_problems(model: paddle.nn.Layer, plan: Plan) -> list[str]:
    """A plan that ties two names must meet a model where they are one Parameter object."""
    aliases_of = {}
    for slots in parameter_owners(model).values():
        for slot in slots:
            aliases_of[slot.fqn] = {s.fqn for s in slots}
    problems = []
    for fqn, param in sorted(plan.params.items()):
        for alias in param.tied_to:
            if alias not in aliases_of.get(fqn, ()):
                problems.append(
                    f'$.params["{fqn}"].tied_to: the plan ties it to "{alias}" but in the model they are '
                    "not the same Parameter"
                )
    return problems


def hook_problems(model: paddle.nn.Layer, plan: Plan) -> list[str]:
    layers = dict(model.named_sublayers())
    problems = []
    for i, hook in enumerate(plan.hooks):
        if hook.layer not in layers:
            problems.append(f'$.hooks[{i}].layer: no sub-layer "{hook.layer}" in the model ({hook.action} hook)')
        if hook.action.startswith("sequence_parallel") and "mp" not in plan.mesh.axes:
            problems.append(f"$.hooks[{i}]: {hook.action} needs an mp mesh axis, the mesh has {plan.mesh.axes}")
    return problems


def data_problems(plan: Plan, dataloader: Any) -> list[str]:
    if dataloader is None:
        return []
    axes = plan.data.shard_axes
    problems = []
    if len(axes) > 1:
        problems.append(f"$.data.shard_axes: {axes}: Paddle's shard_dataloader splits over one mesh axis only")
    if "pp" in axes:
        problems.append("$.data.shard_axes: the loader cannot be split over pp (stages share the batch)")
    if not isinstance(dataloader, paddle.io.DataLoader):
        problems.append(f"dataloader: a paddle.io.DataLoader is needed, got {type(dataloader).__name__}")
        return problems
    return problems + batch_problems(plan, dataloader)


def batch_problems(plan: Plan, dataloader: paddle.io.DataLoader) -> list[str]:
    """The loader's batch against the plan's: what it yields per optimizer step, over all ranks,
    must be the plan's global batch (when the plan records one) and divide over dp x
    micro-batches, and so must its last batch, unless dropped (data.uneven_problem). A
    ``DistributedBatchSampler`` is already split: its batch is per dp rank."""
    sampler = dataloader.batch_sampler
    size = getattr(sampler, "batch_size", None)
    if not size:
        return []  # an iterable dataset or a custom sampler: nothing to check before it runs
    dp, m = plan.strategy.dp, plan.strategy.micro_batches
    split = isinstance(sampler, paddle.io.DistributedBatchSampler)
    part = _dp_index(plan, dist.get_rank()) if split else 0
    if split and (sampler.nranks, sampler.local_rank) != (dp, part):
        return [
            f"dataloader: its DistributedBatchSampler gives this rank part {sampler.local_rank} of "
            f"{sampler.nranks}, but the plan reads each batch in dp={dp} parts (the ranks of one dp group, "
            f"this one's is part {part}, must read the same samples): use "
            f"paddle.io.BatchSampler(dataset, batch_size={plan.data.global_batch_size or size * sampler.nranks}) "
            "and apply_plan splits it"
        ]
    total = size * dp if split else size
    described = f"{size} per dp rank x dp={dp} = {total}" if split else f"{total}"
    planned = plan.data.global_batch_size
    if planned and total != planned:
        return [
            f"dataloader: yields batches of {described} samples per step but the plan was made for a global "
            f"batch of {planned} ($.data.global_batch_size); give the loader batch_size={planned} or re-plan "
            f"with --global-batch-size {total}"
        ]
    if total % (dp * m):
        return [f"dataloader: a batch of {described} samples does not divide over dp={dp} x {m} micro-batches"]
    if split or not hasattr(dataloader.dataset, "__len__"):
        return []  # split by the user's own sampler, or a length known only while it runs (checked then)
    problem = uneven_problem(
        len(dataloader.dataset),
        total,
        dp=dp,
        micro_batches=m,
        drop_last=sampler.drop_last,
        shuffle=getattr(sampler, "shuffle", False),
    )
    return [problem] if problem else []


def _dp_index(plan: Plan, rank: int) -> int:
    """``rank``'s coordinate on the plan's dp axis (0 without one, or outside the mesh)."""
    coords = rank_coords(mesh_ids(plan), rank)
    return coords[plan.mesh.axes.index("dp")] if coords is not None and "dp" in plan.mesh.axes else 0


def _names(names: list[str]) -> str:
    shown = ", ".join(f'"{n}"' for n in names[:_MAX_NAMES])
    return shown + (f" and {len(names) - _MAX_NAMES} more" if len(names) > _MAX_NAMES else "")
