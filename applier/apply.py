"""``apply_plan``: validate, agree, start from rank 0's model, shard, hook, rebuild the optimizer, split the loader.

The user's training loop, for each schedule of the plan (the README copies this):

``none`` (no pipeline) and ``sequential`` (stages run one after another through stage
hand-off hooks) — an ordinary loop; inputs and labels arrive as DistTensors::

    from autodist import apply_plan

    # every rank, e.g. under python -m paddle.distributed.launch --nproc_per_node 4 train.py
    model = build_model()               # or under paddle.LazyGuard(): each rank allocates its shard only
    opt = paddle.optimizer.AdamW(learning_rate=1e-3, parameters=model.parameters())
    model, opt, loader = apply_plan(model, opt, loader, "plan.json")
    for input_ids, labels in loader:
        loss = loss_fn(model(input_ids), labels)
        loss.backward()
        opt.step()
        opt.clear_grad()
        scheduler.step()                # if any: the rebuilt optimizer shares your LR scheduler object

Use the returned objects only: the old optimizer still points at the replaced parameters, and its
``step()`` raises, naming apply_plan's return value (optimizer.retire).
The loop stays the same when the plan accumulates gradients (``micro_batches > 1``, no
pipeline): the loader then yields micro-batches and ``opt.step()`` updates once per batch
(accumulate.py).

``1F1B`` / ``VPP`` (Paddle's pipelining schedules, for any model the plan cut at its blocks;
pipeline.py says how) — the returned model is this rank's stages, one call runs a whole step of
micro-batches, and ``loss_fn(logits, labels)`` gets the first tensor the model returns::

    model, opt, loader = apply_plan(model, opt, loader, "plan.json", loss_fn=loss_fn)
    for input_ids, labels in loader:
        losses = model.step(input_ids, target=labels)  # per-micro-batch losses, readable on every rank
        opt.step()
        opt.clear_grad()
"""

from __future__ import annotations

import os
import weakref
from typing import Any, Callable, Collection

import paddle
import paddle.distributed as dist

from autodist.schemas import Plan, PlanError, dump_plan, load_plan, parameter_fingerprint, parameter_table

from autodist.applier.modes.accumulate import (
    AccumulatingOptimizer,
    MicroBatchLoader,
    accumulates,
    step_scheduler_per_update,
)
from autodist.applier.ranks.agree import Agreement, Record, agree, applying, digest, timeout_from
from autodist.applier.placement.backend import lacking, running_backend
from autodist.applier.placement.data import shard_loader
from autodist.applier.placement.clip import clip_over_ranks
from autodist.applier.modes.expert_dispatch import (
    ExpertGradSync,
    ExpertGroups,
    dropped_parameters,
    moe_parameters,
    refuse_training_without_optimizer,
    runs_moe_locally,
    spread_experts,
)
from autodist.applier.placement.hooks import ReshardFn, register_hooks
from autodist.applier.modes.local_calls import LocalViews
from autodist.applier.placement.mesh import mesh_ids
from autodist.applier.placement.optimizer import optimizer_parameters, rebuild_optimizer, retire, shard_optimizer
from autodist.applier.modes.pipeline import PipelineModel, build_pipeline, uses_schedule
from autodist.applier.ranks.readable import Settings as ReadSettings
from autodist.applier.ranks.readable import close as close_readable
from autodist.applier.ranks.readable import install as make_outputs_readable
from autodist.applier.ranks.readable import settings as read_settings
from autodist.applier.modes.recompute import wrap_recompute
from autodist.applier.placement.replicas import equalise_dense, equalise_random
from autodist.applier.placement.shard import shard_parameters
from autodist.applier.ranks.store_host import global_store, warm_up_store_host
from autodist.applier.placement.validate import plan_problems
from autodist.applier.modes.vocab_lookup import wrap_vocab_lookups
from autodist.applier.checkpoint import plain_save
from autodist.applier.modes import exact_reductions, local_einsum, vector_concat, whole_metrics
from autodist.applier.placement import wrapped_again

