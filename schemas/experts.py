"""Which strategies run a model's MoE layers, and how: the one owner of this rule.

The planner's search refuses with it and step time prices with it, ``emit`` writes the expert
hooks when :func:`runs_moe_locally` says so, :func:`autodist.schemas.checks.check_plan` and the
applier (``applier/experts.py``) refuse a plan against it.

Under expert parallelism (``ep > 1``), and for a model with experts under any data parallelism
(``dp > 1``), the MoE layers run whole, on plain local tensors, between an ``expert_dispatch``
and an ``expert_combine`` hook. For dp this is for correctness: Paddle 3.3 answers an
integer-tensor index into a DistTensor split on another dim with the wrong rows, silently, and MoE
routing indexes the dp-split tokens that way (Hugging Face's Qwen3-MoE ``expert_mask[expert_idx]``
trained off the single-device losses at dp2 and at dp2 x mp2: docs/paddle-notes.md, "SPMD
rules"). apply_plan runs those hooks only with pp 1, ZeRO stage 0 and no sequence parallelism.
Sequence parallelism is out for a model with experts at any dp: it hands the MoE layers their
tokens split over mp, and Paddle 3.3 routes split tokens wrongly (HF Qwen3-MoE's MoE layer
answered up to 4.3 away on 2 ranks). Any mp goes: the MoE layers run whole on every mp rank, the
rest of the block split as usual.

Example::

    >>> from autodist.schemas.plan import Strategy
    >>> runs_moe_locally(Strategy(dp=2, mp=2)), runs_moe_locally(Strategy(dp=2, sharding_stage=1))
    (True, False)
    >>> expert_limit(Strategy(dp=2, pp=2, ep=2), options=True)
    '--ep 2 with --pp 2: expert parallelism inside a pipeline is not built'
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from autodist.schemas.plan import Strategy


def runs_moe_locally(strategy: Strategy) -> bool:
    """Whether the MoE layers run whole, on plain local tensors, between an ``expert_dispatch``
    and an ``expert_combine`` (the plan's hooks): under expert parallelism, and under any data
    parallelism without it too (ep 1: every rank its own tokens, nothing gathered), not with pp,
    ZeRO or sequence parallelism (then a model with experts gets dp > 1 only without them:
    :func:`expert_limit`).

    >>> from autodist.schemas.plan import Strategy
    >>> [runs_moe_locally(Strategy(**s)) for s in ({"dp": 2, "mp": 2}, {"mp": 2}, {"dp": 2, "sharding_stage": 1})]
    [True, False, False]
    """
    data_parallel = strategy.dp > 1 and strategy.pp == 1 and not strategy.sharding_stage
    return strategy.ep > 1 or (data_parallel and not strategy.sequence_parallel)


def expert_limit(strategy: Strategy, options: bool = False, moe: bool = False, hooks: bool = False) -> str:
    """Why ``strategy`` cannot run the MoE layers as apply_plan runs them, or ''. ``moe``: the
    model has experts; ``hooks``: the plan has expert hooks (its MoE layers run locally even at
    dp 1). ``options``: name the settings as the command's options (``--pp 2``), else as a
    strategy's fields (``pp=2``).

    >>> from autodist.schemas.plan import Strategy
    >>> expert_limit(Strategy(dp=2, mp=2, ep=2))
    ''
    >>> print(expert_limit(Strategy(dp=2, sharding_stage=1), moe=True))  # doctest: +NORMALIZE_WHITESPACE
    dp=2 with sharding_stage=1: data parallelism of an MoE model is not built with ZeRO over the dp
    group (its MoE layers run on each rank's own tokens)
    >>> expert_limit(Strategy(dp=2, sharding_stage=1))  # a model without experts
    ''
    >>> print(expert_limit(Strategy(mp=2, sequence_parallel=True), moe=True))  # doctest: +NORMALIZE_WHITESPACE
    sequence parallelism of an MoE model is not built (its MoE layers would route tokens split over
    mp, which Paddle 3.3 indexes wrongly)
    >>> expert_limit(Strategy(pp=2), moe=True, hooks=True)
    'ep=1 with pp=2: expert parallelism inside a pipeline is not built'
    """
    ep, dp, pp, stage = strategy.ep, strategy.dp, strategy.pp, strategy.sharding_stage
    settings = (  # (clashes, as an option, as a field, why under ep, what under dp)
        (pp > 1, f"--pp {pp}", f"pp={pp}", "expert parallelism inside a pipeline is not built", "inside a pipeline"),
        (
            stage > 0,
            f"--sharding-stage {stage}",
            f"sharding_stage={stage}",
            "ZeRO over the dp group with expert parallelism is not built (an expert's gradients are summed over "
            "other ranks than the rest)",
            "with ZeRO over the dp group",
        ),
        (
            strategy.sequence_parallel,
            "--sequence-parallel",
            "sequence parallelism",
            "sequence parallelism with expert parallelism is not built",
            "with sequence parallelism",
        ),
    )
    degree = "--{} {}" if options else "{}={}"
    if moe and strategy.sequence_parallel and ep == 1 and dp == 1:
        setting = "--sequence-parallel" if options else "sequence parallelism"
        return (
            f"{setting} of an MoE model is not built (its MoE layers would route tokens split over mp, which "
            "Paddle 3.3 indexes wrongly)"
        )
    for clash, option, name, why, what in settings:
        setting = option if options else name
        if clash and ep > 1:
            return f"{degree.format('ep', ep)} with {setting}: {why}"
        if clash and moe and dp > 1:
            return (
                f"{degree.format('dp', dp)} with {setting}: data parallelism of an MoE model is not built {what} "
                "(its MoE layers run on each rank's own tokens)"
            )
        if clash and hooks:
            return f"{degree.format('ep', ep)} with {setting}: {why}"
    return ""


def ep_index(dp_coordinate: int, ep: int) -> int:
    """The index in its ep group of the rank at ``dp_coordinate`` along the dp axis, which says
    which experts it holds (:func:`held_experts`): an ep group is ``ep`` neighbouring dp ranks
    (coordinates ``k*ep .. k*ep + ep - 1``), so the index is the coordinate mod ep.

    >>> [ep_index(d, ep=2) for d in range(4)]
    [0, 1, 0, 1]
    """
    return dp_coordinate % ep


def held_experts(count: int, ep: int, index: int) -> range:
    """The experts (numbers under the container) the rank at ``index`` (:func:`ep_index`) of its ep group holds:
    the index-th of ``ep`` equal runs (the applier drops the others; ``show`` says which).

    >>> held_experts(8, ep=2, index=1)
    range(4, 8)
    """
    per = count // ep
    return range(index * per, (index + 1) * per)
