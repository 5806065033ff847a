"""The program every rank runs: ``python -m harness.rank_main job.json``.

For each :class:`~harness.jobs.TrainRun`: build the model from its seed (eagerly, or under a
LazyGuard), distribute it (nothing for ``single``, ``autodist.apply_plan`` or
``paddle.distributed.to_distributed``), train, and write ``<run>.rank<R>.json`` with the losses,
every parameter's full value gathered to a replicated numpy array (before and after training),
the parameters training left unchanged, and how each parameter was laid
out on this rank (so a test can check the plan was really applied, not just that training
still works).

A run may load a checkpoint before training and save one after (``autodist.load_checkpoint`` /
``save_checkpoint``), to prove a run resumed under another plan trains on unchanged.

For each :class:`~harness.jobs.BadPlanCase`: call ``apply_plan`` and record the ``PlanError``
(message, seconds taken, whether model and optimizer were left untouched) in
``bad_plans.rank<R>.json``.
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import sys
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import NoReturn

import numpy as np
import paddle
import paddle.distributed as dist

from harness.cpu_substitutes import STOOD_IN, blocking_p2p, everywhere, reshard_via_replicate
from harness.jobs import BadPlanCase, Job, TrainRun, output_path
from harness.workloads import BATCH, SEQ, WORKLOADS, make_loader, make_optimizer, to_numpy, train


def spreads_experts(run: TrainRun) -> bool:
    """Whether the run's plan spreads experts over ranks (each then holds only some)."""
    from autodist.schemas import load_plan

    return run.method == "autodist" and run.plan is not None and load_plan(run.plan).strategy.ep > 1


def rank_and_world() -> tuple[int, int]:
    return int(os.environ.get("PADDLE_TRAINER_ID", 0)), int(os.environ.get("PADDLE_TRAINERS_NUM", 1))


def distribute(run: TrainRun, model, optimizer, loader, world: int):
    """Apply the run's method; returns (model, optimizer, loader, seconds the method took)."""
    start = time.perf_counter()
    if run.method == "autodist":
        from autodist import apply_plan

        reshard_fn = reshard_via_replicate if run.reshard == "via_replicate" else None
        loss_fn = WORKLOADS[run.workload].pipeline_loss(model)  # used by 1F1B / VPP plans only
        # The operations this run's TEST-ONLY detours supply (run_training wraps the run in them).
        stand_ins = ["reduce_scatter", "all_to_all"] * (run.reshard == "via_replicate") + ["batched_p2p"] * (
            run.p2p == "blocking"
        )
        model, optimizer, loader = apply_plan(
            model, optimizer, loader, run.plan, reshard_fn=reshard_fn, loss_fn=loss_fn, stand_ins=stand_ins
        )
    elif run.method == "to_distributed":
        from paddle.distributed.auto_parallel.high_level_api import ToDistributedConfig

        config = ToDistributedConfig()
        config.input_spec = [paddle.static.InputSpec([BATCH, SEQ], "int64", "input_ids")]
        model, optimizer, loader = dist.to_distributed(
            model, optimizer, loader, device_num=world, node_num=1, config=config
        )
    return model, optimizer, loader, time.perf_counter() - start


def own_layout_of(run: TrainRun):
    """``(fqn, whole value) -> value`` in the model's own layout: a local-view plan holds fused
    weights segment by segment, rank by rank (autodist.applier.modes.local_calls)."""
    if run.method != "autodist" or run.plan is None:
        return lambda fqn, value: value
    from autodist.applier.modes.local_calls import LocalViews
    from autodist.schemas import load_plan

    return LocalViews(load_plan(run.plan)).own_layout


@contextmanager
def recording_scores():
    """TEST-ONLY: record this rank's local shapes of the attention products, by wrapping
    ``paddle.matmul``, the ``@`` operator (``paddle.Tensor.__matmul__``), ``paddle.bmm`` and
    ``paddle.baddbmm`` for the block. Yields the shapes of each 4-D ``matmul`` or ``@`` output
    whose last two dims are equal (the scores ``[batch, heads, seq, seq]`` of the models that
    write them so: timm's ``q @ k.transpose(...)``) and ``{"bmm": [...], "baddbmm": [...]}``,
    every 3-D output of those (an attention over merged ``[batch * heads, ...]`` tensors: BLOOM's,
    OPT's scores and mix both hold ``batch * heads`` rows, whatever the sizes)."""
    shapes: list[list[int]] = []
    batched: dict[str, list[list[int]]] = {"bmm": [], "baddbmm": []}
    shipped = {name: getattr(paddle, name) for name in ("matmul", *batched)}
    operator = paddle.Tensor.__matmul__

    def recording(name: str, op):
        def recorded(*args, **kwargs):
            out = op(*args, **kwargs)
            local = out._local_value() if out.is_dist() else out
            if name == "matmul" and local.ndim == 4 and local.shape[-1] == local.shape[-2]:
                shapes.append(list(local.shape))
            elif name != "matmul" and local.ndim == 3:
                batched[name].append(list(local.shape))
            return out

        return recorded

    for name, op in shipped.items():
        setattr(paddle, name, recording(name, op))
    paddle.Tensor.__matmul__ = recording("matmul", operator)
    try:
        yield shapes, batched
    finally:
        for name, op in shipped.items():
            setattr(paddle, name, op)
        paddle.Tensor.__matmul__ = operator