#: The modules that change Paddle's own functions for the whole process while a plan runs (what
#: Paddle gets wrong or refuses on distributed tensors), each undone by its ``restore`` (:func:`close`).
PROCESS_PATCHES = (local_einsum, exact_reductions, whole_metrics, vector_concat, plain_save, wrapped_again)

#: The plan each model ``apply_plan`` returned was distributed by (``save_checkpoint`` records it).
_APPLIED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def apply_plan(
    model: paddle.nn.Layer,
    optimizer: paddle.optimizer.Optimizer | None,
    dataloader: paddle.io.DataLoader | None,
    plan: str | os.PathLike | bytes | Plan,
    *,
    loss_fn: Callable | None = None,
    reshard_fn: ReshardFn | None = None,
    agree_timeout_s: float | None = None,
    stand_ins: Collection[str] = (),
) -> tuple[paddle.nn.Layer, Any, Any]:
    """Make ``model`` (and its optimizer and loader) distributed as ``plan`` says, on this rank.

    Call it on every rank with the same arguments. ``plan`` is a path, JSON bytes or a
    :class:`~autodist.schemas.Plan`; ``optimizer`` and ``dataloader`` may be None.
    ``loss_fn(output, labels)`` is needed by the ``1F1B``/``VPP`` schedules only.
    ``reshard_fn(tensor, mesh, placements)`` replaces ``dist.reshard`` in the plan's hooks
    (for test harnesses; see hooks.py).

    A plan the running collectives backend cannot run (on gloo: sequence parallelism, ZeRO,
    pipelines; backend.py) is refused like any other problem, naming the feature and the
    backend. ``stand_ins`` names the operations the caller supplies itself where the backend
    lacks them (``"reduce_scatter"``, ``"all_to_all"``, ``"batched_p2p"``,
    ``"cross_mesh_reshard"``), as the test harness's TEST-ONLY detours do.

    Everything is checked first, without communicating; then all ranks agree that they hold
    the same plan and the same model and that none found a problem (see agree.py). On any
    problem, on any rank, every rank raises one :class:`~autodist.schemas.PlanError` listing
    them all, and nothing has been changed. A rank that does not arrive within
    ``agree_timeout_s`` seconds (default ``AUTODIST_AGREE_TIMEOUT`` or 300) is named in it.
    A rank that raises or dies later, while applying the plan, is named too: every other rank
    raises a ``PlanError`` before its next communication (the failed rank its own error).

    Before anything is sharded, every rank takes rank 0's random state and rank 0's parameters
    and buffers (ranks seeded apart built different models; replicas.py): the run starts from
    the model one device seeded as rank 0 builds, every piece of it. A loader whose dataset
    Paddle would pad over dp is refused with the rest (data.py), and the optimizer passed in
    refuses ``step()`` from then on: it holds the replaced parameters.

    Returns ``(model, optimizer, dataloader)``: the same model object with distributed
    parameters (for a schedule, a :class:`~autodist.applier.modes.pipeline.PipelineModel` of this
    rank's stage), a rebuilt optimizer holding exactly the new parameters (wrapped by
    ``dist.shard_optimizer``), and a ``dist.ShardDataloader``. When the plan has
    ``micro_batches > 1`` and no pipeline schedule, the loader yields micro-batches and the
    optimizer accumulates their gradients, updating once per batch (accumulate.py).

    Example::

        >>> model, opt, loader = apply_plan(model, opt, loader, "plan.json")   # doctest: +SKIP
    """
    source = str(plan) if isinstance(plan, (str, os.PathLike)) else "plan"
    world = dist.get_world_size()
    # First, whatever follows: rank 0 hosts Paddle's store, and its exit must survive the peers
    # hanging up, also when the plan is refused and every rank leaves at once (store_host.py).
    if world > 1:
        warm_up_store_host(dist.get_rank())
    read = read_settings()  # a bad AUTODIST_READ_TIMEOUT or AUTODIST_READABLE: one PlanError, nothing touched
    loaded: Plan | None = None
    try:
        loaded = load_plan(plan)
        plan_digest = digest(dump_plan(loaded))
        problems = plan_problems(model, optimizer, dataloader, loaded, world_size=world, loss_fn=loss_fn)
        if world > 1:  # one rank communicates nothing
            problems = lacking(loaded, running_backend(), stand_ins) + problems
    except PlanError as err:  # still meet the other ranks: they must stop too
        plan_digest, problems = "", err.problems
    model_digest = parameter_fingerprint(parameter_table(model.named_parameters()))
    record = Record(dist.get_rank(), source, plan_digest, model_digest, problems)
    agreement = agree(record, rank=dist.get_rank(), world=world, timeout_s=timeout_from(agree_timeout_s))
    assert loaded is not None  # agree() raises on every rank when any rank has a problem
    # Each rank applies the plan on its own; a rank that fails tells the others, and all settle
    # before the next communication (agree.py), so none waits in one its peer never joins.
    with applying(agreement):
        return _apply(model, optimizer, dataloader, loaded, loss_fn, reshard_fn, agreement, read)


