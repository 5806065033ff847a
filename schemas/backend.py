"""A plan refused for the collectives its backend lacks, in one set of words: ``apply_plan`` for
the running backend (applier/placement/backend.py) and ``check`` for the plan's own device. What a strategy
needs and what Paddle 3.3.1's backends lack is schemas/parallel_dims.py's; this adds what a plan's
reshard hooks may need, for hooks edited by hand.
"""

from __future__ import annotations

from collections.abc import Mapping

from autodist.schemas.parallel_dims import OPERATIONS, needs_missing
from autodist.schemas.plan import BackendOperation, Hook, Reshard, Strategy


def hook_needs(strategy: Strategy, axes: list[str], hooks: list[Hook]) -> list[tuple[str, str, BackendOperation]]:
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
    needs: list[tuple[str, str, BackendOperation]] = []
    for i, hook in enumerate(hooks):
        if isinstance(hook, Reshard) and any(
            p.startswith("S") and not (axis == "dp" and p == "S(0)") for axis, p in zip(axes, hook.placements)
        ):
            what = f"a reshard of {hook.layer}'s {'input' if hook.when == 'pre' else 'output'} to {hook.placements}"
            needs += [(f"$.hooks[{i}]", what, "reduce_scatter"), (f"$.hooks[{i}]", what, "all_to_all")]
    return needs


def refusals(
    strategy: Strategy, axes: list[str], hooks: list[Hook], missing: Mapping[BackendOperation, str], who: str, fix: str
) -> list[str]:
    """One line per operation in ``missing`` (operation: what happens instead, or '') that the
    strategy needs, and one per hook that may need one: the refusal ``apply_plan`` gives for the
    running backend and ``check`` for the plan's own device, in the same words.

    >>> refusals(Strategy(dp=2, sharding_stage=2), ["dp"], [], {"reduce_scatter": "it throws"}, "the gloo backend", "re-plan")
    ['$.strategy: ZeRO stage 2 needs reduce-scatter, which the gloo backend lacks (it throws); re-plan']
    """
    features: dict[BackendOperation, list[str]] = {}
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
