"""What a plan needs from the collectives backend, and what Paddle 3.3.1's backends lack.

The one owner of both facts: the planner leaves out strategies a device's backend cannot run
(``[device].unsupported``, planner/cost/hardware.py) and ``apply_plan`` refuses a plan the
running backend cannot run, before touching the model (applier/backend.py), with the same
words. What gloo lacks is measured on the CPU wheel (docs/paddle-notes.md, "Collectives on the
CPU wheel"); what runs on gloo is not listed: expert parallelism's all-gather dispatch, the
all-reduces and all-gathers of dp and mp, and plain send/recv.

    >>> from collections.abc import Collection

from autodist.schemas.plan import Strategy
    >>> strategy_needs(Strategy(dp=2, sharding_stage=2))
    [('ZeRO stage 2', 'reduce_scatter')]
    >>> strategy_needs(Strategy(pp=2, schedule="sequential"))
    [('the sequential schedule (its stage hand-offs)', 'cross_mesh_reshard')]
"""

from __future__ import annotations

from collections.abc import Collection

from autodist.schemas.plan import Strategy

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
