"""What a plan needs from the collectives backend, and what Paddle 3.3.1's backends lack.

The one owner of both facts: the planner leaves out strategies a device's backend cannot run
(``[device].unsupported``, planner/cost/hardware.py) and ``apply_plan`` refuses a plan the
running backend cannot run, before touching the model (applier/backend.py), with the same
words. What gloo lacks is measured on the CPU wheel (docs/paddle-notes.md, "Collectives on the
CPU wheel"); what runs on gloo is not listed: expert parallelism's all-gather dispatch, the
all-reduces and all-gathers of dp and mp, and plain send/recv.

    >>> from autodist.schemas.plan import Strategy
    >>> strategy_needs(Strategy(dp=2, sharding_stage=2))
    [('ZeRO stage 2', 'reduce_scatter')]
    >>> strategy_needs(Strategy(pp=2, schedule="sequential"))
    [('the sequential schedule (its stage hand-offs)', 'cross_mesh_reshard')]
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

from autodist.schemas.plan import Hook, Reshard, Strategy

#: The operations a backend may lack, in words.
OPERATIONS = {
    "reduce_scatter": "reduce-scatter",
    "all_to_all": "all-to-all",
    "cross_mesh_reshard": "a reshard between two meshes",
    "batched_p2p": "batched P2P (batch_isend_irecv)",
}

#: What each backend of Paddle 3.3.1 lacks, and what happens when it is asked anyway.
LACKS = {
    "gloo": {
        "reduce_scatter": "its CPU kernel throws Unimplemented",
        "all_to_all": "its CPU kernel throws Unimplemented",
        "cross_mesh_reshard": "it segfaults in SameStatusReshardFunction",
        "batched_p2p": "it times out (gloo TIMEOUT)",
    },
}


def strategy_needs(strategy: Strategy) -> list[tuple[str, str]]:
    """``[(plan feature, operation)]``: what the strategy asks of the backend beyond all-reduce,
    all-gather and plain send/recv, which every backend has."""
    needs = []
    if strategy.sequence_parallel and strategy.mp > 1:
        needs += [("sequence parallelism", "reduce_scatter"), ("sequence parallelism", "all_to_all")]
    if strategy.sharding_stage and strategy.dp > 1:
        needs.append((f"ZeRO stage {strategy.sharding_stage}", "reduce_scatter"))
    if strategy.pp > 1 and strategy.schedule == "sequential":
        needs.append(("the sequential schedule (its stage hand-offs)", "cross_mesh_reshard"))
    if strategy.pp > 1 and strategy.schedule in ("1F1B", "VPP"):
        needs.append((f"the {strategy.schedule} schedule", "batched_p2p"))
    return needs


def needs_missing(strategy: Strategy, missing: Collection[str]) -> list[tuple[str, str]]:
    """The ``(plan feature, operation)`` pairs of :func:`strategy_needs` whose operation is in
    ``missing`` (what a backend lacks): the one filter the planner's ``[device].unsupported`` and
    ``apply_plan``'s backend refusal both apply.

    >>> needs_missing(Strategy(dp=2, sharding_stage=2, pp=2, schedule="1F1B"), {"batched_p2p"})
    [('the 1F1B schedule', 'batched_p2p')]
    >>> needs_missing(Strategy(dp=2, sharding_stage=2), ())
    []
    """
    return [(feature, operation) for feature, operation in strategy_needs(strategy) if operation in missing]


def hook_needs(strategy: Strategy, axes: list[str], hooks: list[Hook]) -> list[tuple[str, str, str]]:
    """``[(JSON path, plan feature, operation)]``: what a plan's reshard ``hooks`` (on a mesh of
    ``axes``) may ask of the backend beyond what its ``strategy`` does. A reshard to a split on
    any mesh axis but the batch's (``S(0)`` on ``dp``) needs reduce-scatter where its tensor
    holds a partial sum (a row projection's output) and all-to-all where it is split along
    another dim; which one, only the run knows, so both are needed. The planner writes such
    hooks only under sequence parallelism, whose strategy needs both anyway: this catches hooks
    edited by hand.

    >>> hook = Reshard(layer="l.0.proj", when="post", placements=["S(0)", "S(1)"])
    >>> hook_needs(Strategy(dp=2, mp=2), ["dp", "mp"], [hook])  # doctest: +NORMALIZE_WHITESPACE
    [('$.hooks[0]', "a reshard of l.0.proj's output to ['S(0)', 'S(1)']", 'reduce_scatter'),
     ('$.hooks[0]', "a reshard of l.0.proj's output to ['S(0)', 'S(1)']", 'all_to_all')]
    >>> hook_needs(Strategy(dp=2, mp=2), ["dp", "mp"], [Reshard(layer="l.0.qkv", when="post", placements=["S(0)", "R"])])
    []
    """
    if strategy.sequence_parallel and strategy.mp > 1:
        return []
    needs = []
    for i, hook in enumerate(hooks):
        if isinstance(hook, Reshard) and any(
            p.startswith("S") and not (axis == "dp" and p == "S(0)") for axis, p in zip(axes, hook.placements)
        ):
            what = f"a reshard of {hook.layer}'s {'input' if hook.when == 'pre' else 'output'} to {hook.placements}"
            needs += [(f"$.hooks[{i}]", what, "reduce_scatter"), (f"$.hooks[{i}]", what, "all_to_all")]
    return needs


def refusals(
    strategy: Strategy, axes: list[str], hooks: list[Hook], missing: Mapping[str, str], who: str, fix: str
) -> list[str]:
    """One line per operation in ``missing`` (operation: what happens instead, or '') that the
    strategy needs, and one per hook that may need one: the refusal ``apply_plan`` gives for the
    running backend and ``check`` for the plan's own device, in the same words.

    >>> refusals(Strategy(dp=2, sharding_stage=2), ["dp"], [], {"reduce_scatter": "it throws"}, "the gloo backend", "re-plan")
    ['$.strategy: ZeRO stage 2 needs reduce-scatter, which the gloo backend lacks (it throws); re-plan']
    """
    features: dict[str, list[str]] = {}
    for feature, operation in needs_missing(strategy, missing):
        features.setdefault(operation, []).append(feature)
    lines = [
        f"$.strategy: {' and '.join(dict.fromkeys(names))} needs {OPERATIONS[operation]}, which {who} lacks"
        f"{f' ({missing[operation]})' if missing[operation] else ''}; {fix}"
        for operation, names in features.items()
    ]
    per_hook: dict[tuple[str, str], list[str]] = {}
    for path, feature, operation in hook_needs(strategy, axes, hooks):
        if operation in missing:
            per_hook.setdefault((path, feature), []).append(OPERATIONS[operation])
    lines += [
        f"{path}: {feature} needs {' or '.join(operations)}, which {who} lacks: the planner writes no such hook "
        "without sequence parallelism; re-plan, or run where the backend has them"
        for (path, feature), operations in per_hook.items()
    ]
    return lines