def _apply(model, optimizer, dataloader, plan: Plan, loss_fn, reshard_fn, agreement: Agreement, read: ReadSettings):
    """``apply_plan`` once every rank agreed on ``plan``: after the copy of rank 0's model, no
    communication until ``agreement`` settles."""
    # The first communication, before anything one rank alone could fail at: every rank starts from
    # rank 0's model and random stream, the one device's, however each was seeded (replicas.py). Before
    # the sharding: an mp piece is then rank 0's columns, and a lazy build draws rank 0's numbers.
    world = dist.get_world_size()
    if world > 1:  # made here, not by Paddle at that first collective: a rank > 0 there slept 3 s (store_host.py)
        global_store(dist.get_rank())
    equalise_random(list(range(world)), dist.get_rank())
    equalise_dense(model, dist.get_rank(), world)
    # Expert parallelism drops the experts other ranks hold before anything is sharded.
    dropped = frozenset(dropped_parameters(plan, dist.get_rank()))
    sharded = shard_parameters(model, plan, dropped)
    register_hooks(model, plan, reshard_fn)
    LocalViews(plan).wrap(model)  # sub-layers that run on local tensors (local_view.py)
    wrap_vocab_lookups(model, plan)  # token lookups in a vocabulary-split table, Megatron's way (vocab_lookup.py)
    local_einsum.run_permutations_locally()  # an einsum that only reorders dims, on local values (einsum.py)
    exact_reductions.norm_exactly()  # a norm over split dims, which Paddle sums (exact_reductions.py)
    whole_metrics.measure_whole()  # paddle.metric.accuracy, which has no distributed kernel (whole_metrics.py)
    vector_concat.concat_vectors_as_rows()  # a concat of 1-D tensors, whose backward Paddle refuses (vector_concat.py)
    groups = None
    if runs_moe_locally(plan):  # ep, the MoE layers of plain dp or of mp alone (expert_dispatch.py)
        groups = ExpertGroups(plan, dist.get_rank())
        spread_experts(model, plan, groups)
        if optimizer is None:  # one built later would leave their gradients unsummed
            refuse_training_without_optimizer(model, plan)
    wrap_recompute(model, plan)
    if uses_schedule(plan):
        assert loss_fn is not None  # plan_problems refused a schedule without one (pipeline_problems)
        agreement.settle()  # the pipeline's process groups are the first collective
        model = build_pipeline(
            model, plan, loss_fn, dist.ProcessMesh(mesh_ids(plan).tolist(), plan.mesh.axes), sharded.copies
        )
    # paddle.save(model.state_dict()): one device's file where the rank holds it, else refused (plain_save.py)
    plain_save.guard_saves(
        "its own experts only" if dropped else "its pipeline stage's only" if isinstance(model, PipelineModel) else None
    )
    wrapped_again.refuse_wrapping_again()  # fleet.distributed_model(model) of the model returned (wrapped_again.py)
    # Every rank must have applied the plan before the next communication (the optimizer's), or all
    # raise here instead of waiting there (unless a pipeline's came first and settled already).
    agreement.settle()
    if optimizer is not None:
        # Only parameters the returned model holds: a pipeline stage drops the other stages'.
        mine = {id(p) for p in model.parameters()}
        new_param = {id(old): new for old, new in sharded.pairs if id(new) in mine}
        rebuilt = rebuild_optimizer(optimizer, new_param)
        retire(optimizer)  # the user's own object: its step() would train the replaced parameters
        optimizer = _clip_over_ranks(shard_optimizer(rebuilt, plan), rebuilt, model, plan, groups)
        if groups is not None:  # summed before every update (and its clip), so after all micro-batches
            optimizer = ExpertGradSync(optimizer, model, plan, groups)
        accumulating = None
        if accumulates(plan):
            optimizer = accumulating = AccumulatingOptimizer(
                optimizer, optimizer_parameters(rebuilt), plan.strategy.micro_batches
            )
        step_scheduler_per_update(rebuilt, accumulating)  # the user's LR scheduler: once per update
    if dataloader is not None:
        dataloader = shard_loader(dataloader, plan)
        if accumulates(plan):
            dataloader = MicroBatchLoader(dataloader, plan.strategy.micro_batches)
    # A loss read on rank 0 only (readable/). The collectives the applier issues from Python
    # (MoE layers, local views, local token lookups) hold Python's lock while they wait, so a rank
    # in one could not answer a reader: values are posted instead.
    post = groups is not None or bool(plan.local_view or plan.vocab_lookup)
    make_outputs_readable(model, agreement.job_key, post=post, read=read)  # bound to this run (agree.py)
    _APPLIED[model] = plan
    return model, optimizer, dataloader


