"""``autodist-plan calibrate``: measure this cluster and write the cluster.toml ``--cluster`` reads.

Launched like training, one process per device::

    python -m paddle.distributed.launch --nproc_per_node 2 -m autodist.planner.cli calibrate \\
        --plan plan.json -o cluster.toml
    autodist-plan plan model.py --nproc-per-node 2 --cluster cluster.toml -o plan.json

Run in one process it measures the device only (no collectives). With ``--model model.py``
(and ``--plan``) it also trains the model a few steps under the plan and fits the framework's
time per op a real step shows (``dispatch_overhead_us``), so the plan's estimate matches what
training measures here. The measuring and fitting live in :mod:`autodist.planner.cost.calibrate`.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
from typing import Callable

import click

from autodist.schemas.describe import strategy_text
from autodist.schemas.inputs import parse_toml
from autodist.schemas.io import write_atomically

from autodist.planner.cli.review import check_output
from autodist.planner.errors import PlannerError


@click.command()
@click.option(
    "--plan",
    "plan_file",
    type=click.Path(exists=True, dir_okay=False),
    help="Measure matmuls at this plan's per-rank shapes (else only square ones).",
)
@click.option(
    "-o",
    "--output",
    type=click.Path(dir_okay=False),
    default="cluster.toml",
    show_default=True,
    help="cluster.toml to write (rank 0 writes it).",
)
@click.option(
    "--base",
    metavar="PROFILE",
    help="Profile for the figures not measured (default: the planner's for this machine: its GPU's, "
    "h100-sxm for a GPU without a profile, cpu without a GPU).",
)
@click.option(
    "--dtype", type=click.Choice(["bf16", "fp16", "fp32"]), help="Matmul dtype (default: bf16 on a GPU, fp32 on CPU)."
)
@click.option("--name", help="Name of the measured profile (default: <base>-measured).")
@click.option(
    "--model",
    "model_target",
    metavar="TARGET",
    help="The plan's model (model.py, model.py:factory): train it a few steps under --plan and "
    "fit dispatch_overhead_us to the measured step.",
)
def calibrate(
    plan_file: str | None, output: str, base: str | None, dtype: str | None, name: str | None, model_target: str | None
) -> None:
    """Measure matmuls, memory and collectives here and write a fitted cluster.toml: in order,
    the matmuls and memory, the collectives (:func:`_measure_collectives`), the overlap of
    compute and communication (:func:`_measure_overlap`), the plan's own training step
    (:func:`_measure_step`); then rank 0 fits and writes (:func:`_write_fitted`)."""
    check_output(output)  # before measuring, not after
    import paddle
    import paddle.distributed as dist

    from autodist.planner.cost import calibrate as cal

    profile, dtype, on_gpu = machine_defaults(base, dtype)
    plan, plan_shapes = _checked_plan(plan_file, model_target)
    shapes = [(s, s, s) for s in cal.SQUARE_SIZES]
    if plan is not None:
        shapes = sorted({*shapes[:2], *plan_shapes})

    world = int(os.environ.get("PADDLE_TRAINERS_NUM", "1"))
    local = int(os.environ.get("PADDLE_LOCAL_SIZE", str(world)))
    rank, nodes, groups = _process_groups(world, local, plan)
    mesh = dist.ProcessMesh(list(range(world)), dim_names=["x"]) if world > 1 else None
    measured = cal.Measurements(
        matmuls=cal.measure_matmuls(shapes, dtype, mesh), memory=cal.measure_memory(dtype, mesh)
    )
    notes = [f"{world} rank(s), {len(nodes)} node(s) of {local}; matmuls in {dtype}; paddle {paddle.__version__}"]
    if world > 1:
        notes += _measure_collectives(plan, groups, rank, local, measured)
    if len(nodes) < 2:
        notes.append("one node: the inter-node link is not measured (the base profile's figures are kept)")
    _measure_overlap(plan, shapes, dtype, on_gpu, groups, rank, world, local, measured)
    timed = _measure_steps(model_target, plan, world, measured) if model_target else []
    if rank == 0:
        _write_fitted(output, measured, notes, profile, dtype, name, on_gpu, model_target, timed)


def _measure_collectives(plan, groups: dict, rank: int, local: int, measured) -> list[str]:
    """Time the collectives inside and across nodes, then on each of the plan's own groups at
    the plan's own message sizes; the notes saying which groups."""
    import paddle.distributed as dist

    from autodist.planner.cost import calibrate as cal

    dist.barrier()
    mine = {"intra": rank // local, "inter": rank % local}
    messages = cal.plan_messages(plan) if plan is not None else {}
    for scope, members in groups.items():
        group, ranks = members[mine[scope]] if scope in mine else next(m for m in members if rank in m[1])
        if len(ranks) > 1:
            where = scope if scope in mine else "intra" if len({r // local for r in ranks}) == 1 else "inter"
            cal.measure_collectives(group, ranks, where, rank, measured)
            if scope in messages:  # and what the plan's collectives move on this axis
                only, sizes = messages[scope]
                cal.measure_collectives(group, ranks, where, rank, measured, sizes, only)
        dist.barrier()
    axes = [scope for scope in groups if scope not in mine]
    if not axes:
        return []
    return [
        "also measured on the plan's own groups, each axis's groups at once as training runs them: "
        + "; ".join(f"{axis} {[ranks for _, ranks in groups[axis]]}" for axis in axes)
    ] + [
        f"the plan's own messages over {axis}: {', '.join(only)} of {', '.join(map(str, sizes))} bytes"
        for axis, (only, sizes) in messages.items()
        if axis in axes
    ]


def _measure_overlap(plan, shapes, dtype: str, on_gpu: bool, groups: dict, rank: int, world: int, local: int, measured):
    """A matmul beside asynchronous all-reduces (on GPUs; gloo's cannot overlap, which is said):
    beside the plan's data-parallel gradients where it has a dp group, else the node's."""
    from autodist.planner.cost import calibrate as cal

    cannot_overlap = cal.overlap_unmeasurable(on_gpu, world)
    if cannot_overlap:
        measured.missing.append(cannot_overlap)
        return
    shape, nbytes = cal.overlap_probe(plan, shapes)
    group = next((g for g, ranks in groups.get("dp", []) if rank in ranks), groups["intra"][rank // local][0])
    measured.overlap = (*shape, nbytes, *cal.measure_overlap(shape, dtype, nbytes, group))


def _measure_steps(model_target: str, plan, world: int, measured) -> list:
    """A few real training steps of the plan under its own schedule and of its siblings of the
    other kinds (:func:`autodist.planner.cost.calibrate.sibling_degrees`, planned here on every
    rank alike), each run on a model built afresh, the plans alternating for
    :data:`~autodist.planner.cost.calibrate.TRAINING_ROUNDS` rounds (each plan's median round
    kept); the plans timed, the plan's first. What cannot be
    timed (what this backend lacks, a sibling the planner refuses) is said once, in the file and
    on stderr, and the rest is fitted all the same."""
    from autodist.planner.cost import calibrate as cal

    cannot = untimeable(plan, _running_backend())
    if cannot:
        measured.missing.append(cannot)
        return []
    timed = [plan]
    for dp, mp in cal.sibling_degrees(plan.strategy):
        sibling = _sibling_plan(model_target, plan, dp, mp)
        if isinstance(sibling, str):
            measured.missing.append(sibling)
        else:
            timed.append(sibling)
    rounds: list[list[float]] = [[] for _ in timed]
    for _ in range(cal.TRAINING_ROUNDS):  # alternating: the machine's drifting load on every plan alike
        for each, times in zip(timed, rounds):
            times.append(_timed_steps(model_target, each, world))
    seconds = [statistics.median(times) for times in rounds]
    measured.training_step = seconds[0]
    measured.siblings = [cal.SiblingStep(strategy_text(p.strategy, "short"), s) for p, s in zip(timed[1:], seconds[1:])]
    return timed


def _timed_steps(model_target: str, plan, world: int) -> float:
    """The median training step of ``plan`` on a model built afresh (apply_plan shards the model it gets)."""
    import paddle.distributed as dist

    from autodist.planner.cost import calibrate as cal
    from autodist.planner.driver import load

    loaded = load(model_target, _plan_input_specs(plan))
    if world > 1:
        dist.barrier()
    return _timed_by_the_model(
        model_target, lambda: cal.measure_training_step(loaded.model, plan, loaded.input_specs, loaded.loss_fn)
    )


def _sibling_plan(model_target: str, plan, dp: int, mp: int):
    """The plan's sibling of degrees ``dp`` and ``mp``, planned for the same ranks, stages and
    training (without sequence parallelism where mp is 1), or why there is none."""
    from autodist.planner.driver import plan_target

    parallel = plan.strategy.sequence_parallel and mp > 1
    request = _plan_request(plan, plan.cluster.device, dp=dp, mp=mp, sequence_parallel=parallel)
    try:
        sibling = plan_target(model_target, _plan_input_specs(plan), request, dict(plan.provenance.arguments)).plan
    except PlannerError as err:
        return (
            f"the plan's sibling dp{dp} x mp{mp}: {' '.join(str(err).split())[:300]} (its kind priced with the plan's)"
        )
    cannot = untimeable(sibling, _running_backend())
    return f"the plan's sibling dp{dp} x mp{mp}: {cannot}" if cannot else sibling


def _write_fitted(
    output: str, measured, notes: list[str], profile, dtype: str, name: str | None, on_gpu: bool, model_target, timed
) -> None:
    """Fit the device to what was measured and write it (rank 0): with ``timed`` plans (the
    plan and its siblings, :func:`_measure_steps`), each priced on the fitted device first, then
    the time per op of each one's kind fitted to its measured step."""
    from autodist.planner.cost import calibrate as cal
    from autodist.planner.cost.hardware import device_profile

    name = name or f"{profile.name}-measured"
    device = cal.fitted_device(measured, profile, dtype, name, comm_overlap=on_gpu)
    text = cal.cluster_toml(device, measured, notes + [f"not measured: {m}" for m in measured.missing])
    if timed:
        # Price the plans on what was measured (the file not written yet), then fit the dispatch.
        tables = parse_toml(text.encode(), output, what="cluster file")
        pricers = _plan_pricers(model_target, timed, device_profile(tables, output))
        measured.priced_step = pricers[0](0.0)
        for sibling, pricer in zip(measured.siblings, pricers[1:]):
            sibling.priced_step = pricer(0.0)
        steps = [measured.training_step, *(s.training_step for s in measured.siblings)]
        dispatch = cal.fit_dispatches([(p.strategy.dp, p.strategy.mp, s, f) for p, s, f in zip(timed, steps, pricers)])
        device = cal.fitted_device(measured, profile, dtype, name, comm_overlap=on_gpu, dispatch=dispatch)
        notes += [
            f"a training step of {model_target} under {strategy_text(p.strategy, 'short')} took {s * 1e3:.1f} ms, "
            f"priced {f(0.0) * 1e3:.1f} ms without the framework's time per op"
            for p, s, f in zip(timed, steps, pricers)
        ]
        text = cal.cluster_toml(device, measured, notes + [f"not measured: {m}" for m in measured.missing])
    write_atomically(output, text.encode())  # the one file writer: no temp file outlives it
    click.echo(
        f"wrote {output}: {', '.join(f'{k}={v}' for k, v in device.items() if k not in ('name', 'base'))}", err=True
    )
    for missing in measured.missing:
        click.echo(f"not measured: {missing}", err=True)


def machine_defaults(base: str | None, dtype: str | None):
    """``(base profile, matmul dtype, comm_overlap)`` for this machine, by the planner's rule for
    its device (:func:`~autodist.planner.cost.hardware.default_device`: its GPU's profile,
    ``h100-sxm`` for a GPU without one, ``cpu`` without a GPU). A GPU runs NCCL, which overlaps
    collectives with compute, and measures bf16; the CPU runs gloo, in fp32.

    >>> machine_defaults("a100-80g", "fp16")[:2]  # doctest: +ELLIPSIS
    (DeviceProfile(name='a100-80g', ...), 'fp16')
    """
    from autodist.planner.cost.hardware import default_device, resolve_device

    machine = default_device()[0]
    on_gpu = machine != "cpu"
    return resolve_device(base or machine), dtype or ("bf16" if on_gpu else "fp32"), on_gpu


def _checked_plan(plan_file: str | None, model_target: str | None):
    """The ``--plan`` (None without one) and the shapes of its matmuls, refused as one readable
    line when it cannot be read or when ``--model`` cannot run its training steps."""
    from autodist.planner.cost import calibrate as cal
    from autodist.schemas import load_plan

    plan, shapes = None, []
    if plan_file:
        try:
            plan = load_plan(plan_file)
            shapes = cal.plan_gemm_shapes(plan)
        except Exception as err:  # PlanError and friends: one readable line
            raise PlannerError(f"{plan_file}: {err}") from None
    if model_target and plan is None:
        raise PlannerError("--model needs --plan: the training steps run that plan")
    return plan, shapes


def untimeable(plan, backend: str) -> str:
    """Why the training steps of ``plan`` cannot be timed on ``backend`` (what the plan needs that
    the backend lacks: schemas/backend.py, the owner of both facts), or ''. calibrate then says
    so and fits the rest: it never times a stand-in as if it were what the plan runs.

    >>> from autodist.schemas.plan import Strategy
    >>> class Plan: strategy = Strategy(pp=2, micro_batches=2, schedule="1F1B")
    >>> untimeable(Plan(), "gloo")  # doctest: +ELLIPSIS
    'training steps under the plan: the 1F1B schedule needs batched P2P (...), which the gloo backend lacks (...)'
    >>> untimeable(Plan(), "nccl")
    ''
    """
    from autodist.schemas.parallel_dims import LACKS, OPERATIONS, needs_missing

    lacks = LACKS.get(backend, {})
    problems = [
        f"{feature} needs {OPERATIONS[operation]}, which the {backend} backend lacks ({lacks[operation]})"
        for feature, operation in needs_missing(plan.strategy, lacks)
    ]
    return f"training steps under the plan: {'; '.join(problems)}" if problems else ""


def _running_backend() -> str:
    """The collectives backend this job runs on (``apply_plan``'s rule: applier/placement/backend.py)."""
    from autodist.applier.placement.backend import running_backend

    return running_backend()


def _process_groups(world: int, local: int, plan=None) -> tuple[int, list[list[int]], dict[str, list]]:
    """``(this rank, the ranks of each node, {scope: [(group, its ranks)]})``: the process groups
    the collectives are timed in, made first, on every rank in the same order, before the ranks'
    timings drift apart. Scopes ``intra`` and ``inter`` (one node: the intra-node group is the
    whole world, the default group), and with a plan for these ranks one per mesh axis of its
    (``mp``, ``dp``: :func:`autodist.planner.cost.calibrate.plan_groups`)."""
    import paddle.distributed as dist

    from autodist.applier.placement.mesh import new_group  # one group at a time: gloo fails on groups made back to back
    from autodist.planner.cost.calibrate import plan_groups

    rank, nodes, groups = 0, [list(range(world))], {}
    if world > 1:
        dist.init_parallel_env()
        rank = dist.get_rank()
        nodes = [list(range(n * local, (n + 1) * local)) for n in range(world // local)]
        if len(nodes) > 1:
            groups["intra"] = [(new_group(ranks), ranks) for ranks in nodes]
            groups["inter"] = [
                (new_group([node[i] for node in nodes]), [node[i] for node in nodes]) for i in range(local)
            ]
        else:
            groups["intra"] = [(None, nodes[0])]
        if plan is not None and len(plan.mesh.process_ids) == world:
            for axis, lists in plan_groups(plan).items():
                groups[axis] = [(new_group(ranks), ranks) for ranks in lists]
        dist.barrier()
    return rank, nodes, groups


def _timed_by_the_model(target: str, measure: Callable[[], float]) -> float:
    """Run ``measure`` (training steps of the user's model): a ``sys.exit`` in the model's code
    or an exception it raises is one :class:`PlannerError` naming the model, not a silent exit 0
    or a traceback."""
    from autodist.planner.load import user_code  # imports Paddle: not at the command line's start

    with user_code(target):
        try:
            return measure()
        except PlannerError:
            raise
        except Exception as err:
            raise PlannerError(
                f"{target}: a training step under the plan raised {type(err).__name__}: {' '.join(str(err).split())[:300]}"
            ) from None


def _plan_input_specs(plan) -> list[str] | None:
    """The ``--input-spec`` strings the plan was made with, if any (else the model file's own)."""
    given = plan.provenance.arguments.get("input_specs")
    return given.split(",") if given else None


def _plan_request(plan, device, **changes):
    """The search request that makes ``plan`` (its degrees and training as it records them) on
    ``device``, with ``changes`` (another strategy's degrees)."""
    from autodist.planner.cost.search import SearchRequest

    arguments, s = plan.provenance.arguments, plan.strategy
    request = SearchRequest(
        devices_per_node=plan.cluster.devices_per_node,
        nodes=plan.cluster.nodes,
        device=device,
        dp=s.dp,
        mp=s.mp,
        pp=s.pp,
        sequence_parallel=s.sequence_parallel,
        sharding_stage=s.sharding_stage,
        micro_batches=s.micro_batches,
        schedule=None if s.schedule == "none" else s.schedule,
        global_batch_size=plan.data.global_batch_size or None,
        seq_len=int(arguments["seq_len"]) if "seq_len" in arguments else None,
        dtype=arguments.get("dtype"),  # not recorded: the model's
        optimizer=arguments.get("optimizer", "adam"),
        recompute=s.recompute,
        ep=s.ep,
        attention=arguments.get("attention", "auto"),
    )
    return dataclasses.replace(request, **changes)


def _plan_pricers(model_target: str, plans: list, device) -> list[Callable[[float], float]]:
    """For each of ``plans`` (of one model), ``td -> seconds``: its own strategy priced on
    ``device`` with ``td`` seconds of framework time per op for its kind of strategy
    (:func:`autodist.planner.cost.compute.dispatch_kind`), from one fresh trace of the model
    (traced and priced once)."""
    from msgspec.structs import replace

    from autodist.planner import driver
    from autodist.planner.cost.compute import DISPATCH_KINDS, dispatch_kind
    from autodist.planner.cost.search import kernels_for, price, search

    loaded = driver.load(model_target, _plan_input_specs(plans[0]))
    traced = driver.trace(loaded.model, loaded.input_specs)
    analysis = driver.analyse(loaded.model, traced)
    requests = [_plan_request(plan, device) for plan in plans]
    priced = price(analysis, kernels_for(analysis, requests[0]))  # the kernels this device runs (planner/kernels.py)

    def pricer(request) -> Callable[[float], float]:
        def priced_step(dispatch_s: float) -> float:
            device_td = replace(device, **{DISPATCH_KINDS[dispatch_kind(request.dp, request.mp)]: dispatch_s})
            return search(priced, dataclasses.replace(request, device=device_td)).best.estimate.step_time_s

        return priced_step

    return [pricer(request) for request in requests]
