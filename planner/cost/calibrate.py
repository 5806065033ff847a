"""Measure the user's own devices and links, and fit the figures the cost model uses.

``autodist-plan calibrate`` runs this on every rank of a job launched like training
(``python -m paddle.distributed.launch --nproc_per_node N -m autodist.planner.cli calibrate ...``):

- matmuls at the per-rank shapes a plan will run (each 2-D parameter as a (k, n) weight,
  divided as its placements divide it, times the plan's tokens per micro-batch), plus a few
  square ones; the fit of :mod:`autodist.planner.cost.compute`'s ``time = FLOPs / R + t0``
  by least squares gives the sustained rate R (``matmul_efficiency`` = R / peak) and ``t0``;
- memory bandwidth: an elementwise add of two large tensors (three passes over its size);
- collectives at a few sizes, inside a node (the ranks of one node) and across nodes (one
  rank per node), and with a plan on its own groups too (:func:`plan_groups`: its mp groups,
  its dp groups, each axis's groups at once as training runs them; the file's notes name them),
  all into the fit of the link they lie on: all-reduce, all-gather, reduce-scatter, send/recv; the alpha-beta ring
  formulas of :mod:`autodist.planner.cost.comm` fitted by least squares give each link's
  latency and bandwidth, and with groups of two sizes (a plan's pairs and the whole node) how
  much the latency of a step grows per rank (:func:`fit_link`); with a plan, also at the plan's
  own message sizes (:func:`plan_messages`). Small messages are sent :data:`BACK_TO_BACK` per
  timing, so that the barrier closing each timing does not count as much as the collective.
  What the backend lacks (gloo has no reduce-scatter on CPU) is reported as missing, never
  replaced by something else.

- the compute a collective costs while it runs beside a matmul (``overlap_compute_loss``, the
  estimate's :func:`~autodist.planner.cost.step_time.overlapped`): on GPUs (NCCL), a matmul at
  the plan's largest per-rank shape timed on its own stream alone and while all-reduces of the
  plan's largest data-parallel message run asynchronously on NCCL's
  (:func:`measure_overlap`), loss = 1 - alone / beside (:func:`overlap_loss_from`). Not on
  gloo: it runs each collective on the thread that computes (``comm_overlap`` false), so no
  matmul can run beside one; the base profile's figure is kept and the file says why
  (:func:`overlap_unmeasurable`);

- with ``--model``, real training steps of the user's model under the plan (``apply_plan``, the
  traced inputs at random, forward, the mean of the first output as the loss, backward, AdamW),
  timed on every rank at once as training runs them; the framework's time per op that the
  pieces above do not explain is fitted (:func:`fit_dispatch`; its meaning in
  :mod:`autodist.planner.cost.compute`), so that the plan's priced step equals the measured one.
  That time depends on the kind of strategy (data, tensor or hybrid parallel:
  :data:`autodist.planner.cost.compute.DISPATCH_KINDS`), so the plan's siblings of the other
  kinds on the same ranks (:func:`sibling_degrees`: dp2 x mp2's are dp4 and mp4) are planned and
  timed too, and each kind gets the time its own steps left (:func:`fit_dispatches`); every
  other strategy is priced with its kind's, a kind not timed with the plan's.

Rank 0 writes ``cluster.toml``: the ``[device]`` table ``--cluster`` reads (fitted figures; the
ones not measurable here, such as memory size or, on one node, the inter-node link, come from
``base``), and a ``[measured]`` table with every raw timing, so the fit can be checked.

Example::

    >>> [round(v, 9) for v in fit_line([(1.0, 3.0), (2.0, 5.0), (3.0, 7.0)])]   # y = 1 + 2 x
    [1.0, 2.0]
"""

from __future__ import annotations

import math
import statistics
import time
import warnings
from dataclasses import dataclass, field
from typing import Callable

from autodist.planner.cost.comm import vocab_lookup_collective
from autodist.schemas.vocabulary import TRAINING_DTYPES, local_shape, shard_dim, training_bytes

#: Message sizes for the collectives (bytes): latency-bound to bandwidth-bound.
COLLECTIVE_BYTES = (4 * 1024, 256 * 1024, 4 * 1024 * 1024, 16 * 1024 * 1024)
#: The largest of a plan's own messages measured (bytes): a larger one is measured at this size.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
#: How many times a message of at most 1 MiB is sent back to back in one timing (each timing
#: ends with a barrier on the group, which would otherwise double a small collective's time).
BACK_TO_BACK = 4
#: Square matmuls measured without a plan; with one, only the two smallest, which pin the
#: fixed cost per op while the plan's own shapes pin the rate.
SQUARE_SIZES = (64, 256, 512, 1024)
#: Training steps timed by ``--model`` after one warm-up step (which builds Paddle's caches).
TRAINING_STEPS = 5
#: Times each plan ``--model`` trains (the plan and its siblings) is timed, the plans alternating
#: round after round as bench/search_quality.py alternates them, so that a machine whose load
#: drifts slows every kind of strategy alike; each plan's median round is fitted.
TRAINING_ROUNDS = 3
#: Largest matmul step measured (FLOPs, forward and backward): keeps a calibration on a slow
#: device to seconds; a larger plan shape is measured with fewer tokens (rows).
MAX_MATMUL_FLOPS = 4e10
#: Matmuls timed back to back, alone and beside collectives, for ``overlap_compute_loss``.
OVERLAP_MATMULS = 20
#: The largest loss a measurement may give: at 1 the matmul would stop while a collective runs,
#: which a GPU beside NCCL never does; so high a value is a broken timing, and the loss stays < 1.
MAX_OVERLAP_LOSS = 0.99