def _clip_over_ranks(optimizer, rebuilt, model, plan: Plan, groups: ExpertGroups | None):
    """Clipping by global norm where ranks hold different parameters, which Paddle's clip would
    count wrong (clip.py): each rank's own experts, the stages of a pipeline schedule."""
    pipelined = isinstance(model, PipelineModel)
    if groups is None and not pipelined:
        return optimizer
    if groups is not None:
        exact_reductions.refuse_clip_grad_norm(
            "this rank's experts' gradients alone, before the optimizer sums them over their ranks"
        )
    else:
        exact_reductions.refuse_clip_grad_norm("this pipeline stage's gradients alone")
    return clip_over_ranks(
        optimizer,
        rebuilt,
        own=moe_parameters(model, plan)[0] if groups is not None else (),
        own_group=groups.group if groups is not None else None,
        not_counted=model.tied_copies if pipelined else (),
        pipeline=model.pipeline_mesh if pipelined else None,
    )


def close(model: paddle.nn.Layer | None = None) -> None:
    """Undo what apply_plan changed in this process beyond the model (for ``model``, or for every
    applied model): the readable losses' wrappers, server thread and exit wait (readable/), once
    no applied model needs them, and the changes to Paddle's own functions (``PROCESS_PATCHES``).
    The models stay distributed. Call it on every rank.

    Example::

        >>> model, opt, loader = apply_plan(model, opt, loader, "plan.json")   # doctest: +SKIP
        >>> autodist.close()                                                    # doctest: +SKIP
    """
    close_readable(model)
    if model is None or not _APPLIED or set(_APPLIED) <= {model}:
        for module in PROCESS_PATCHES:
            module.restore()


def applied_plan(model: paddle.nn.Layer) -> Plan | None:
    """The plan :func:`apply_plan` distributed ``model`` by, or None."""
    return _APPLIED.get(model)