@contextmanager
def counting_mp_sums():
    """TEST-ONLY: count this rank's sums over its mp line inside local views (their outputs'
    forward, their inputs' gradients backward), by wrapping the ``sum_over``
    applier/modes/local_calls.py calls, for the block. ``counts[0]`` when it ends."""
    from autodist.applier.modes import local_calls

    counts, sum_over = [0], local_calls.sum_over

    def counted(*args, **kwargs):
        counts[0] += 1
        return sum_over(*args, **kwargs)

    local_calls.sum_over = counted
    try:
        yield counts
    finally:
        local_calls.sum_over = sum_over


@contextmanager
def recording_linear_inputs(model: paddle.nn.Layer):
    """TEST-ONLY: this rank's local widths of the input of each ``nn.Linear`` of ``model``, by
    layer name, by a forward pre-hook on each for the block."""
    widths: dict[str, set[int]] = {}

    def recorder(name: str):
        def record(layer, inputs):
            x = inputs[0]
            widths.setdefault(name, set()).add((x._local_value() if x.is_dist() else x).shape[-1])

        return record

    handles = [
        layer.register_forward_pre_hook(recorder(name))
        for name, layer in model.named_sublayers()
        if isinstance(layer, paddle.nn.Linear)
    ]
    try:
        yield widths
    finally:
        for handle in handles:
            handle.remove()


def layout(param) -> dict:
    """How a parameter sits on this rank: placements and the local shard's shape."""
    if not param.is_dist():
        return {"placements": None, "local_shape": list(param.shape)}
    return {
        "placements": [str(p) for p in param.placements],
        "local_shape": list(param._local_value().shape),
        "mesh": param.process_mesh.process_ids,
    }


def optimizer_state_layout(optimizer) -> dict:
    """``{"<state>/<parameter name>": layout}`` of the optimizer's states after training (a ZeRO
    stage must have split them over dp)."""
    inner = getattr(optimizer, "_inner_opt", optimizer)  # dist.shard_optimizer's wrapper
    return {
        f"{kind}/{name}": layout(state)
        for kind, states in inner._accumulators.items()
        for name, state in states.items()
    }


def build_guard(build: str):
    """The context the run's model is built in (``TrainRun.build``)."""
    if build == "paddle_lazy":
        return paddle.LazyGuard()
    if build == "autodist_lazy":
        import autodist

        return autodist.LazyGuard()
    return nullcontext()


def run_training(run: TrainRun, rank: int, world: int, out_dir: str) -> None:
    # TEST-ONLY CPU stand-ins for the reshards and P2P gloo lacks, for this run only (cpu_substitutes.py).
    with everywhere() if run.reshard == "via_replicate" else nullcontext():
        with blocking_p2p() if run.p2p == "blocking" else nullcontext():
            _run_training(run, rank, world, out_dir)


