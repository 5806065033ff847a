"""Strategy search: every dp x mp x pp mesh for the cluster, priced, the best one chosen.

For each factorisation of the world size (mesh order ``pp, dp, mp``, mp innermost so it stays
inside a node when it fits) the search tries sequence parallelism on/off, ZeRO stages 0-3 and
the micro-batch counts that divide the per-rank batch, keeps what satisfies every constraint,
and ranks by estimated step time, then less communication, then less memory, then the
strategy itself (so the order is deterministic). Degrees the user fixed are not searched.

Example::

    >>> from autodist.planner.cost.search import SearchRequest, search
    >>> result = search(analysis, SearchRequest(devices_per_node=8))      # doctest: +SKIP
    >>> result.best.strategy.dp, result.best.strategy.mp                   # doctest: +SKIP
    (8, 1)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Iterator

from autodist.planner.cost.blocks import ModelCost
from autodist.planner.cost.hardware import FALLBACK_DEVICE, PROFILES, backend_problem, pipeline_problem
from autodist.planner.cost.memory import check_training_setup
from autodist.planner.cost.strategy_analysis import AnalysisFor, RunsAs
from autodist.planner.cost.step_time import (
    MEMORY_USABLE,
    RECOMPUTE_MODES,
    Breakdown,
    Implicit,
    Job,
    Setup,
    VPP_CHUNKS,
    StageTable,
    estimate,
)
from autodist.planner.errors import PlannerError
from autodist.planner.recognise.chaining import cut_problem
from autodist.schemas.describe import layers_text, strategy_text
from autodist.schemas import Candidate, DeviceProfile, Kernels, Rejected, Strategy
from autodist.schemas.plan import Schedule, ShardingStage
from autodist.schemas.parallel_dims import (
    combination_problems,
    expert_limit,
    local_views_refused,
    runs_moe_locally,
)
from autodist.schemas.vocabulary import training_bytes
from autodist.schemas.schedules import PIPELINING_SCHEDULES, block_stages, schedule_problems

if TYPE_CHECKING:
    from autodist.planner.recognise.analysis import ModelAnalysis

SCHEDULES = ("sequential", "1F1B", "VPP")
#: How many runners-up a result keeps (the plan's ``alternatives.accepted``).
MAX_ACCEPTED = 10


@dataclass(frozen=True, kw_only=True)
class SearchRequest(Job):
    """What the user asked for; ``None`` means "search it"."""

    device: DeviceProfile = PROFILES[FALLBACK_DEVICE]
    dp: int | None = None
    mp: int | None = None
    pp: int | None = None
    sequence_parallel: bool | None = None
    sharding_stage: ShardingStage | None = None
    micro_batches: int | None = None
    schedule: Schedule | None = None  # "sequential" | "1F1B" | "VPP" | None = chosen
    global_batch_size: int | None = None  # samples per optimizer step over all ranks; default: the traced batch
    micro_batch_size: int | None = None
    seq_len: int | None = None  # default: the traced sequence length
    #: Expert parallelism: 1 (the default) leaves every expert on every rank, N fixes the degree,
    #: None searches it. Not searched unless asked (docs/recognition.md, "Experts").
    ep: int | None = 1
    #: What the attention cores are priced as: ``auto`` (what the model selects, when the device
    #: runs fused kernels), ``flash`` or ``eager`` (:func:`autodist.planner.kernels.choose_kernels`).
    attention: str = "auto"
    #: Why this device was planned for when nobody named one (:func:`~.hardware.default_device`):
    #: the plan's notes say it.
    device_note: str = ""


@dataclass
class SearchResult:
    best: Candidate
    accepted: list[Candidate]  # the next best, at most 10, best first
    rejected: list[Rejected]  # one per mesh (dp, mp, pp) that has no feasible variant
    #: The times behind ``best`` then ``accepted`` (same order), for explain_table.
    breakdowns: list[Breakdown] = field(default_factory=list)
    setup: Setup | None = None
    #: Modelling remarks worth a line in the plan (padding, what was not priced, ...).
    notes: list[str] = field(default_factory=list)
    #: What Paddle's SPMD rules add for ``best`` beyond the plan's hooks (the plan's ``implicit_comm``).
    implicit_comm: list = field(default_factory=list)
    #: How many strategies were priced.
    evaluated: int = 0
    #: The kernels the estimates price (the plan's ``kernels``).
    kernels: Kernels = field(default_factory=Kernels)


@dataclass
class _Scored:
    key: tuple
    candidate: Candidate
    breakdown: Breakdown


def search(model: ModelAnalysis | ModelCost | PricedModel, request: SearchRequest) -> SearchResult:
    """Choose dp, mp, pp, sequence parallelism, ZeRO stage, micro-batches and schedule.

    ``model`` is what :func:`price` made of the planner's :class:`ModelAnalysis` (an analysis
    is priced first) or, for tests and quick what-ifs, a :class:`ModelCost` written directly. Raises :class:`PlannerError`
    when the request is inconsistent or no strategy fits, naming the memory it would need.

    Example::

        >>> result = search(analysis, SearchRequest(devices_per_node=8, nodes=2))  # doctest: +SKIP
        >>> print(explain_table(result))                                          # doctest: +SKIP
    """
    priced = _priced(model, request)
    cost = priced.cost
    viewed = priced.cost_of(RunsAs(local=priced.local_views))
    if viewed.local_only:  # not even inside a local view
        raise PlannerError(
            f"{viewed.local_only}: Paddle 3.3 does not run it on the distributed tensors apply_plan trains with "
            f"(docs/paddle-notes.md), so no plan of this model can train; {viewed.local_only_rewrite}",
            layer=viewed.local_only_layer,
        )
    setup = _setup(cost, request)
    tables: dict[RunsAs, StageTable] = {}
    width = training_bytes(setup.dtype)
    scored: list[_Scored] = []
    rejected: list[Rejected] = []
    memory_misses: list[tuple[float, Strategy]] = []
    evaluated = 0
    for pp, dp, mp in _meshes(request):
        reason = _mesh_problem(cost, setup, dp, mp, pp)
        if reason:
            rejected.append(Rejected(strategy=Strategy(dp=dp, mp=mp, pp=pp), reason=reason))
            continue
        # The variant that came closest stands for a mesh none of whose variants works.
        closest: tuple[float, Strategy, str] | None = None
        feasible_before = len(scored)
        for strategy in _variants(cost, setup, request, dp, mp, pp):
            runs = priced.runs_as(strategy)
            problem = _variant_problem(setup, request, strategy, priced.cost_of(runs))
            if problem:
                closest = closest or (math.inf, strategy, problem)
                continue
            evaluated += 1
            if runs not in tables:
                tables[runs] = StageTable(priced.cost_of(runs))
            breakdown = estimate(tables[runs], strategy, setup, priced.implicit_as(mp, width, runs))
            total = breakdown.estimate.memory.total
            if total <= setup.usable_memory:
                scored.append(
                    _Scored(_rank_key(strategy, breakdown), Candidate(strategy, breakdown.estimate), breakdown)
                )
                continue
            memory_misses.append((total, strategy))
            if closest is None or total < closest[0]:
                closest = (total, strategy, _memory_reason(total, setup, breakdown))
        if len(scored) == feasible_before and closest is not None:
            rejected.append(Rejected(strategy=closest[1], reason=closest[2]))
    if not scored:
        raise _nothing_fits(setup, rejected, memory_misses)
    scored.sort(key=lambda s: s.key)
    top = scored[: MAX_ACCEPTED + 1]
    best = top[0].candidate.strategy
    return SearchResult(
        best=top[0].candidate,
        accepted=[s.candidate for s in top[1:]],
        rejected=rejected,
        breakdowns=[s.breakdown for s in top],
        setup=setup,
        notes=list(cost.notes)
        + _strategy_notes(cost, top[0].candidate.strategy)
        + [request.device_note] * bool(request.device_note)
        + _backend_notes(setup)
        + _expert_notes(cost, request),
        evaluated=evaluated,
        kernels=priced.kernels,
        implicit_comm=list(getattr(priced.implicit_as(best.mp, width, priced.runs_as(best)), "entries", ())),
    )


# -- the request ---------------------------------------------------------------------------------


@dataclass
class PricedModel:
    """The cost stage's result: the model's cost description and its implicit communication,
    under each way a strategy runs the model (:class:`~.strategy_analysis.RunsAs`).

    How a local-view candidate (an attention sub-layer with a fused ``q|k|v``) is priced: the
    search runs before any local view is proven (proving runs the sub-layers, so it is done for
    the chosen strategy only: planner/local_view_proof.py), so it prices every candidate in
    ``local_views`` as a local view under each strategy where local views run
    (:meth:`runs_as`) and as gathered elsewhere. When a proof fails, the planner drops that
    sub-layer from ``local_views`` and searches again (``driver.plan_analysed``): it is priced
    gathered under every strategy from then on (proofs are per mp degree; a failure at one is
    taken for all), and the plan's estimate is what runs.
    """

    cost: ModelCost  # the model as traced: every fused projection gathered, no MoE layer whole
    #: ``runs -> ModelCost``: the model as a strategy that runs it so runs it (priced once each);
    #: None: ``cost`` for any (a cost written by hand).
    cost_as: Callable[[RunsAs], ModelCost] | None = None
    #: ``(mp, dtype bytes, runs) -> Implicit``: what Paddle's SPMD rules add at that mp degree
    #: (None at mp 1, or without an analysis).
    implicit_as: Callable[[int, int, RunsAs], Implicit | None] = lambda mp, width, runs: None
    #: The analysis under each way of running (None: a cost written by hand).
    analysis_for: AnalysisFor | None = None
    #: The kernels ``cost`` prices (flash or eager attention, fused norms).
    kernels: Kernels = field(default_factory=Kernels)
    #: The sub-layers that may run as local views (``reshards.local_view_layers``; empty when
    #: local views are off).
    local_views: frozenset[str] = frozenset()

    def runs_as(self, strategy: Strategy, local: frozenset[str] | None = None) -> RunsAs:
        """How ``strategy`` runs the model: every candidate in ``local_views`` (or the sub-layers
        ``local``, the proven ones) as a local view where local views run
        (:func:`~autodist.schemas.parallel_dims.runs_local_views`), else none."""
        views = self.local_views if local is None else local
        return self.analysis_for.runs_as(strategy, views) if self.analysis_for else RunsAs()

    def assumed_local(self, strategy: Strategy) -> frozenset[str]:
        """The sub-layers the search prices as local views under ``strategy``."""
        return self.runs_as(strategy).local

    def cost_of(self, runs: RunsAs) -> ModelCost:
        """The model as a strategy that runs it so runs it."""
        return self.cost_as(runs) if self.cost_as else self.cost

    def analysis_of(self, strategy: Strategy, local: frozenset[str] | None = None) -> ModelAnalysis:
        """The analysis ``strategy`` runs (with the proven local views ``local``): what emit places."""
        assert self.analysis_for is not None, "a cost written by hand has no analysis"
        return self.analysis_for(self.runs_as(strategy, local))


def price(analysis: ModelAnalysis, kernels: Kernels | None = None, local_view: bool = False) -> PricedModel:
    """The cost stage: the analysed graph as a :class:`ModelCost` with ``kernels`` (None: as
    traced; :func:`kernels_for` says what a request runs), and its implicit communication.
    ``local_view``: the attention sub-layers that may run on local tensors are priced so where
    local views run (:class:`PricedModel`); the planner proves them only with the model at hand
    (the driver's ``local_view``), so off by default.

    Each way of running the model (:class:`~.strategy_analysis.RunsAs`) is analysed once
    (:class:`~.strategy_analysis.AnalysisFor`) and priced once, on first use. Replaying Paddle's
    SPMD rules costs tens of ms per call, so it runs once per mp degree, dtype and way of running
    the MoE layers, lazily, on the analysis without local views (a local view runs on plain
    tensors, outside the rules). Sequence parallelism does not change it (the blocks' interior
    is the same, see spmd.py).
    """
    from autodist.planner.cost.graph_cost import implicit_collectives, model_cost
    from autodist.planner.recognise.reshards import local_view_layers

    analysis_for = AnalysisFor(analysis)
    implicit: dict[tuple[int, int, bool], Implicit] = {}
    costs: dict[RunsAs, ModelCost] = {}

    def implicit_as(mp: int, width: int, runs: RunsAs) -> Implicit | None:
        if mp == 1:
            return None
        key = (mp, width, runs.moe_whole)
        if key not in implicit:
            implicit[key] = implicit_collectives(analysis_for(RunsAs(moe_whole=runs.moe_whole)), mp, width)
        return implicit[key]

    def cost_as(runs: RunsAs) -> ModelCost:
        if runs not in costs:
            costs[runs] = model_cost(analysis_for(runs), kernels, runs.local)
        return costs[runs]

    return PricedModel(
        cost=cost_as(RunsAs()),
        cost_as=cost_as,
        implicit_as=implicit_as,
        analysis_for=analysis_for,
        kernels=kernels or Kernels(),
        local_views=local_view_layers(analysis) if local_view else frozenset(),
    )


def kernels_for(analysis: ModelAnalysis, request: SearchRequest) -> Kernels:
    """The kernels a request's device runs for this model: what the model selects (the trace's
    record, ``graph.graph["selected_kernels"]``), the device and ``request.attention``."""
    from autodist.planner.kernels import choose_kernels

    return choose_kernels(analysis.graph.graph.get("selected_kernels", {}), request.device, request.attention)


def _priced(model: ModelAnalysis | ModelCost | PricedModel, request: SearchRequest) -> PricedModel:
    if isinstance(model, PricedModel):
        return model
    if isinstance(model, ModelCost):
        return PricedModel(cost=model)
    return price(model, kernels_for(model, request))


def _setup(cost: ModelCost, request: SearchRequest) -> Setup:
    """Check the request and fix what is the same for every candidate."""
    if request.devices_per_node < 1 or request.nodes < 1:
        raise PlannerError(
            f"--nproc-per-node and --nnodes must be at least 1, got {request.devices_per_node} and {request.nodes}"
        )
    dtype = request.dtype or cost.dtype  # left out: the model's own (mixed precision only when asked)
    try:
        check_training_setup(dtype, request.optimizer)
    except ValueError as err:
        raise PlannerError(str(err)) from None
    if request.recompute not in RECOMPUTE_MODES:
        raise PlannerError(f"unknown recompute {request.recompute!r}; known: {', '.join(RECOMPUTE_MODES)}")
    if request.schedule is not None and request.schedule not in SCHEDULES:
        raise PlannerError(f"unknown schedule {request.schedule!r}; known: {', '.join(SCHEDULES)}")
    if request.sharding_stage is not None and request.sharding_stage not in (0, 1, 2, 3):
        raise PlannerError(f"--sharding-stage must be 0, 1, 2 or 3, got {request.sharding_stage}")
    world = request.world
    fixed = {name: getattr(request, name) for name in ("dp", "mp", "pp") if getattr(request, name) is not None}
    for name, degree in fixed.items():
        if degree < 1 or world % degree:
            raise PlannerError(f"--{name} {degree} does not divide the {world} devices")
    if len(fixed) == 3 and math.prod(fixed.values()) != world:
        raise PlannerError(f"dp x mp x pp = {math.prod(fixed.values())} but there are {world} devices")
    if math.prod(fixed.values()) > world:
        raise PlannerError(
            f"{' x '.join(f'{k}={v}' for k, v in fixed.items())} needs {math.prod(fixed.values())} "
            f"devices, but there are {world} (--nnodes x --nproc-per-node)"
        )
    if world % math.prod(fixed.values()):
        raise PlannerError(
            f"the fixed degrees ({', '.join(f'{k}={v}' for k, v in fixed.items())}) do not divide the {world} devices"
        )
    for name in ("micro_batches", "micro_batch_size", "global_batch_size", "seq_len"):
        value = getattr(request, name)
        if value is not None and value < 1:
            raise PlannerError(f"--{name.replace('_', '-')} must be at least 1, got {value}")
    # One meaning of the batch: the input spec's batch is what the loader yields per optimizer
    # step over all ranks (the global batch); --global-batch-size overrides it.
    global_batch = request.global_batch_size or cost.traced_batch
    divisor = (request.dp or 1) * (request.micro_batches or 1)
    if global_batch % divisor:
        given = "--global-batch-size" if request.global_batch_size else "the input spec's batch"
        raise PlannerError(
            f"global batch {global_batch} ({given}) does not divide over "
            f"dp={request.dp or 1} x {request.micro_batches or 1} micro-batches; "
            f"give a batch that is a multiple of {divisor} (--global-batch-size)"
        )
    return Setup(
        device=request.device,
        devices_per_node=request.devices_per_node,
        nodes=request.nodes,
        seq_len=request.seq_len or cost.traced_seq,
        global_batch=global_batch,
        dtype=dtype,
        optimizer=request.optimizer,
        recompute=request.recompute,
    )


# -- enumeration -----------------------------------------------------------------------------------


def _divisors(n: int) -> list[int]:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def _meshes(request: SearchRequest) -> Iterator[tuple[int, int, int]]:
    """(pp, dp, mp) with pp * dp * mp = world that agree with the fixed degrees, in order."""
    world = request.world
    for pp in _divisors(world):
        for dp in _divisors(world // pp):
            mp = world // pp // dp
            if all(
                fixed is None or fixed == value
                for fixed, value in ((request.pp, pp), (request.dp, dp), (request.mp, mp))
            ):
                yield pp, dp, mp


def _mesh_problem(cost: ModelCost, setup: Setup, dp: int, mp: int, pp: int) -> str:
    """Why a mesh cannot work whatever its other settings, or ''."""
    problem = (
        degree_problem(cost, "mp", mp, f"mp={mp}")
        or degree_problem(cost, "pp", pp, f"pp={pp}")
        or pipeline_problem(setup.device, pp)
    )
    if problem:
        return problem
    if setup.global_batch % dp:
        return f"global batch {setup.global_batch} does not divide over dp={dp}"
    return ""


def degree_problem(cost: ModelCost, axis: str, degree: int, label: str) -> str:
    """Why this model cannot take ``degree`` on mesh axis ``axis`` (mp or pp), named ``label``, or ''.

    The one rule for both a degree the search tries (``label`` ``"mp=3"``) and one the user
    fixed (``"--mp 3"``, see :func:`check_fixed_degrees`).

    >>> degree_problem(ModelCost(blocks=(), hidden_size=8), "pp", 2, "--pp 2")
    '--pp 2 is more than the 0 blocks of the model (each stage needs at least one block)'
    """
    blocks = cost.blocks
    if degree == 1:
        return ""
    if axis == "mp":
        if not blocks:
            return f"{label}: no transformer block was recognised, so there is nothing to split over mp"
        shapes: dict[tuple[int, int, int], list[str]] = {}
        for block in blocks:  # one check per distinct block shape, naming every block of that shape
            kv_heads = block.num_kv_heads if block.kv_split else 0  # whole K/V: no constraint
            shapes.setdefault((block.num_heads, kv_heads, block.intermediate_size), []).append(block.layer)
        for (heads, kv_heads, intermediate), layers in shapes.items():
            for what, size in (("heads", heads), ("KV heads", kv_heads), ("intermediate features", intermediate)):
                if size and size % degree:
                    return f"{label} does not divide the {size} {what} of {layers_text(layers)}"
    if axis == "pp" and degree > len(blocks):
        return f"{label} is more than the {len(blocks)} blocks of the model (each stage needs at least one block)"
    return ""


def check_fixed_degrees(cost: ModelCost, request: SearchRequest) -> None:
    """Reject an mp or pp the user fixed that this model cannot take, naming the option.

    The search would reject every mesh with it too, but one line about ``--mp`` says more than
    a table of rejected meshes.
    """
    for axis in ("mp", "pp"):
        degree = getattr(request, axis)
        problem = degree_problem(cost, axis, degree, f"--{axis} {degree}") if degree is not None else ""
        if problem:
            raise PlannerError(problem)
    if request.pp is not None and request.pp > 1:
        chunks = [1, VPP_CHUNKS] if request.schedule is None else [VPP_CHUNKS if request.schedule == "VPP" else 1]
        splits = [block_stages(len(cost.blocks), request.pp, v) for v in chunks if request.pp * v <= len(cost.blocks)]
        problems = [cut_problem(dict(cost.unchained), stages) for stages in splits]
        if problems and all(problems):
            raise PlannerError(f"--pp {request.pp}: {problems[0]}")
    spread = (request.dp or 1) > 1 or request.sequence_parallel
    if (request.ep is not None and request.ep > 1) or (cost.has_experts and spread):
        fixed = Strategy(
            dp=request.dp or 1,
            mp=request.mp or 1,
            pp=request.pp or 1,
            sharding_stage=request.sharding_stage or 0,
            sequence_parallel=bool(request.sequence_parallel),
            ep=request.ep or 1,
        )
        problem = expert_problem(cost, fixed.ep, f"--ep {fixed.ep}") or expert_limit(
            fixed, options=True, moe=cost.has_experts
        )
        if problem:
            raise PlannerError(problem)
    if request.sequence_parallel and cost.token_mixing:
        raise PlannerError(
            f"--sequence-parallel: {cost.token_mixing} projects over the token axis (it mixes "
            "positions), so the sequence cannot be split between blocks"
        )


def expert_problem(cost: ModelCost, ep: int, label: str) -> str:
    """Why this model cannot spread its experts over ``ep`` ranks, named ``label``, or ''.

    >>> expert_problem(ModelCost(blocks=(), hidden_size=8), 2, "--ep 2")
    '--ep 2: no block has experts (an MoE layer), so there is nothing to spread over ranks'
    """
    counts = sorted({b.experts for b in cost.blocks if b.experts})
    if ep > 1 and not counts:
        return f"{label}: no block has experts (an MoE layer), so there is nothing to spread over ranks"
    batched = next((b.layer for b in cost.blocks if b.experts_batched), None)
    if ep > 1 and batched is not None:
        return (
            f"{label}: the experts of {batched} are one layer's batched weights, which expert parallelism does "
            "not spread (it drops the numbered expert layers a rank does not hold); they run whole on every rank"
        )
    return next((f"{label} does not divide the {n} experts of a block" for n in counts if n % ep), "")


def _expert_degrees(cost: ModelCost, request: SearchRequest, dp: int) -> list[int]:
    """The ep degrees to price on a mesh with ``dp`` ranks: the one asked for, or when searched,
    1 and every divisor of dp that divides the experts of every MoE block."""
    if request.ep is not None:
        return [request.ep]
    return [ep for ep in _divisors(dp) if not expert_problem(cost, ep, "")]


def _variants(cost: ModelCost, setup: Setup, request: SearchRequest, dp: int, mp: int, pp: int) -> Iterator[Strategy]:
    sps = [False, True] if mp > 1 and not cost.token_mixing else [False]
    if request.sequence_parallel is not None:
        sps = [request.sequence_parallel and mp > 1]
    stages: list[ShardingStage] = [0, 1, 2, 3] if dp > 1 else [0]
    if request.sharding_stage is not None:
        stages = [request.sharding_stage if dp > 1 else 0]
    per_rank = setup.global_batch // dp
    if request.micro_batches is not None:
        counts = [request.micro_batches]
    elif request.micro_batch_size is not None:
        counts = [max(1, per_rank // request.micro_batch_size)]
    else:
        counts = _divisors(per_rank)
    for sp in sps:
        for stage in stages:
            for m in counts:
                for schedule, virtual in _schedules(request, len(cost.blocks), pp, m):
                    for ep in _expert_degrees(cost, request, dp):
                        yield Strategy(
                            dp=dp,
                            mp=mp,
                            pp=pp,
                            sequence_parallel=sp,
                            sharding_stage=stage,
                            micro_batches=m,
                            schedule=schedule,
                            virtual_stages=virtual,
                            recompute=setup.recompute,
                            ep=ep,
                        )


def _schedules(request: SearchRequest, num_blocks: int, pp: int, m: int) -> list[tuple[Schedule, int]]:
    """``(schedule, virtual stages)`` to price: the one asked for; else every pipelining schedule
    the applier can run for ``num_blocks`` blocks and ``m`` micro-batches (schemas/schedules.py),
    and ``sequential`` only where none can (a model they cannot cut, fewer micro-batches than
    stages)."""
    if pp == 1:
        return [("none", 1)]
    chunks: dict[Schedule, int] = {"1F1B": 1, "VPP": VPP_CHUNKS, "sequential": 1}
    if request.schedule is not None:
        return [(request.schedule, chunks[request.schedule])]
    runnable: list[tuple[Schedule, int]] = [
        (name, chunks[name])
        for name in PIPELINING_SCHEDULES
        if not schedule_problems(name, pp, m, block_stages(num_blocks, pp, chunks[name]))
    ]
    return runnable or [("sequential", 1)]


def _variant_problem(setup: Setup, request: SearchRequest, strategy: Strategy, cost: ModelCost) -> str:
    """Why one variant of a feasible mesh cannot work (before pricing it), or ''."""
    num_blocks, tied = len(cost.blocks), bool(cost.tied_vocab_params)
    unsupported = backend_problem(setup.device, strategy) or expert_limit(strategy, moe=cost.has_experts)
    combination = combination_problems(strategy, moe=cost.has_experts, tied=tied)
    if unsupported or combination:
        return unsupported or combination[0]
    if cost.local_only:  # inside sub-layers that may run as local views, but not under this strategy
        return (
            f"{cost.local_only} runs on distributed tensors here, which Paddle 3.3 cannot do: its sub-layer runs on "
            f"local tensors only as a local view, and local views do not run here ({local_views_refused(strategy)})"
        )
    if cost.local_only_in_moe and not runs_moe_locally(strategy, local_only=True):
        return (
            f"{cost.local_only_in_moe} runs on distributed tensors here, which Paddle 3.3 cannot do: the MoE "
            "layers run on local tensors only without ZeRO, pp or sequence parallelism"
        )
    per_rank = setup.global_batch // strategy.dp
    if per_rank % strategy.micro_batches:
        return f"the {per_rank} samples per dp rank do not split into {strategy.micro_batches} micro-batches"
    if request.micro_batch_size is not None and per_rank != strategy.micro_batches * request.micro_batch_size:
        return (
            f"global batch {setup.global_batch} is not dp={strategy.dp} x micro-batch size "
            f"{request.micro_batch_size} x micro-batches"
        )

    stages = block_stages(num_blocks, strategy.pp, strategy.virtual_stages)
    problems = schedule_problems(strategy.schedule, strategy.pp, strategy.micro_batches, stages)
    return "; ".join(problems) or cut_problem(dict(cost.unchained), stages)


def _rank_key(strategy: Strategy, breakdown: Breakdown) -> tuple:
    """Step time (to 6 significant digits, so float noise does not decide), then fewer bytes
    communicated, then less memory, then the strategy's own fields for a total order."""
    est = breakdown.estimate
    # Without a pipeline schedule, micro-batches are gradient-accumulation steps: the model prices
    # them as free, but each one shrinks the matmuls, so take the fewest that fit in memory.
    accumulation = strategy.micro_batches if strategy.schedule in ("none", "sequential") else 0
    return (
        float(f"{est.step_time_s:.6g}"),
        breakdown.comm_bytes,
        accumulation,
        est.memory.total,
        *_strategy_order(strategy),
    )


