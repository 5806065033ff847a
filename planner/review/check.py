"""Is a checked-in plan still valid for the model as it is now? For CI and pre-commit hooks.

The checks, cheapest first: every planned parameter exists with the planned shape and dtype
and no parameter is unplanned (the applier's own fingerprint); the parameter fingerprint; the model-side checks
``apply_plan`` runs itself (tied parameters, hook sites: ``structure_problems``; a local view's
weights and attributes; a vocabulary lookup's nn.Embedding), each local view proven again by
running it (planner/local_view_proof.py); and, unless told not to trace, the structure of the traced
forward (``graph_fingerprint``), which catches a changed forward even when no parameter changed,
and for a pipeline plan whether its stages cut where the blocks chain (:func:`cut_reasons`).
The model is traced with the plan's own input specs, so only a change of the model makes a plan
stale.

Example::

    >>> from autodist.schemas import load_plan
    >>> check_plan_for_target(load_plan("plan.json"), "model.py")     # doctest: +SKIP
    []
"""

from __future__ import annotations

from autodist.schemas import Plan, parameter_diff, parameter_fingerprint, parameter_table
from autodist.schemas.plan import BackendOperation
from autodist.schemas.backend import refusals

from autodist.planner.progress import Progress
from autodist.planner.review.format import collapse

#: How many collapsed rows of one kind of parameter problem are listed before "... and N more".
MAX_ROWS = 10


def plan_input_specs(plan: Plan) -> list[str]:
    """The plan's input specs as ``--input-spec`` strings: ``["input_ids:int64:4x16"]``."""
    return [f"{s.name}:{s.dtype}:{'x'.join(map(str, s.shape))}" for s in plan.model.input_specs]


def check_plan_for_target(plan: Plan, target: str, trace: bool = True, progress: Progress | None = None) -> list[str]:
    """The reasons ``plan`` is stale for the model ``target`` builds; empty when it is valid.

    Raises the planner's ``PlannerError`` when the target cannot be loaded or traced.
    """
    from autodist.applier.placement.validate import structure_problems
    from autodist.planner import driver

    progress = progress or Progress(quiet=True)
    loaded = driver.load(target, plan_input_specs(plan), progress)
    table = parameter_table(loaded.model.named_parameters())
    reasons = parameter_reasons(plan, table)
    if parameter_fingerprint(table) != plan.model.param_fingerprint and not reasons:
        reasons.append(
            "the parameter fingerprint differs from the plan's (the plan was edited or made by another version)"
        )
    reasons += structure_problems(loaded.model, plan)  # what apply_plan refuses for this model, the same way
    reasons += device_reasons(plan)
    if plan.vocab_lookup:
        from autodist.applier.modes.vocab_lookup import vocab_lookup_problems

        reasons += vocab_lookup_problems(loaded.model, plan)
    if (
        plan.local_view and not reasons
    ):  # the views' weights and attributes as apply_plan checks them, then proven again
        from autodist.applier.modes.local_calls import local_view_problems
        from autodist.planner.local_view_proof import reverify

        reasons += local_view_problems(loaded.model, plan) or reverify(plan, loaded.model)
    if trace:
        reasons += graph_reasons(plan, loaded, progress)
    return reasons


def device_reasons(plan: Plan) -> list[str]:
    """What the plan's own device cannot run (its profile's ``unsupported``: gloo's gaps for
    ``cpu``), in apply_plan's words (:func:`~autodist.schemas.backend.refusals`): a strategy or a
    hook edited by hand after planning.

    >>> from autodist.schemas import load_plan
    >>> device_reasons(load_plan("plans/gpt/plan_2x8dev_mp4.json"))     # an H100 plan: its backend has everything
    []
    """
    device = plan.cluster.device
    missing: dict[BackendOperation, str] = dict.fromkeys(device.unsupported, "")
    return refusals(plan.strategy, list(plan.mesh.axes), plan.hooks, missing, f"{device.name}'s backend", "re-plan")


def parameter_reasons(plan: Plan, table: dict[str, tuple[list[int], str]]) -> list[str]:
    """The parameter diff (:func:`~autodist.schemas.parameter_diff`, the one ``apply_plan``
    reports too) collapsed into patterns."""
    planned = {fqn: (p.shape, p.dtype) for fqn, p in plan.params.items()}
    diff = parameter_diff(planned, table, tied={t for p in plan.params.values() for t in p.tied_to})
    universe = set(planned) | set(table)
    changed = {fqn for fqn, _, _ in diff.resized} | {fqn for fqn, _, _ in diff.retyped}
    reasons = _rows(
        f"{len(diff.removed)} planned parameter(s) no longer in the model",
        dict.fromkeys(diff.removed, 0),
        lambda v: "",
        universe,
    )
    reasons += _rows(
        f"{len(diff.added)} parameter(s) of the model not in the plan",
        dict.fromkeys(diff.added, 0),
        lambda v: "",
        universe,
    )
    reasons += _rows(
        f"{len(diff.renamed)} planned parameter(s) renamed? (same shape and dtype)",
        dict(diff.renamed),
        lambda v: f" -> {v}",
        universe,
    )
    reasons += _rows(
        f"{len(changed)} parameter(s) changed shape or dtype",
        {fqn: (_describe(planned[fqn]), _describe(table[fqn])) for fqn in changed},
        lambda v: f": plan {v[0]}, model {v[1]}",
        universe,
    )
    return reasons


def graph_reasons(plan: Plan, loaded, progress: Progress | None = None) -> list[str]:
    """Trace the model as the planner does and compare the structure with the plan's."""
    from autodist.planner import driver
    from autodist.planner.graph import graph_fingerprint

    traced = driver.trace(loaded.model, loaded.input_specs, progress)
    reasons = []
    if traced.program.traced_layer != plan.model.traced_layer:
        reasons.append(
            f"the planner now traces {traced.program.traced_layer or 'the whole model'!r}, the plan traced "
            f"{plan.model.traced_layer or 'the whole model'!r}"
        )
    if graph_fingerprint(traced.graph) != plan.model.graph_fingerprint:
        reasons.append("the traced forward has a different structure (graph fingerprint differs): re-plan")
    return reasons + cut_reasons(plan, loaded.model, traced, progress)


def cut_reasons(plan: Plan, model, traced, progress: Progress | None = None) -> list[str]:
    """Where a pipeline plan's stages cut between blocks that do not chain as a stage needs
    (``recognise/chaining.py``: a stage edited by hand, or a plan made before the check).
    Recognises the blocks again, so only for a plan with ``pp > 1``."""
    from autodist.planner import driver
    from autodist.planner.recognise.chaining import cut_problem

    if plan.strategy.pp == 1:
        return []
    analysis = driver.analyse(model, traced, progress)
    if [b.layer for b in analysis.blocks] != [b.layer for b in plan.blocks]:
        return []  # another model than planned: the fingerprints say so
    problem = cut_problem(analysis.unchained, [b.stage for b in plan.blocks])
    return [f"$.blocks: {problem}"] if problem else []


def _describe(entry: tuple[list[int], str]) -> str:
    shape, dtype = entry
    return f"{'x'.join(map(str, shape))} {dtype}"


def _rows(title: str, values: dict, fmt, universe: set[str]) -> list[str]:
    if not values:
        return []
    rows = collapse(values, universe=universe)
    lines = [f"{title}: " + "; ".join(f"{row.pattern}{fmt(row.value)}" for row in rows[:MAX_ROWS])]
    if len(rows) > MAX_ROWS:
        lines[0] += f"; ... and {len(rows) - MAX_ROWS} more"
    return lines
