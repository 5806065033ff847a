"""Pipeline schedules: ``1F1B`` and ``VPP`` through Paddle's own
``paddle.distributed.auto_parallel.pipelining``.

The plan's ``sequential`` schedule needs nothing here: its stage hand-off hooks (hooks.py)
move each block's output onto the next stage's mesh inside an ordinary training loop, and
the stages run one after another.

A real schedule runs micro-batches of different stages at the same time, so each rank must
own a *module* for its stage that takes the previous stage's output. autodist does not trace
at run time, so it cannot cut an arbitrary ``forward`` apart; a schedule therefore needs a
model whose forward is its children run in order — a ``paddle.nn.Sequential`` (validation
says so otherwise; use ``sequential`` for any other model). The plan's ``stage`` of each
child's parameters decides the cut:

- ``1F1B``: the children's stages read ``0..0, 1..1, ..., pp-1``: one chunk per rank;
- ``VPP``: they cycle ``0, 1, ..., pp-1, 0, 1, ...`` ``v`` times: virtual stage ``c`` is the
  ``c``-th run of equal stages, and rank-stage ``s`` owns the runs ``s, s+pp, s+2pp, ...``.

``apply_plan`` then returns a :class:`PipelineModel`: it holds only this rank's chunks (so
the rebuilt optimizer holds exactly this rank's parameters) and runs a whole training step::

    model, opt, loader = apply_plan(model, opt, loader, "plan.json", loss_fn=loss_fn)
    for inputs, labels in loader:
        losses = model.step(inputs, target=labels)  # forward + backward of every micro-batch
        opt.step()                                   # losses: one per micro-batch on the last stage,
        opt.clear_grad()                             # [] on the other stages

Paddle's schedules add the micro-batches' gradients; autodist divides each micro-batch loss
by the micro-batch count for backward (and reports it undivided), so a step trains exactly
like the whole batch with a mean loss on one device.

On Paddle 3.3.1's CPU wheel ``batch_isend_irecv`` under gloo times out (docs/paddle-notes.md, "Collectives on the CPU wheel"), so
the schedules cannot run there as they are. With a test-only stand-in that runs each P2P op
as a blocking send/recv, 1F1B and VPP on 2 CPU ranks train equal to one device
(tests/test_apply_single.py). A pipeline with dp or mp inside each stage also needs one
process group per pipeline column (``dist.new_group``), and gloo sub-groups time out on this
CPU setup, so that case is left to GPUs (NCCL), where no stand-in is needed — not run here.
"""

from __future__ import annotations

from typing import Any, Callable

import paddle
import paddle.distributed as dist

from autodist.schemas import Plan

from autodist.applier.mesh import pp_group_ranks, stage_of_rank

SCHEDULES = ("1F1B", "VPP")


def uses_schedule(plan: Plan) -> bool:
    """True when the plan runs its stages with a real pipelining schedule."""
    return plan.strategy.schedule in SCHEDULES