@dataclass
class SiblingStep:
    """A training step of one of the plan's siblings (:func:`sibling_degrees`): its strategy in
    words, the median step measured and the step priced with no framework time per op."""

    strategy: str
    training_step: float
    priced_step: float | None = None


@dataclass
class Measurements:
    """Raw timings (seconds, medians over repeats) and what could not be measured."""

    matmuls: list[tuple[int, int, int, float]] = field(default_factory=list)  # (m, n, k, s)
    memory: list[tuple[int, float]] = field(default_factory=list)  # (bytes moved, s)
    #: (scope, collective, ranks) -> [(bytes, s)]; scope "intra" or "inter"
    collectives: dict[tuple[str, str, int], list[tuple[int, float]]] = field(default_factory=dict)
    missing: list[str] = field(default_factory=list)
    training_step: float | None = None  # seconds, the median real step with --model
    priced_step: float | None = None  # seconds, the plan priced with the fitted figures, td = 0
    #: The same for the plan's siblings of the other kinds timed (:func:`sibling_degrees`).
    siblings: list[SiblingStep] = field(default_factory=list)
    #: (m, n, k, collective bytes, s alone, s beside): :data:`OVERLAP_MATMULS` matmuls of one
    #: shape alone and beside all-reduces of that size (:func:`measure_overlap`); None: not measured.
    overlap: tuple[int, int, int, int, float, float] | None = None


def fit_line(points: list[tuple[float, float]], relative: bool = False) -> tuple[float, float]:
    """Least-squares (intercept, slope) of y = a + b x, the intercept clamped at 0. ``relative``
    weighs each point by 1 / y^2 (relative errors), so small timings count as much as large ones.

    >>> [round(v, 9) for v in fit_line([(1.0, 3.0), (2.0, 5.0), (3.0, 7.0)], relative=True)]
    [1.0, 2.0]
    """
    w = [1.0 / (y * y) if relative and y > 0 else 1.0 for _, y in points]
    sw = sum(w)
    mx = sum(wi * x for wi, (x, _) in zip(w, points)) / sw
    my = sum(wi * y for wi, (_, y) in zip(w, points)) / sw
    sxx = sum(wi * (x - mx) ** 2 for wi, (x, _) in zip(w, points))
    slope = sum(wi * (x - mx) * (y - my) for wi, (x, y) in zip(w, points)) / sxx if sxx > 0 else my / mx
    intercept = my - slope * mx
    if intercept < 0:  # a negative fixed cost is noise: refit through the origin
        intercept = 0.0
        slope = sum(wi * x * y for wi, (x, y) in zip(w, points)) / sum(wi * x * x for wi, (x, _) in zip(w, points))
    return intercept, slope


def timed(run: Callable[[], object], sync: Callable[[], object], repeats: int = 5) -> float:
    """Median seconds of ``run`` after one warm-up, ``sync`` closing each timing."""
    run()
    sync()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        sync()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def plan_gemm_shapes(plan) -> list[tuple[int, int, int]]:
    """Per-rank (m, n, k) of the matmuls a plan runs: every 2-D parameter as a (k, n) weight,
    divided over the mesh axes its placements shard, m = tokens per micro-batch per rank."""
    mesh, tokens = plan.mesh, plan_tokens(plan)
    shapes = set()
    for param in plan.params.values():
        if len(param.shape) != 2:
            continue
        k, n = local_shape(param.shape, param.placements, mesh.shape)
        shapes.add((tokens, n, k))
    return sorted(shapes)


