"""Which parallelisms combine, for which models, on which backends and under which runtimes: the
one owner of those facts (torchtitan's ``ParallelDims``). The planner's search leaves out what it
refuses, ``check_plan`` and ``apply_plan`` refuse a plan against it, and ``export`` and the
PaddleFormers Trainer integration ask it what their runtime cannot run, each in the words written
here once.

- :func:`strategy_needs`: the collectives a strategy needs beyond all-reduce, all-gather and plain
  send/recv, named by :data:`OPERATIONS` (the names ``DeviceProfile.unsupported`` takes, in the
  device profiles too), and :data:`LACKS`, what Paddle 3.3.1's backends lack;
- :func:`runs_moe_locally` and :func:`expert_limit`: how a model with experts runs under a strategy;
- :func:`runs_local_views` and :func:`local_views_refused`: where sub-layers on local tensors and the
  vocabulary-parallel lookup run;
- :func:`combination_problems`: strategies no runtime builds (ep that does not divide dp, the
  sequential schedule's limits);
- :func:`runtime_refusals`: what ``dist.parallelize`` (``export``) and the Trainer's auto-parallel
  mode cannot run of a strategy apply_plan runs.

    >>> from autodist.schemas.plan import Strategy
    >>> s = Strategy(dp=2, mp=2, pp=2, sharding_stage=2, micro_batches=2, schedule="1F1B")
    >>> strategy_needs(s), runs_local_views(s), runs_moe_locally(s)
    ([('ZeRO stage 2', 'reduce_scatter'), ('the 1F1B schedule', 'batched_p2p')], True, False)
    >>> runtime_refusals(s, "trainer")  # doctest: +ELLIPSIS
    ["a pipeline (pp=2, schedule 1F1B): PaddleFormers' auto-parallel Trainer runs none ..."]
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Literal

from autodist.schemas.plan import BackendOperation, Strategy
from autodist.schemas.schedules import PIPELINING_SCHEDULES

#: The operations a backend may lack, in words.
OPERATIONS: dict[BackendOperation, str] = {
    "reduce_scatter": "reduce-scatter",
    "all_to_all": "all-to-all",
    "cross_mesh_reshard": "a reshard between two meshes",
    "batched_p2p": "batched P2P (batch_isend_irecv)",
}

#: What each backend of Paddle 3.3.1 lacks, and what happens when it is asked anyway.
LACKS: dict[str, dict[BackendOperation, str]] = {
    "gloo": {
        "reduce_scatter": "its CPU kernel throws Unimplemented",
        "all_to_all": "its CPU kernel throws Unimplemented",
        "cross_mesh_reshard": "it segfaults in SameStatusReshardFunction",
        "batched_p2p": "it times out (gloo TIMEOUT)",
    },
}


def strategy_needs(strategy: Strategy) -> list[tuple[str, BackendOperation]]:
    """``[(plan feature, operation)]``: what the strategy asks of the backend beyond all-reduce,
    all-gather and plain send/recv, which every backend has."""
    needs: list[tuple[str, BackendOperation]] = []
    if strategy.sequence_parallel and strategy.mp > 1:
        needs += [("sequence parallelism", "reduce_scatter"), ("sequence parallelism", "all_to_all")]
    if strategy.sharding_stage and strategy.dp > 1:
        needs.append((f"ZeRO stage {strategy.sharding_stage}", "reduce_scatter"))
    if strategy.pp > 1 and strategy.schedule == "sequential":
        needs.append(("the sequential schedule (its stage hand-offs)", "cross_mesh_reshard"))
    if strategy.pp > 1 and strategy.schedule in ("1F1B", "VPP"):
        needs.append((f"the {strategy.schedule} schedule", "batched_p2p"))
    return needs


def needs_missing(strategy: Strategy, missing: Collection[str]) -> list[tuple[str, BackendOperation]]:
    """The ``(plan feature, operation)`` pairs of :func:`strategy_needs` whose operation is in
    ``missing`` (what a backend lacks): the one filter the planner's ``[device].unsupported`` and
    ``apply_plan``'s backend refusal both apply.

    >>> needs_missing(Strategy(dp=2, sharding_stage=2, pp=2, schedule="1F1B"), {"batched_p2p"})
    [('the 1F1B schedule', 'batched_p2p')]
    >>> needs_missing(Strategy(dp=2, sharding_stage=2), ())
    []
    """
    return [(feature, operation) for feature, operation in strategy_needs(strategy) if operation in missing]


def runs_moe_locally(strategy: Strategy, local_only: bool = False) -> bool:
    """Whether the MoE layers run whole, on plain local tensors, between an ``expert_dispatch``
    and an ``expert_combine`` (the plan's hooks): under expert parallelism, and under any data
    parallelism without it too (ep 1: every rank its own tokens, nothing gathered), not with pp,
    ZeRO or sequence parallelism (then a model with experts gets dp > 1 only without them:
    :func:`expert_limit`). ``local_only``: the MoE layers' own code holds an op Paddle 3.3 cannot
    run on distributed tensors at all (an ``einsum`` dispatch, an expert reading its tokens through
    a boolean mask, ``x[mask]``, or GPT-OSS's batched experts indexed at a computed position,
    ``self.gate_up_proj[expert_idx]``: the planner's ``ModelAnalysis.moe_local_only``); then they
    run so under tensor parallelism alone too (dp 1), whole on every mp rank, their experts not split.

    Under dp this is for correctness: Paddle 3.3 answers an
    integer-tensor index into a DistTensor split on another dim with the wrong rows, silently, and MoE
    routing indexes the dp-split tokens that way (Hugging Face's Qwen3-MoE ``expert_mask[expert_idx]``
    trained off the single-device losses at dp2 and at dp2 x mp2: docs/paddle-notes.md, "SPMD
    rules"). apply_plan runs those hooks only with pp 1, ZeRO stage 0 and no sequence parallelism.
    Sequence parallelism is out for a model with experts at any dp: it hands the MoE layers their
    tokens split over mp, and Paddle 3.3 routes split tokens wrongly (HF Qwen3-MoE's MoE layer
    answered up to 4.3 away on 2 ranks). Any mp goes: the MoE layers run whole on every mp rank, the
    rest of the block split as usual. Under mp alone the MoE layers otherwise stay DistTensors, their
    experts split over mp like any MLP.

    >>> from autodist.schemas.plan import Strategy
    >>> [runs_moe_locally(Strategy(**s)) for s in ({"dp": 2, "mp": 2}, {"mp": 2}, {"dp": 2, "sharding_stage": 1})]
    [True, False, False]
    >>> runs_moe_locally(Strategy(mp=2), local_only=True), runs_moe_locally(Strategy(mp=2, pp=2), local_only=True)
    (True, False)
    """
    runnable = strategy.pp == 1 and not strategy.sharding_stage and not strategy.sequence_parallel
    return strategy.ep > 1 or (runnable and (strategy.dp > 1 or local_only))


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


def runs_local_views(strategy: Strategy) -> bool:
    """Whether local views and vocabulary-parallel lookups (``Plan.vocab_lookup``) run under
    ``strategy`` (the planner's rule, the cost model's and the applier's check): tensor
    parallelism, composed as Megatron-LM composes it with

    - data parallelism, and ZeRO stage 1, 2 or 3 over it: the local views' gradients come back
      Partial over dp like any data-parallel gradient, and the optimizer states follow the
      parameters' (rank-by-rank) layout, split over dp; under ZeRO 3 a view's weights and a
      lookup's rows, split over dp too, are gathered over dp for the call;
    - gradient accumulation over micro-batches (no pipeline): each micro-batch's forward and
      backward runs the local views, the gradients add up;
    - full recompute: a recomputed block runs its local views again in its backward, their
      forward all-reduce too; selective recompute: each local-view attention runs its forward
      again on local tensors, its all-reduces once (applier/modes/recompute.py);
    - the 1F1B and VPP pipeline schedules: each stage's chunks run the model's own forward, its
      views and (first stage) its token lookup on the stage's mp ranks; a tied table's
      last-stage copy is read in the global view and its gradient summed with the first stage's;
    - sequence parallelism: the plan's hooks all-gather the sequence before a view (norms and
      dropout between the sub-layers run on sequence shards), and a view's or a lookup's partial
      sum is left Partial over mp for the hook after it, whose reshard to the sequence split is
      a reduce-scatter (applier/placement/hooks.py ``sequence_split_sides``).
    - expert parallelism: the MoE layers dispatched over ep, whole on each mp rank
      (:func:`runs_moe_locally`), beside the attention's views (tests/test_train_experts.py).

    Not with the sequential schedule (its stage hand-offs reshard between meshes in the global
    view).

    >>> runs_local_views(Strategy(dp=2, mp=2, sharding_stage=3, micro_batches=2, recompute="selective"))
    True
    >>> runs_local_views(Strategy(mp=2, pp=2, micro_batches=2, schedule="VPP", virtual_stages=2))
    True
    >>> runs_local_views(Strategy(mp=2, sequence_parallel=True)), runs_local_views(Strategy(mp=2, pp=2, schedule="sequential"))
    (True, False)
    """
    return not local_views_refused(strategy)


def local_views_refused(strategy: Strategy) -> str:
    """What of ``strategy`` local views do not run under, in words (empty when they run): the
    one list of :func:`runs_local_views`'s conditions, which the planner's notes and the
    applier's refusal say.

    >>> local_views_refused(Strategy(mp=2, pp=2, schedule="sequential"))
    'the sequential pipeline schedule'
    """
    refused = [
        (strategy.mp == 1, "no tensor parallelism"),
        (
            strategy.pp > 1 and strategy.schedule not in PIPELINING_SCHEDULES,
            f"the {strategy.schedule} pipeline schedule",
        ),
    ]
    return ", ".join(why for applies, why in refused if applies)


def combination_problems(strategy: Strategy, moe: bool = False, tied: bool = False) -> list[str]:
    """Why no runtime builds ``strategy`` for a model (``moe``: with experts; ``tied``: a weight
    shared by layers a pipeline may put on two stages, an embedding and its LM head), beyond
    :func:`expert_limit`: one sentence each, the planner's reason to leave a strategy out and
    ``apply_plan``'s refusal.

    >>> combination_problems(Strategy(dp=2, ep=4))
    ['ep=4 does not divide dp=2 (experts spread over dp ranks)']
    >>> combination_problems(Strategy(pp=2, schedule="sequential", micro_batches=2), tied=True)  # doctest: +NORMALIZE_WHITESPACE
    ['micro_batches=2 with the sequential schedule: apply_plan accumulates micro-batches only without a pipeline;
      re-plan with --micro-batches 1 or a 1F1B schedule',
     "a weight tied across stages needs the 1F1B or VPP schedule, which sums its copies' gradients
      (the plan's is sequential)"]
    """
    problems = []
    if strategy.dp % strategy.ep:
        problems.append(f"ep={strategy.ep} does not divide dp={strategy.dp} (experts spread over dp ranks)")
    if strategy.schedule == "sequential" and strategy.micro_batches > 1:
        problems.append(
            f"micro_batches={strategy.micro_batches} with the sequential schedule: apply_plan accumulates "
            "micro-batches only without a pipeline; re-plan with --micro-batches 1 or a 1F1B schedule"
        )
    if tied and strategy.pp > 1 and strategy.schedule not in PIPELINING_SCHEDULES:
        problems.append(
            "a weight tied across stages needs the 1F1B or VPP schedule, which sums its copies' gradients "
            f"(the plan's is {strategy.schedule})"
        )
    return problems


#: The runtimes besides ``apply_plan`` that run a plan, by what :func:`runtime_refusals` calls them.
Runtime = Literal["dist.parallelize", "trainer"]


def runtime_refusals(strategy: Strategy, runtime: Runtime) -> list[str]:
    """What of ``strategy`` ``runtime`` cannot run, one sentence each with the fix (empty when it
    runs it): ``dist.parallelize`` (``autodist-plan export``'s module) or PaddleFormers' Trainer in
    its auto-parallel mode (``autodist.integrations.paddleformers``).

    >>> runtime_refusals(Strategy(dp=2, ep=2), "dist.parallelize")
    ['expert parallelism (ep=2): dist.parallelize has no key for it (re-plan with --ep 1)']
    >>> runtime_refusals(Strategy(mp=2), "trainer")
    []
    """
    s = strategy
    rows: list[tuple[bool, str]] = [
        (
            s.ep > 1,
            f"expert parallelism (ep={s.ep}): {_RUNTIME_NAMES[runtime]} has no key for it (re-plan with --ep 1)",
        ),
    ]
    if runtime == "dist.parallelize":
        rows.append(
            (
                s.virtual_stages > 1,
                f"VPP with {s.virtual_stages} chunks per stage: pp_config takes one split point per stage "
                "boundary (re-plan with --schedule 1F1B to export)",
            )
        )
    else:
        rows = [
            (
                s.pp > 1,
                f"a pipeline (pp={s.pp}, schedule {s.schedule}): PaddleFormers' auto-parallel Trainer runs none (it "
                "asserts pipeline_model_parallel_size == 1); re-plan with --pp 1, or use apply_plan in your own loop",
            ),
            *rows,
            (
                s.sequence_parallel,
                "sequence parallelism: Paddle's SequenceParallel plans read a layer's first positional input, and "
                "PaddleFormers calls its attention with keywords only (IndexError in c_concat; docs/paddle-notes.md); "
                "re-plan with --no-sequence-parallel",
            ),
            (
                s.recompute != "none",
                f"recompute ({s.recompute}): the Trainer's config has no key for it; re-plan with --recompute none "
                "and set TrainingArguments(recompute=...)",
            ),
        ]
    return [sentence for applies, sentence in rows if applies]


_RUNTIME_NAMES: dict[Runtime, str] = {
    "dist.parallelize": "dist.parallelize",
    "trainer": "the Trainer's dist.parallelize config",
}