def pipeline_problems(model: paddle.nn.Layer, plan: Plan, loss_fn: Callable | None) -> list[str]:
    """Why the plan's schedule cannot run on ``model`` (empty for non-schedule plans)."""
    if not uses_schedule(plan):
        return []
    schedule = plan.strategy.schedule
    if not isinstance(model, paddle.nn.Sequential):
        return [
            f"$.strategy.schedule: {schedule} needs a paddle.nn.Sequential model (children run in order), "
            f"got {type(model).__name__}; use the 'sequential' schedule for other models"
        ]
    problems = [] if loss_fn is not None else [
        f"$.strategy.schedule: {schedule} computes the loss inside the schedule: pass apply_plan(..., loss_fn=fn)"
    ]
    try:
        runs = stage_runs(model, plan)
    except ValueError as exc:
        return problems + [f"$.strategy.schedule: {exc}"]
    pp = plan.strategy.pp
    stages = [stage for stage, _ in runs]
    if schedule == "1F1B" and stages != list(range(pp)):
        problems.append(f"$.strategy.schedule: 1F1B needs the children's stages in order 0..{pp - 1}, got runs {stages}")
    if schedule == "VPP" and (len(stages) % pp or stages != [i % pp for i in range(len(stages))] or len(stages) == pp):
        problems.append(
            f"$.strategy.schedule: VPP needs the children's stages to cycle 0..{pp - 1} at least twice, got runs {stages}"
        )
    n, rounds = plan.strategy.micro_batches, max(1, plan.strategy.micro_batches // pp)
    if schedule == "VPP" and n % rounds:
        # ScheduleVPP's own rule (schedules.py), checked here so it fails before anything changes.
        problems.append(f"$.strategy.micro_batches: VPP needs a multiple of {rounds} micro-batches (max(1, n // pp)), got {n}")
    return problems


def stage_runs(model: paddle.nn.Sequential, plan: Plan) -> list[tuple[int, list[paddle.nn.Layer]]]:
    """The model's children grouped into runs of equal stage, in order: ``[(stage, [child, ...]), ...]``.
    A child without parameters joins the run before it. Raises ValueError when one child's
    parameters span several stages."""
    runs: list[tuple[int, list[paddle.nn.Layer]]] = []
    for name, child in model.named_children():
        planned = (plan.params.get(f"{name}.{fqn}") for fqn, _ in child.named_parameters())
        stages = {p.stage for p in planned if p is not None}  # unplanned names: validation reports them
        if len(stages) > 1:
            raise ValueError(f'child "{name}" has parameters on stages {sorted(stages)}: a child must sit on one stage')
        stage = stages.pop() if stages else (runs[-1][0] if runs else 0)
        if runs and runs[-1][0] == stage:
            runs[-1][1].append(child)
        else:
            runs.append((stage, [child]))
    return runs


class PipelineModel(paddle.nn.Layer):
    """This rank's pipeline chunks and the schedule that runs them.

    ``parameters()`` are this rank's stage parameters only. ``step(*inputs, target=labels)``
    runs forward and backward of all micro-batches and returns the per-micro-batch losses on
    the last stage (an empty list elsewhere); follow it with ``optimizer.step()``. Calling the
    model directly is not supported: a schedule has no single-rank forward.
    """

    def __init__(self, chunks: list[paddle.nn.Layer], schedule: Any, holds_first: bool, holds_last: bool):
        super().__init__()
        self.chunks = paddle.nn.LayerList(chunks)
        self.schedule = schedule
        self.holds_first, self.holds_last = holds_first, holds_last

    def step(self, *inputs: Any, target: Any = None) -> list[paddle.Tensor]:
        # Every rank may pass the whole batch; only the first stage consumes the inputs and
        # only the last the target. The others must not even split them: a tensor on another
        # stage's mesh cannot be split on this rank (segfault in GetDefaultPlace on CPU).
        losses: list[paddle.Tensor] = []
        self.schedule.step(*(inputs if self.holds_first else ()), target=target if self.holds_last else None, losses=losses)
        n = self.schedule._n_microbatches
        return [loss.detach() * n for loss in losses]  # undo the 1/n of _mean_over_micro_batches

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("a pipelined model runs whole steps: call model.step(inputs, target=labels)")


def build_pipeline(model: paddle.nn.Sequential, plan: Plan, loss_fn: Callable, full_mesh: dist.ProcessMesh) -> PipelineModel:
    """Cut the (already sharded) model into this rank's chunks and wrap them in Paddle's
    schedule. Every rank creates every pipeline group, in the same order (``new_group`` is
    collective)."""
    from paddle.distributed.auto_parallel.interface import set_mesh
    from paddle.distributed.auto_parallel.pipelining.schedules import Schedule1F1B, ScheduleVPP
    from paddle.distributed.auto_parallel.pipelining.stage import PipelineStage

    # Process groups need the collective environment, which plain auto-parallel code starts
    # lazily; every rank gets here together, having passed the same validation.
    if not dist.is_initialized():
        dist.init_parallel_env()
    # Paddle's stages find their meshes through the global mesh (pipelining/utils.py).
    set_mesh(full_mesh)
    rank = dist.get_rank()
    group = None
    for ranks in pp_group_ranks(plan):
        created = dist.new_group(ranks)
        if rank in ranks:
            group = created
    runs = stage_runs(model, plan)
    mine = stage_of_rank(plan, rank)
    chunks, stages = [], []
    for index, (stage, children) in enumerate(runs):
        if stage == mine:
            chunk = paddle.nn.Sequential(*children)
            chunks.append(chunk)
            stages.append(PipelineStage(chunk, index, len(runs), group=group))
    holds_first, holds_last = any(s.is_first for s in stages), any(s.is_last for s in stages)
    n = plan.strategy.micro_batches
    scaled = _mean_over_micro_batches(loss_fn, n)
    if plan.strategy.schedule == "1F1B":
        schedule = Schedule1F1B(stages[0], n_microbatches=n, loss_fn=scaled)
    else:
        schedule = ScheduleVPP(stages, n_microbatches=n, loss_fn=scaled)
    return PipelineModel(chunks, schedule, holds_first, holds_last)


def _mean_over_micro_batches(loss_fn: Callable, n: int) -> Callable:
    """Paddle's schedules add up the micro-batches' gradients. A user's loss is a mean over
    its batch, so each micro-batch's loss is divided by ``n``: the step then trains exactly
    as the whole batch would on one device (equal-sized micro-batches)."""
    return lambda output, target: loss_fn(output, target) / n