def plan_tokens(plan) -> int:
    """Tokens of one micro-batch on one rank: the traced batch and sequence over dp and micro-batches."""
    spec = plan.model.input_specs[0].shape if plan.model.input_specs else [1, 1]
    batch, seq = (max(d, 1) for d in (list(spec) + [1, 1])[:2])
    return max(1, batch * seq // (plan.strategy.dp * plan.strategy.micro_batches))


def plan_messages(plan, most: int = 3) -> dict[str, tuple[tuple[str, ...], list[int]]]:
    """What the plan's collectives move, per mesh axis: ``{axis: (collectives, message bytes)}``,
    as the cost model prices them (:mod:`autodist.planner.cost.step_time`): over ``dp`` one
    gradient per parameter (all-reduce; reduce-scatter and all-gather under ZeRO), each its
    local size; over ``mp`` the partial outputs of the row-parallel linears (all-reduce; with
    sequence parallelism a reduce-scatter and an all-gather, which the ring prices as one
    all-reduce), tokens of a micro-batch by output features, the column-parallel LM head's input
    gradient (all-reduce, tokens by input features), and the vocabulary-split embedding's lookup:
    its output (all-reduce, tokens by hidden) where the plan looks it up on local tensors
    (``plan.vocab_lookup``), else its whole table, which the lookup gathers
    (:func:`autodist.planner.cost.comm.vocab_lookup_collective`). Each collective an axis names
    is measured at each of its sizes. At most ``most`` sizes an axis (the smallest, the median
    and the largest), each at most :data:`MAX_MESSAGE_BYTES`.

    >>> plan = load_plan_for_doctest("plans/llama_docstring/plan_8dev.json")   # dp4 x mp2, fp32
    >>> plan_messages(plan)["mp"]   # 1024 tokens by 2048 features (a row's output, the local lookup's), 4 bytes each
    (('all_reduce',), [8388608])
    """
    width = training_bytes(plan.provenance.arguments.get("dtype", "bf16"))  # not recorded: the old default
    sizes: dict[str, set[int]] = {"dp": set(), "mp": set()}
    mp_names: set[str] = set()
    for fqn, param in plan.params.items():
        local = local_shape(param.shape, param.placements, plan.mesh.shape)
        sizes["dp"].add(math.prod(local) * width)
        split = next((dim for p in param.placements if (dim := shard_dim(p)) is not None), None)
        if split is None or len(param.shape) != 2:
            continue
        if param.style == "VocabParallelEmbedding":
            looked_up_locally = any(lookup.weight == fqn for lookup in plan.vocab_lookup)
            output = plan_tokens(plan) * param.shape[1] if looked_up_locally else 0
            lookup = vocab_lookup_collective(math.prod(param.shape), output, width)
            sizes["mp"].add(int(lookup.nbytes))
            mp_names.add(lookup.name)
        if param.style == "RowWiseParallel" or param.style == "ColWiseParallelHead" or param.tied_to:
            # a row-parallel output, or the head's input gradient: the dim not split
            sizes["mp"].add(plan_tokens(plan) * param.shape[1 - split] * width)
            mp_names.add("all_reduce")
    along = dict(zip(plan.mesh.axes, plan.mesh.shape))
    names: dict[str, tuple[str, ...]] = {
        "dp": ("all_reduce",) if not plan.strategy.sharding_stage else ("reduce_scatter", "all_gather"),
        "mp": tuple(sorted(mp_names)),
    }
    out: dict[str, tuple[tuple[str, ...], list[int]]] = {}
    for axis, found in sizes.items():
        ordered = sorted(min(b, MAX_MESSAGE_BYTES) for b in found if b > 0)
        if along.get(axis, 1) > 1 and ordered:
            picked = sorted({ordered[0], ordered[len(ordered) // 2], ordered[-1]})[:most]
            out[axis] = (names.get(axis, ("all_reduce",)), picked)
    return out


def load_plan_for_doctest(path: str):
    """A checked-in plan, by its path in the repository (for the examples here)."""
    from pathlib import Path

    from autodist.schemas import load_plan

    return load_plan(Path(__file__).resolve().parents[2] / path)


def measure_matmuls(shapes: list[tuple[int, int, int]], dtype: str, mesh=None) -> list[tuple[int, int, int, float]]:
    """Seconds per matmul as training runs them: forward and backward (three matmuls of the
    shape, with autograd), divided by three; with ``mesh``, on replicated distributed tensors as
    ``apply_plan``'s model runs them (so the auto-parallel dispatch each op pays is in the fixed cost)."""
    out = []
    for m, n, k in shapes:
        m = max(1, min(m, int(MAX_MATMUL_FLOPS / 3 / (2.0 * n * k))))  # fewer tokens when too long
        x, w = _tensor([m, k], dtype, mesh), _tensor([k, n], dtype, mesh)
        x.stop_gradient = w.stop_gradient = False

        def step():
            y = x.matmul(w)
            y.backward(y)  # any output gradient: dX = dY W^T, dW = X^T dY
            x.clear_gradient()
            w.clear_gradient()

        out.append((m, n, k, timed(step, _sync) / 3))
    return out


def measure_memory(dtype: str, mesh=None, elements: int = 1 << 24) -> list[tuple[int, float]]:
    out = []
    for n in (elements // 4, elements):
        a, b = _tensor([n], dtype, mesh), _tensor([n], dtype, mesh)
        out.append((3 * n * training_bytes(dtype), timed(lambda: a + b, _sync)))
    return out


def _tensor(shape: list[int], dtype: str, mesh):
    import paddle
    import paddle.distributed as dist

    tensor = paddle.rand(shape).astype(TRAINING_DTYPES[dtype])
    return dist.shard_tensor(tensor, mesh, [dist.Replicate()]) if mesh is not None else tensor


def measure_training_step(
    model, plan, input_specs: list, loss_fn: Callable | None = None, steps: int = TRAINING_STEPS
) -> float:
    """Median seconds of one optimizer step of ``model`` trained under ``plan`` by ``apply_plan``,
    on this rank (every rank calls it): the step ``examples/train.py`` runs, the one function
    :func:`autodist.applier.training.train_step` (the model file's loss, ``loss_fn`` or the one its
    forward computes from ``labels``; the loss read on every rank; backward; an AdamW step), on
    random token ids and their labels at the plan's global batch and sequence length. A model file
    that gives no loss or has no token table (:func:`autodist.applier.training.gives_loss`,
    :func:`~autodist.applier.training.vocab_size`) has no training script's step: its inputs at
    the traced shapes (random floats, zeros for ids) and the mean of its first output as the loss
    (what the planner traced and priced, plus a mean), in the same step. A plan that accumulates
    runs its micro-batches per step, as training does; a 1F1B / VPP plan runs its own schedule
    (``model.step``, forward and backward of every micro-batch), the mean of the output as the loss
    (``examples/train.py`` runs no schedule). Then ``close(model)``: several plans timed in one
    process (the plan and its siblings) each start from the process as apply_plan found it (its
    loss reading set up afresh, as that plan needs it)."""
    import paddle

    from autodist.applier import apply_plan, close
    from autodist.applier import training

    batch = plan.data.global_batch_size or max(input_specs[0].shape[0], 1)
    seq_len = plan.provenance.arguments.get("seq_len")  # priced at another length than traced
    scheduled = plan.strategy.pp > 1 and plan.strategy.schedule in ("1F1B", "VPP")
    # the token ids the training script's step takes, or None where there is no such step
    vocab = None if scheduled or not training.gives_loss(model, loss_fn) else training.vocab_size(model)
    if vocab is not None:
        seq = int(seq_len) if seq_len else max(input_specs[0].shape[1], 1)
        loader = training.token_loader(vocab, batch, seq, steps + 1, seed=0)
    else:
        loader = _traced_inputs(input_specs, batch, seq_len, steps + 1, scheduled)
    optimizer = paddle.optimizer.AdamW(learning_rate=1e-6, parameters=model.parameters())
    with warnings.catch_warnings():  # a lazily built model starts from other weights: no matter for timing
        warnings.filterwarnings("ignore", message="apply_plan: the model was built under paddle.LazyGuard")
        loss = {"loss_fn": lambda out, _target: out.mean()} if scheduled else {}
        model, optimizer, loader = apply_plan(model, optimizer, loader, plan, **loss)
    per_step = getattr(loader, "micro_batches", 1)  # a plan that accumulates: micro-batches per step
    loss_of = training.model_loss(model, loss_fn) if vocab is not None else _mean_of_first_output(model)
    ends = []
    for inputs in loader:
        if scheduled:
            model.step(*inputs[:-1], target=inputs[-1])
            optimizer.step()
            optimizer.clear_grad()
        else:
            training.train_step(loss_of, optimizer, inputs)
        _sync()
        ends.append(time.perf_counter())
    close(model)  # what apply_plan set up beyond the model: the next plan timed starts as its own training would
    ends = ends[per_step - 1 :: per_step]  # the end of each optimizer step; the first is warm-up
    return statistics.median(b - a for a, b in zip(ends, ends[1:]))


def _traced_inputs(input_specs: list, batch: int, seq_len, batches: int, scheduled: bool):
    """``batches`` batches of inputs of the traced shapes at ``batch`` and ``seq_len`` (random
    floats, zeros for ids); for a schedule, a last column as its target (on the last stage: unused)."""
    import paddle

    columns = []
    for spec in input_specs:
        shape = [batches * batch, *(max(d, 1) for d in spec.shape[1:])]
        if seq_len and len(shape) > 1:
            shape[1] = int(seq_len)
        dtype = str(spec.dtype).replace("paddle.", "")
        columns.append(paddle.zeros(shape, dtype) if "int" in dtype else paddle.rand(shape).astype(dtype))
    if scheduled:
        columns.append(paddle.zeros([batches * batch, 1], "float32"))
    return paddle.io.DataLoader(paddle.io.TensorDataset(columns), batch_size=batch, shuffle=False, drop_last=True)


def _mean_of_first_output(model) -> Callable:
    """``(inputs) -> loss``: the mean of the first output of ``model(*inputs)`` that is not None
    (a model returning ``(None, logits)`` without labels)."""

    def loss_of(inputs):
        out = model(*inputs)
        return (next(o for o in out if o is not None) if isinstance(out, (tuple, list)) else out).mean()

    return loss_of


def overlap_loss_from(alone_s: float, beside_s: float) -> float:
    """The fraction of compute speed lost beside a collective, from the same matmuls timed alone
    and beside it: ``1 - alone / beside``, clamped to [0, :data:`MAX_OVERLAP_LOSS`] (faster
    beside than alone is noise: 0).

    >>> round(overlap_loss_from(1.0, 1.25), 9), overlap_loss_from(1.0, 0.9), overlap_loss_from(1.0, 1e9)
    (0.2, 0.0, 0.99)
    """
    if alone_s <= 0 or beside_s <= 0:
        return 0.0
    return min(max(0.0, 1.0 - alone_s / beside_s), MAX_OVERLAP_LOSS)


def overlap_unmeasurable(comm_overlap: bool, world: int) -> str:
    """Why ``overlap_compute_loss`` cannot be measured here, or '': on gloo (``comm_overlap``
    false) a collective runs on the thread that computes, so no matmul runs beside it, and the
    estimate prices every collective exposed whatever the figure says
    (:func:`~autodist.planner.cost.compute.overlap_loss`); on one rank there is no collective.

    >>> overlap_unmeasurable(True, 8), overlap_unmeasurable(True, 1)[:40]
    ('', 'overlap_compute_loss: one rank, no colle')
    """
    if not comm_overlap:
        return (
            "overlap_compute_loss: this backend (gloo) runs each collective on the thread that computes, "
            "so no matmul runs beside one to time; the base profile's figure is kept (every collective is "
            "priced exposed here: comm_overlap = false)"
        )
    if world < 2:
        return "overlap_compute_loss: one rank, no collective to run beside a matmul; the base profile's figure is kept"
    return ""


def overlap_probe(plan, shapes: list[tuple[int, int, int]]) -> tuple[tuple[int, int, int], int]:
    """``(matmul shape, collective bytes)`` for :func:`measure_overlap`: the plan's largest
    per-rank matmul (``shapes``, its tokens capped as :func:`measure_matmuls` caps them) and its
    largest data-parallel message (:func:`plan_messages`: the gradients, the collectives the
    estimate overlaps with compute); without a dp axis, or a plan, the largest of
    :data:`COLLECTIVE_BYTES`.

    >>> overlap_probe(None, [(64, 64, 64), (1024, 1024, 1024)])
    ((1024, 1024, 1024), 16777216)
    """
    m, n, k = max(shapes, key=lambda s: s[0] * s[1] * s[2])
    shape = (max(1, min(m, int(MAX_MATMUL_FLOPS / 3 / (2.0 * n * k)))), n, k)
    messages = plan_messages(plan).get("dp") if plan is not None else None
    return shape, max(messages[1]) if messages else max(COLLECTIVE_BYTES)


def measure_overlap(shape: tuple[int, int, int], dtype: str, nbytes: int, group) -> tuple[float, float]:
    """``(seconds alone, seconds beside)`` of :data:`OVERLAP_MATMULS` matmuls of ``shape`` on
    this rank's GPU, alone and while all-reduces of ``nbytes`` run on ``group`` (every member
    calls this at once). The all-reduces are issued asynchronously (``sync_op=False``: NCCL's
    own stream), enough of them back to back to outlast the matmuls, then the matmuls, timed
    on the compute stream alone (its synchronize, not the device's). GPUs only: on gloo the
    asynchronous call runs the collective on the calling thread (:func:`overlap_unmeasurable`).
    Not run on the machine this was written on, which has no GPU (docs/benchmarks.md)."""
    import paddle
    import paddle.distributed as dist

    m, n, k = shape
    x, w = _tensor([m, k], dtype, None), _tensor([k, n], dtype, None)
    payload = paddle.rand([max(1, nbytes // 4)], dtype="float32")
    stream = paddle.device.current_stream()

    def matmuls() -> float:
        stream.synchronize()
        start = time.perf_counter()
        for _ in range(OVERLAP_MATMULS):
            x.matmul(w)
        stream.synchronize()
        return time.perf_counter() - start

    matmuls()  # warm-up
    alone = statistics.median(matmuls() for _ in range(3))
    one = timed(lambda: dist.all_reduce(payload, group=group), _sync, repeats=3)
    count = math.ceil(alone / max(one, 1e-9)) + 2
    beside = []
    for _ in range(3):
        dist.barrier(group=group)
        tasks = [dist.all_reduce(payload, group=group, sync_op=False) for _ in range(count)]
        beside.append(matmuls())
        for task in tasks:
            task.wait()
        _sync()
    dist.barrier(group=group)
    return alone, statistics.median(beside)


def fit_dispatch(measured_s: float, priced: Callable[[float], float], most_s: float = 1.0) -> float:
    """The framework's time per op, ``td`` seconds, at which the priced step equals the measured
    one. ``priced(td)``: the plan's step priced with that time per op, which grows with it (every
    op pays it). 0 when even ``td = 0`` prices the step at least as long as it ran; at most ``most_s``.

    >>> round(fit_dispatch(0.5, lambda td: 0.1 + 400 * td) * 1e6, 6)   # 400 ops: (0.5 - 0.1) / 400 s
    1000.0
    >>> fit_dispatch(0.05, lambda td: 0.1 + 400 * td)                 # priced above measured: nothing to add
    0.0
    """
    if priced(0.0) >= measured_s:
        return 0.0
    low, high = 0.0, 1e-6
    while priced(high) < measured_s and high < most_s:
        low, high = high, min(2 * high, most_s)
    for _ in range(60):  # bisection: priced is monotone, and piecewise linear where overlap hides comm
        middle = (low + high) / 2
        low, high = (middle, high) if priced(middle) < measured_s else (low, middle)
    return (low + high) / 2


def sibling_degrees(strategy) -> list[tuple[int, int]]:
    """``(dp, mp)`` of the plan's siblings: on the same ranks and stages, one strategy of each
    other kind (:func:`autodist.planner.cost.compute.dispatch_kind`), whose training steps give
    that kind's framework time per op: all dp, all mp, and dp pairs turned to mp 2 (hybrid; none
    where the ranks of a stage are odd or fewer than 4).

    >>> from autodist.schemas.plan import Strategy
    >>> sibling_degrees(Strategy(dp=2, mp=2)), sibling_degrees(Strategy(dp=4)), sibling_degrees(Strategy(dp=2))
    ([(4, 1), (1, 4)], [(2, 2), (1, 4)], [(1, 2)])
    """
    from autodist.planner.cost.compute import dispatch_kind

    ranks = strategy.dp * strategy.mp
    kinds = {(ranks, 1), (1, ranks)} | ({(ranks // 2, 2)} if ranks % 2 == 0 and ranks >= 4 else set())
    own = dispatch_kind(strategy.dp, strategy.mp)
    return sorted((k for k in kinds if dispatch_kind(*k) != own), key=lambda k: -k[0])


def fit_dispatches(timed: list[tuple[int, int, float, Callable[[float], float]]]) -> dict[str, float]:
    """The framework's time per op of each kind of strategy timed, as profile fields
    (:data:`autodist.planner.cost.compute.DISPATCH_KINDS`): ``timed`` is ``(dp, mp, measured
    step, priced(td))`` of each strategy, the plan's first, each kind fitted on its own steps
    (:func:`fit_dispatch`); ``dispatch_overhead_s``, for the kinds not timed, is the plan's.

    >>> hybrid = (2, 2, 0.5, lambda td: 0.1 + 400 * td)   # dp2 x mp2: 1 ms an op
    >>> dp = (4, 1, 0.3, lambda td: 0.1 + 400 * td)       # dp4: 0.5 ms an op
    >>> {k: round(v * 1e6, 3) for k, v in fit_dispatches([hybrid, dp]).items()}
    {'hybrid_dispatch_overhead_s': 1000.0, 'data_parallel_dispatch_overhead_s': 500.0, 'dispatch_overhead_s': 1000.0}
    """
    from autodist.planner.cost.compute import DISPATCH_KINDS, dispatch_kind

    fitted = {DISPATCH_KINDS[dispatch_kind(dp, mp)]: fit_dispatch(s, priced) for dp, mp, s, priced in timed}
    if timed:
        dp, mp = timed[0][:2]
        fitted["dispatch_overhead_s"] = fitted[DISPATCH_KINDS[dispatch_kind(dp, mp)]]
    return fitted


def plan_groups(plan) -> dict[str, list[list[int]]]:
    """The process groups the plan's collectives run on: per mesh axis (``mp``, ``dp``, ...) of
    more than one rank and fewer than all, the ranks that differ only along it.

    >>> from autodist.schemas import Mesh
    >>> class Plan: mesh = Mesh(axes=["dp", "mp"], shape=[2, 2], process_ids=[0, 1, 2, 3])
    >>> plan_groups(Plan())
    {'dp': [[0, 2], [1, 3]], 'mp': [[0, 1], [2, 3]]}
    """
    import numpy as np

    ids = np.array(plan.mesh.process_ids).reshape(plan.mesh.shape)
    return {
        axis: np.moveaxis(ids, i, -1).reshape(-1, size).tolist()
        for i, (axis, size) in enumerate(zip(plan.mesh.axes, plan.mesh.shape))
        if 1 < size < ids.size
    }


def measure_collectives(
    group,
    ranks: list[int],
    scope: str,
    rank: int,
    result: Measurements,
    sizes: tuple[int, ...] | list[int] = COLLECTIVE_BYTES,
    only: tuple[str, ...] | None = None,
) -> None:
    """Time each collective on ``group`` at ``sizes`` (every member calls this); ``only``: just
    these collectives (a plan's own, at its own message sizes: :func:`plan_messages`)."""
    import paddle
    import paddle.distributed as dist

    p = len(ranks)

    def barrier():
        dist.barrier(group=group)

    for asked in sizes:
        n = max(p, asked // 4 // p * p)  # float32 elements, split evenly over the group
        nbytes = 4 * n
        x = paddle.rand([n], dtype="float32")
        trials = {
            "all_reduce": lambda: dist.all_reduce(x, group=group),
            "all_gather": lambda: dist.all_gather([], x[: n // p], group=group),
            "reduce_scatter": lambda: dist.reduce_scatter(
                paddle.empty([n // p], "float32"), list(paddle.split(x, p)), group=group
            ),
        }
        if p == 2:
            peer = ranks[1] if rank == ranks[0] else ranks[0]
            trials["send_recv"] = lambda: (
                (dist.send(x, dst=peer, group=group), dist.recv(x, src=peer, group=group))
                if rank == ranks[0]
                else (dist.recv(x, src=peer, group=group), dist.send(x, dst=peer, group=group))
            )
        for name, run in trials.items():
            if only is not None and name not in only:
                continue
            key = (scope, name, p)
            if any(name in m and scope in m for m in result.missing):
                continue
            try:
                # Each timing closes with a barrier on the group, itself a collective (on gloo as
                # long as a small all-reduce): a small message is run BACK_TO_BACK times before
                # it, as training runs one gradient's collective after another.
                times = BACK_TO_BACK if nbytes <= 1 << 20 else 1
                seconds = timed(lambda: [run() for _ in range(times)], barrier, repeats=3) / times
            except Exception as err:  # the backend lacks it: say so, measure the rest
                result.missing.append(f"{name} ({scope}-node): {type(err).__name__}: {str(err).splitlines()[0][:160]}")
                barrier()
                continue
            if name == "send_recv":
                seconds /= 2  # a round trip: two transfers
            result.collectives.setdefault(key, []).append((nbytes, seconds))


def _sync() -> None:
    import paddle

    if paddle.is_compiled_with_cuda() and paddle.device.cuda.device_count() > 0:
        paddle.device.synchronize()


@dataclass(frozen=True)
class LinkFit:
    """One link's fitted figures: latency of a ring step for two ranks (s), its growth per rank
    beyond two (s; None when one group size was measured, which cannot tell them apart) and
    bandwidth (bytes/s); the ring step of p ranks is :meth:`autodist.planner.cost.comm.Link.step_latency`."""

    latency_s: float
    bandwidth: float
    latency_per_rank_s: float | None = None


def fit_link(
    points: dict[tuple[str, str, int], list[tuple[int, float]]], scope: str, growth: bool = True
) -> LinkFit | None:
    """One link's figures from its collectives, each timing turned into (latency steps, steps
    times ranks beyond two, bytes per rank) by the ring formulas of :mod:`autodist.planner.cost.comm`,
    fitted as ``t = steps (alpha + (p - 2) gamma) + bytes / B`` by least squares on relative
    errors (so the small, latency-bound messages count too), with no figure negative. ``gamma``
    is fitted only when groups of two sizes or more were measured (and ``growth``: False gives
    one latency for every size, the fit calibrate made before, which bench/latency_growth.py compares).

    >>> fit = fit_link({("intra", "all_reduce", 2): [(1000, 2e-6 + 1e-6), (10**6, 2e-6 + 1e-3)]}, "intra")
    >>> round(fit.latency_s * 1e6, 6), round(fit.bandwidth / 1e9, 6), fit.latency_per_rank_s
    (1.0, 1.0, None)
    """
    import numpy as np

    rows: list[tuple[float, float, float, float]] = []
    for (where, name, p), timings in points.items():
        if where != scope:
            continue
        steps, share = {
            "all_reduce": (2 * (p - 1), 2 * (p - 1) / p),
            "all_gather": (p - 1, (p - 1) / p),
            "reduce_scatter": (p - 1, (p - 1) / p),
            "send_recv": (1, 1.0),
        }[name]
        rows += [(steps, steps * max(p - 2, 0), share * nbytes, seconds) for nbytes, seconds in timings if seconds > 0]
    if len(rows) < 2:
        return None
    a = np.array([r[:3] for r in rows]) / np.array([[r[3]] for r in rows])  # each row divided by its time
    sizes = {(name, p) for (where, name, p) in points if where == scope}
    growth = growth and len({p for _, p in sizes}) > 1 and bool(a[:, 1].any())
    # Non-negative least squares over (alpha, gamma, 1/B), small enough to try every set of
    # columns that keeps the bandwidth: the best fit whose figures are all >= 0.
    best: tuple[float, np.ndarray] | None = None
    for columns in ([2], [0, 2], [1, 2], [0, 1, 2]) if growth else ([2], [0, 2]):
        solution = np.linalg.lstsq(a[:, columns], np.ones(len(rows)), rcond=None)[0]
        if (solution < 0).any() or solution[-1] <= 0:
            continue
        full = np.zeros(3)
        full[columns] = solution
        residual = float(np.sum((a @ full - 1.0) ** 2))
        if best is None or residual < best[0] - 1e-12:
            best = (residual, full)
    if best is None:  # no positive per-byte time: the bytes explain nothing here
        return None
    alpha, gamma, beta = (float(v) for v in best[1])
    return LinkFit(
        latency_s=alpha if alpha > 0 else 1e-6,  # latency lost in noise: keep a token latency
        bandwidth=1.0 / beta,
        latency_per_rank_s=gamma if growth else None,
    )


def fitted_device(
    measured: Measurements, base, dtype: str, name: str, comm_overlap: bool, dispatch: dict[str, float] | None = None
) -> dict:
    """The ``[device]`` table for cluster.toml: ``base``'s figures, overridden by the fits;
    ``comm_overlap``: whether the backend runs collectives beside compute (NCCL yes, gloo no);
    ``dispatch``: the times per op :func:`fit_dispatches` found, by profile field (None: not
    measured, base's kept)."""
    from autodist.planner.cost.hardware import _OPTIONAL_FIELDS, _profile_values  # cluster-file keys of a profile

    values: dict = {"name": name, "base": base.name, "comm_overlap": comm_overlap}
    if measured.matmuls:
        overhead, per_flop = fit_line([(2.0 * m * n * k, s) for m, n, k, s in measured.matmuls], relative=True)
        rate = 1.0 / per_flop
        peak = max(base.peak_flops[dtype], rate)
        if peak > base.peak_flops[dtype]:
            for other in ("bf16", "fp16", "fp32"):  # measured faster than the base's peak: raise it
                values[f"peak_tflops_{other}"] = max(base.peak_flops[other], rate) / 1e12
        values["matmul_efficiency"] = rate / peak
        values["op_overhead_us"] = overhead * 1e6
    keys = {field_name: key for key, field_name in _OPTIONAL_FIELDS.items()}  # dispatch_overhead_s -> _us
    for field_name, seconds in (dispatch or {}).items():
        values[keys[field_name]] = seconds * 1e6
    # measured, or the base's, written all the same: the file says which (overlap_unmeasurable)
    values["overlap_compute_loss"] = (
        overlap_loss_from(*measured.overlap[4:]) if measured.overlap is not None else base.overlap_compute_loss
    )
    if measured.memory:
        values["memory_bandwidth_gb_s"] = max(b / s for b, s in measured.memory) / 1e9
    for scope in ("intra", "inter"):
        link = fit_link(measured.collectives, scope)
        if link:
            values[f"{scope}_node_latency_us"] = link.latency_s * 1e6
            values[f"{scope}_node_bandwidth_gb_s"] = link.bandwidth / 1e9
            if link.latency_per_rank_s is not None:
                values[f"{scope}_node_latency_per_rank_us"] = link.latency_per_rank_s * 1e6
    base_values = _profile_values(base)
    return {
        k: (round(v, 6) if isinstance(v, float) else v)
        for k, v in values.items()
        if k in ("name", "base", "comm_overlap") or k in base_values
    }


def cluster_toml(device: dict, measured: Measurements, notes: list[str]) -> str:
    """The file text: ``[device]`` then ``[measured]`` (raw timings) and what is missing."""
    lines = [
        "# Written by `autodist-plan calibrate`: fitted from the timings under [measured].",
        *(f"# {note}" for note in notes),
        "",
        "[device]",
    ]
    lines += [f"{k} = {_toml(v)}" for k, v in device.items()]
    lines += [
        "",
        "[measured]",
        "# matmuls: [m, n, k, seconds]",
        f"matmuls = [{', '.join(f'[{m}, {n}, {k}, {s:.6g}]' for m, n, k, s in measured.matmuls)}]",
        "# memory: [bytes moved, seconds]",
        f"memory = [{', '.join(f'[{b}, {s:.6g}]' for b, s in measured.memory)}]",
        "# collectives: [bytes, seconds] per scope, collective and ranks",
    ]
    for (scope, name, p), timings in sorted(measured.collectives.items()):
        lines.append(f"{scope}_{name}_{p}ranks = [{', '.join(f'[{b}, {s:.6g}]' for b, s in timings)}]")
    if measured.training_step is not None:
        lines += [
            "# a real training step under the plan (--model), and the plan priced with no framework time per op",
            f"training_step_s = {measured.training_step:.6g}",
        ]
        if measured.priced_step is not None:
            lines.append(f"priced_step_s = {measured.priced_step:.6g}")
    if measured.siblings:
        rows = ", ".join(
            f"[{_toml(s.strategy)}, {s.training_step:.6g}"
            + (f", {s.priced_step:.6g}]" if s.priced_step is not None else "]")
            for s in measured.siblings
        )
        lines += [
            "# the same for the plan's siblings of the other kinds: [strategy, training step s, priced step s]",
            f"siblings = [{rows}]",
        ]
    if measured.overlap is not None:
        m, n, k, nbytes, alone, beside = measured.overlap
        lines += [
            f"# overlap: [m, n, k, all-reduce bytes, seconds of {OVERLAP_MATMULS} matmuls alone, beside the all-reduces]",
            f"overlap = [{m}, {n}, {k}, {nbytes}, {alone:.6g}, {beside:.6g}]",
        ]
    lines.append(f"missing = [{', '.join(_toml(m) for m in measured.missing)}]")
    return "\n".join(lines) + "\n"


def _toml(value) -> str:
    """A TOML literal; strings (error messages) escaped, control characters included.

    >>> print(_toml('say "hi"\\n'), _toml(0.5))
    "say \\"hi\\"\\u000a" 0.5
    """
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        body = value.replace("\\", "\\\\").replace('"', '\\"')
        return '"' + "".join(c if c >= " " and c != "\x7f" else f"\\u{ord(c):04x}" for c in body) + '"'
    return repr(value)