def _run_training(run: TrainRun, rank: int, world: int, out_dir: str) -> None:
    from autodist.applier.modes.pipeline import PipelineModel

    workload = WORKLOADS[run.workload]
    # A resumed run starts from other weights: only the checkpoint can make them right.
    with build_guard(run.build):
        model = workload.build(run.seed + 1 if run.load_checkpoint else run.seed)
    whole = model
    optimizer, schedule = make_optimizer(run.optimizer, model.parameters())
    loader = make_loader(workload, run.steps, run.seed, first_step=run.first_step, batch=run.batch)
    model, optimizer, loader, apply_seconds = distribute(run, model, optimizer, loader, world)
    if run.load_checkpoint:
        from autodist import load_checkpoint

        step = load_checkpoint(model, optimizer, run.load_checkpoint).step
        if step != run.first_step:
            raise AssertionError(
                f"{run.name}: the checkpoint was saved at step {step}, the run starts at {run.first_step}"
            )
    pipelined = isinstance(model, PipelineModel)
    held = stage_parameters(whole, run.plan) if pipelined else dict(model.named_parameters())
    own_layout = own_layout_of(run)
    before = {fqn: own_layout(fqn, to_numpy(p)) for fqn, p in held.items()}
    STOOD_IN.clear()
    with (
        recording_scores() as (score_shapes, batched_products),
        recording_linear_inputs(whole) as linear_input_widths,
        counting_mp_sums() as mp_sums,
    ):
        if pipelined:
            losses = train_pipeline(model, optimizer, schedule, loader, run.steps)
        else:
            losses = train(workload, model, optimizer, schedule, loader, run.steps)
    stood_in = list(STOOD_IN)
    after = {fqn: own_layout(fqn, to_numpy(p)) for fqn, p in held.items()}
    if run.save_checkpoint:
        from autodist import save_checkpoint

        if run.save_fault and run.save_fault_rank == rank:
            break_the_save_half_way(run.save_fault)
        save_checkpoint(model, optimizer, run.save_checkpoint, step=run.first_step + run.steps)
    result = {
        # a pipeline stage, or a rank of an ep group, holds only some parameters
        "own_params_only": pipelined or spreads_experts(run),
        "run": run.name,
        "rank": rank,
        "world": world,
        "apply_seconds": apply_seconds,
        "losses": losses,
        # Iterations per optimizer step: > 1 when the plan's accumulation was applied.
        "micro_batches": getattr(loader, "micro_batches", 1),
        "params": {fqn: value.tolist() for fqn, value in after.items()},
        # Before training: what apply_plan (or the build, for "single") started from.
        "start_params": {fqn: value.tolist() for fqn, value in before.items()},
        # Parameters training never changed: the stale-optimizer bug leaves sharded ones here.
        "unchanged_by_training": sorted(fqn for fqn in after if np.array_equal(after[fqn], before[fqn])),
        "layout": {fqn: layout(p) for fqn, p in held.items()},
        "optimizer_states": optimizer_state_layout(optimizer),
        # This rank's shapes of every 4-D ``paddle.matmul`` or ``@`` output with square last dims (the
        # attention scores [batch, heads, seq, seq] of the models that write them so), in call order.
        "score_shapes": score_shapes,
        # This rank's shapes of every 3-D ``paddle.bmm`` and ``paddle.baddbmm`` output, by op, in
        # call order (attentions over merged [batch * heads, ...] tensors: BLOOM's, OPT's).
        "batched_products": batched_products,
        # This rank's local input width of each nn.Linear, by layer name (a row projection's is its
        # column's output width: 1/mp of it where the sub-layer runs on local tensors).
        "linear_input_widths": {name: sorted(seen) for name, seen in linear_input_widths.items()},
        # The collectives the TEST-ONLY reshard detours stood in for while training, in order
        # (cpu_substitutes.STOOD_IN): what a GPU would run as reduce-scatters and all-to-alls.
        "stood_in": stood_in,
        # This rank's sums over its mp line inside local views (forward and backward), all steps.
        "mp_sums": mp_sums[0],
    }
    output_path(out_dir, run.name, rank).write_text(json.dumps(result))