# -- messages --------------------------------------------------------------------------------------


def _gb(nbytes: float) -> str:
    return f"{nbytes / 1e9:.1f} GB"


def _memory_reason(total: float, setup: Setup, breakdown: Breakdown) -> str:
    mem = breakdown.estimate.memory
    return (
        f"needs {_gb(total)} per device (params {_gb(mem.params)}, grads {_gb(mem.grads)}, "
        f"optimizer {_gb(mem.optimizer)}, activations {_gb(mem.activations)}); "
        f"{setup.device.name} allows {_gb(setup.usable_memory)}"
    )


def _nothing_fits(setup: Setup, rejected: list[Rejected], memory_misses: list[tuple[float, Strategy]]) -> PlannerError:
    if memory_misses:
        need, strategy = min(memory_misses, key=lambda miss: (miss[0], _strategy_order(miss[1])))
        return PlannerError(
            f"the model does not fit on {setup.world} x {setup.device.name}: the smallest strategy "
            f"({strategy_text(strategy, 'short')}) needs {_gb(need)} per device, which is more than the "
            f"{_gb(setup.usable_memory)} usable of {_gb(setup.device.memory_bytes)}; it needs devices "
            f"with at least {_gb(need / MEMORY_USABLE)} of memory, or more devices, recompute, or a "
            f"smaller batch",
            detail="\n".join(f"{strategy_text(r.strategy, 'short')}: {r.reason}" for r in rejected),
        )
    reasons = "\n".join(f"{strategy_text(r.strategy, 'short')}: {r.reason}" for r in rejected)
    return PlannerError(f"no strategy satisfies the constraints on {setup.world} devices", detail=reasons)


def _strategy_order(strategy: Strategy) -> tuple:
    return (
        strategy.pp,
        strategy.mp,
        strategy.dp,
        strategy.sharding_stage,
        strategy.sequence_parallel,
        strategy.micro_batches,
        strategy.virtual_stages,
        strategy.schedule,
        strategy.ep,
    )


def _backend_notes(setup: Setup) -> list[str]:
    """What the device's backend ruled out, said once (the rejected strategies give details)."""
    if not setup.device.unsupported:
        return []
    return [
        f"device {setup.device.name}: its backend lacks {', '.join(setup.device.unsupported)}; strategies that "
        "need them (sequence parallelism, ZeRO, pipelines) were not considered"
    ]


def _expert_notes(cost: ModelCost, request: SearchRequest) -> list[str]:
    if request.ep != 1 or not cost.has_experts:
        return []
    return [
        "the blocks hold experts: expert parallelism was not searched (it is taken only when asked); "
        "--ep N or --ep auto prices it"
    ]


def _strategy_notes(cost: ModelCost, strategy: Strategy) -> list[str]:
    notes = []
    if strategy.mp > 1 and cost.vocab_size and cost.vocab_size % strategy.mp:
        notes.append(
            f"vocabulary {cost.vocab_size} does not divide by mp={strategy.mp}: embedding and LM head "
            "stay replicated over mp (priced so)"
        )
    local_only = cost.local_only_in_moe
    if (
        local_only
        and strategy.mp > 1
        and runs_moe_locally(strategy, local_only=True)
        and not runs_moe_locally(strategy)
    ):
        notes.append(
            f"{local_only}: Paddle 3.3 runs it on plain tensors only, so the MoE layers run whole on every rank "
            "as plain tensors, their experts not split over mp (priced so)"
        )
    return notes