def break_the_save_half_way(fault: str) -> None:
    """TEST-ONLY: make this rank write half of its first piece, then SIGKILL itself (``"kill"``,
    as a rank of a killed job) or fail the write (``"no_space"``, as a full disk)."""
    import errno

    import autodist.applier.checkpoint.save_load as checkpoint

    def half_then_break(folder, mine):
        folder.mkdir(parents=True, exist_ok=True)
        with open(folder / mine[0][-1].file, "wb") as f:
            data = mine[0][0].numpy().tobytes()
            f.write(data[: len(data) // 2])
            f.flush()
        if fault == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    checkpoint._write_pieces = half_then_break


def stage_parameters(model, plan_path: str) -> dict:
    """The parameters this rank holds in a pipelined model, under their planned names (a tied
    name's own copy on this stage reported under the name the plan keys it by)."""
    from autodist.schemas import load_plan

    plan = load_plan(plan_path)
    planned_name = {alias: fqn for fqn, p in plan.params.items() for alias in p.tied_to}
    me = dist.get_rank()
    held = {}
    for prefix, layer in model.named_sublayers(include_self=True):
        for key, param in layer._parameters.items():
            fqn = f"{prefix}.{key}" if prefix else key
            if param is not None and me in param.process_mesh.process_ids:
                held[planned_name.get(fqn, fqn)] = param
    return held


def train_pipeline(model, optimizer, schedule, loader, steps: int) -> list[float]:
    """``model.step`` per batch; each step's loss is the mean of the last stage's micro-batch
    losses, shared with every rank (summed over the world, the other stages adding 0, and
    divided by the number of last-stage ranks, which hold equal parts of the batch)."""
    losses = []
    for step, (inputs, labels) in enumerate(loader):
        if step == steps:
            break
        micro = model.step(inputs, target=labels)
        micro = micro if model.holds_last else []  # the other stages' are read from it (applier/ranks/readable/)
        optimizer.step()
        optimizer.clear_grad()
        if schedule is not None:
            schedule.step()
        mine = float(np.mean([m._local_value().numpy() for m in micro])) if micro else 0.0
        total = paddle.to_tensor([mine, float(bool(micro))], dtype="float64")
        dist.all_reduce(total)
        losses.append(float(total[0] / total[1]))
    return losses


def run_bad_plan(case: BadPlanCase, rank: int, let_escape: bool) -> dict:
    from autodist import PlanError, apply_plan

    workload = WORKLOADS[case.rank_workloads[rank] if case.rank_workloads else case.workload]
    plan = case.rank_plans[rank] if case.rank_plans else case.plan
    model = workload.build(seed=0)
    if case.die_on_rank == rank:
        die_when_validated(model)
    if case.late_reader_rank == rank:
        read_the_verdict_late()
    optimizer, _ = make_optimizer("sgd", model.parameters())
    loader = make_loader(workload, steps=1, seed=0)
    before = _identity(model, optimizer)
    start = time.perf_counter()
    try:
        with fail_when_sharding() if case.fail_applying_rank == rank else nullcontext():
            apply_plan(model, optimizer, loader, plan)
    except PlanError as exc:
        if let_escape:
            raise
        return {
            "error": "PlanError",
            "message": str(exc),
            "seconds": time.perf_counter() - start,
            "untouched": _identity(model, optimizer) == before,
        }
    except Exception as exc:  # recorded, so the test names what was raised instead
        return {"error": type(exc).__name__, "message": str(exc), "seconds": time.perf_counter() - start}
    return {"error": None, "message": "apply_plan accepted the plan", "seconds": time.perf_counter() - start}


def die_when_validated(model) -> None:
    """TEST-ONLY: SIGKILL this rank when apply_plan reads the model's parameters (its local
    checks), as a rank killed during apply_plan would die."""

    def die(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGKILL)

    model.named_parameters = die


@contextmanager
def fail_when_sharding():
    """TEST-ONLY: make ``apply_plan`` raise on this rank when it starts sharding, after the ranks
    agreed on the plan, as a rank that fails while applying it would."""
    import autodist.applier.apply as apply_module

    def fail(*args, **kwargs):
        raise RuntimeError("TEST-ONLY: this rank failed while sharding")

    shard = apply_module.shard_parameters
    apply_module.shard_parameters = fail
    try:
        yield
    finally:
        apply_module.shard_parameters = shard


#: How long a late reader sleeps before it reads the agreement's verdict: longer than the fixed
#: 10 s rank 0 once waited for it (e18c214), which lost such a rank the verdict.
LATE_READ_S = 12.0


def read_the_verdict_late() -> None:
    """TEST-ONLY: this rank, having sent its record, sleeps ``LATE_READ_S`` before it reads the
    verdict, as a rank descheduled on a loaded machine would."""
    import autodist.applier.ranks.agree as agree_module

    await_verdict = agree_module._await_verdict

    def late(*args, **kwargs):
        time.sleep(LATE_READ_S)
        return await_verdict(*args, **kwargs)

    agree_module._await_verdict = late


def _identity(model, optimizer) -> list:
    """What a refused plan must leave alone: the same parameter objects, still dense, still the
    optimizer's."""
    return [(fqn, id(p), p.is_dist()) for fqn, p in model.named_parameters()] + [
        id(p) for p in optimizer._parameter_list
    ]


def main(job_path: str) -> None:
    job = Job.load(job_path)
    rank, world = rank_and_world()
    if "FLAGS_selected_gpus" in os.environ:  # an nccl job (launcher.rank_env): one GPU per rank
        paddle.set_device(f"gpu:{os.environ['FLAGS_selected_gpus']}")
    for run in job.train:
        run_training(run, rank, world, job.out_dir)
    if job.bad_plans:
        results = {case.name: run_bad_plan(case, rank, job.let_plan_error_escape) for case in job.bad_plans}
        (Path(job.out_dir) / f"bad_plans.rank{rank}.json").write_text(json.dumps(results))


def leave() -> NoReturn:
    """End this rank once its work is written: Python's exit functions run as at any exit
    (apply_plan's wait for peers still reading this rank's losses, Paddle's own clear-ups), then
    the process ends without the interpreter's and Paddle's C++ teardown, which took 1.3-1.8 s
    of every rank at the end of every job (2 ranks, load 9: docs/benchmarks.md). What the
    test reads is written by then; a rank that fails raises before this and exits as before.
    The scripts of tests/loops are run as users run them, with the whole teardown."""
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1])
    leave()
