"""Step time, memory and communication of one strategy, from a :class:`ModelCost`.

The model, per pipeline stage and micro-batch (all of it stated so a reviewer can argue with it):

- compute: each traced matmul at its per-rank shape (column-parallel: n / mp, row-parallel:
  k / mp; attention: a batched matmul per head group) priced by the device's roofline
  (:mod:`autodist.planner.cost.compute`); every other op by the bytes it moves. The backward
  pass costs twice the forward (two matmuls of the same shape per matmul, Narayanan et al.
  2021 sec. 5.1; memory-bound ops read the saved input and the output gradient and write the
  input gradient). Full recompute adds one more forward of the blocks, selective recompute
  one of each block's attention sub-layer, as apply_plan recomputes it: projections, core and
  the collectives inside it (``BlockCost.selective``: a local view's all-reduces run once),
  keeping of what it saved only its inputs. A flash attention core (the plan's
  ``kernels``) is one kernel at the roofline, with no scores saved, and its backward recomputes
  the scores (half its forward again). FLOPs the trace gives no shape for
  (convolutions, hand-written costs) run at the compute roof. Every op also pays the device's
  fixed cost per op, kernel launch (``op_overhead_s``) plus the framework's dispatch that a
  real training step shows (measured by ``autodist-plan calibrate --model`` per kind of
  strategy, data, tensor or both: ``compute.as_run``; 0 on the named GPU profiles), in the forward and, twice, in the backward;
- tensor parallelism: each block's all-reduces (all-gather + reduce-scatter of the same size
  with sequence parallelism, which the ring model prices the same) on the mp group's link,
  exposed: Megatron-LM's and Paddle's tensor-parallel layers call the collective and wait for
  it before the next matmul (Shoeybi et al. 2019, sec. 3; Paddle's ``mp_ops._mp_allreduce``);
  Paddle has no compute/communication overlap for them that a plan could ask for. A fused
  projection the plan gathers adds an all-gather of its output forward and one of the row
  projection's input gradient backward, exposed, and the attention core after it runs whole on
  every rank (:func:`~autodist.planner.cost.blocks.core_share`); a local view runs its core on
  1/mp of the heads with the all-reduces alone (:class:`~autodist.planner.cost.search.PricedModel`);
  its fused multi-query ``q|k|v`` weight, where the KV heads do not split over mp, is held whole
  on every mp rank (its parameter, gradient and optimizer state) and its gradient, each rank's
  share, is all-reduced over mp in every micro-batch's backward, overlapped with it
  (:func:`_mp_grad_sync`).
  With the
  vocabulary split over mp, the column-parallel LM head's input gradient is all-reduced too, and
  the token lookup all-gathers its whole table in every forward and again in its backward
  (Paddle 3.3.1's ``embedding`` rule wants the table replicated; its output is then replicated,
  not all-reduced), exposed, the gathered table and its whole gradient counting once in the
  stage's memory (the parameter and its optimizer states stay split); or, where the plan looks
  it up on local tensors (``plan.vocab_lookup``, Megatron's way), its output is all-reduced
  once in the forward instead, and nothing is gathered
  (:func:`autodist.planner.cost.comm.vocab_lookup_collective`);
- pipeline: a send of the block output forward and of its gradient backward per stage boundary,
  exposed. 1F1B takes (m + pp - 1) slots of the slowest stage, a bubble of (pp - 1)/m;
  VPP (interleaved 1F1B, ``strategy.virtual_stages`` = v model chunks per rank) shrinks the bubble to
  (pp - 1)/(v m) and makes v times as many hand-offs (Narayanan et al., "Efficient Large-Scale
  Language Model Training on GPU Clusters Using Megatron-LM", SC 2021, sec. 2.2.2);
  ``sequential`` runs stages one after another, no overlap at all;
- data parallelism, overlapped as the frameworks do it, each piece of communication split in
  one piece per block and run as a two-stage pipeline against that block's compute
  (:func:`overlapped`: one piece is always exposed, the rest hide while compute is longer):
  the gradient all-reduce (ZeRO 1/2: reduce-scatter) overlaps the last micro-batch's backward,
  as DDP-style bucketing does (Li et al., "PyTorch Distributed", VLDB 2020, sec. 3.2.3); ZeRO 1/2
  then all-gather the updated parameters after the optimizer step, exposed; ZeRO 3 all-gathers
  each block's parameters in the forward and the backward of every micro-batch while the
  previous block computes (prefetching, Zhao et al., "PyTorch FSDP", VLDB 2023, sec. 3.3.2;
  Rajbhandari et al., ZeRO, SC 2020, sec. 7.2.2), so only the first block's gather is exposed
  when the link keeps up (Paddle gathers a parameter at each op reading it, forward and
  backward, holding nothing gathered: a tied table twice in each; a local view's parameters are
  gathered in the forward alone and held until the backward with the micro-batch's activations,
  a multi-query weight's columns the rank computes with alone, applier/modes/local_calls.py
  ``param_local``; full recompute gathers them again as it rebuilds their block; a local lookup's
  rows are gathered in the forward alone and not held: measured, docs/paddle-notes.md; the
  largest parameter's backward holds it gathered with its whole gradient, once);
  in the last backward the gathers and the gradient reduce-scatter
  share the link. Hidden communication is not free: while a collective runs, the compute
  beside it loses the device's ``overlap_compute_loss`` of its speed (NCCL's kernels hold SMs;
  planner/cost/hardware.py), so each hidden piece costs that fraction of itself. A device whose
  collectives block its compute (``comm_overlap`` false: gloo on CPU) overlaps nothing: a loss
  of 1 (:func:`~autodist.planner.cost.compute.overlap_loss`). Each parameter is its own
  collective (Paddle reshards every gradient on its own; ``count`` latencies), the bytes are
  those of all of them;
- expert parallelism (``strategy.ep``, the plan's ``expert_dispatch`` / ``expert_combine`` hooks:
  Megatron-LM's "allgather" token dispatcher), over ep ranks neighbouring on the dp axis, per MoE
  layer and micro-batch, with B the bytes of its input on one rank (tokens x hidden): the forward
  all-gathers the group's inputs (ep x B, (ep - 1) B sent) and all-reduces the ep x B output
  (a ring: 2 (ep - 1) B), the backward all-gathers the output gradient and all-reduces the input
  gradient, the same again: 6 (ep - 1) B, exposed (the layer waits for its tokens, its successor
  for the sum); full recompute runs the forward's pair once more. Each rank holds 1/ep of the
  experts' parameters; apply_plan sums the MoE layers' gradients itself after the backward,
  exposed: the routers' over dp, the experts' over the dp/ep ranks holding the same experts (the
  rest of the model's as above). The MoE layer's own saved activations (router, gathers,
  combine: not the experts') are for ep x the tokens. With mp > 1 the MoE layer is not split
  over mp: every mp rank of an ep group runs it whole on the group's tokens (the table's model
  is the analysis as the strategy runs it, planner/cost/strategy_analysis.py: its experts'
  parameters, FLOPs and activations undivided by mp, no mp all-reduce for its MLPs; the ep
  group's ranks are mp apart on the dp axis). Not priced: the
  router's compute on ep x the tokens (one small matmul and memory-bound ops). The shared
  experts run on the first rank of each ep group alone, on ep x the tokens: the stage's compute
  is that rank's, (ep - 1) x their FLOPs more at the compute roof, forward and backward (not
  priced: their activations for ep x the tokens on that rank);
- optimizer step, after the pipeline and the exposed data-parallel time: every model state read
  and written once by memory bandwidth, plus one update op (the device's fixed cost per op,
  launch and dispatch) per parameter; under ``sequential`` each rank's optimizer holds every
  stage's parameters (the whole model runs on every rank), so it pays the fixed cost for all.

Memory is that of the most loaded stage: model states (ZeRO over dp) plus activations for the
micro-batches in flight (1F1B and VPP: stage k holds min(pp - k, m); otherwise one).

Example::

    >>> overlapped(comm_s=1.0, compute_s=10.0, chunks=4)   # one piece of four exposed
    0.25
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cached_property
from itertools import accumulate

from autodist.schemas import CommEstimate, DeviceProfile, Estimate, MemoryEstimate, Strategy
from autodist.schemas.plan import Recompute

from autodist.schemas.schedules import block_stages

from autodist.planner.cost.blocks import (
    BlockCost,
    EdgeCost,
    Gemm,
    ModelCost,
    Moved,
    Saved,
    core_share,
    multi_query_whole,
    view_params_kept,
    view_params_per_rank,
)
from autodist.planner.cost.comm import (
    Link,
    all_gather_bytes,
    all_gather_time,
    all_reduce_bytes,
    all_reduce_time,
    group_link,
    p2p_time,
    reduce_scatter_time,
    vocab_lookup_collective,
)
from autodist.planner.cost.compute import as_run, fixed_op_time, matmul_time, memory_time, overlap_loss
from autodist.planner.cost.memory import StateBytes, model_state_bytes
from autodist.schemas.parallel_dims import runs_moe_locally
from autodist.schemas.parallel_dims import runs_local_views
from autodist.schemas.vocabulary import TrainingDType, training_bytes

#: Model chunks per rank the search tries for VPP (the plan's ``virtual_stages``; issue #13).
VPP_CHUNKS = 2
#: Part of device memory a plan may use: the rest is CUDA context, allocator fragmentation and
#: kernel workspaces.
MEMORY_USABLE = 0.9
RECOMPUTE_MODES = ("none", "selective", "full")


@dataclass(frozen=True, kw_only=True)
class Job:
    """What both a search request and its setup say about the job: the cluster's shape and how it
    trains (precision, optimizer, recompute), with the one set of defaults."""

    devices_per_node: int = 1
    nodes: int = 1
    #: What it trains in: ``bf16`` or ``fp16`` with fp32 parameters is mixed precision (AMP);
    #: None: the model's parameters' dtype (``ModelCost.dtype``).
    dtype: TrainingDType | None = None
    optimizer: str = "adam"
    recompute: Recompute = "none"

    @property
    def world(self) -> int:
        return self.devices_per_node * self.nodes


@dataclass(frozen=True, kw_only=True)
class Setup(Job):
    """What is fixed across the candidates of one search."""

    device: DeviceProfile
    seq_len: int
    global_batch: int
    #: The request's, or the model's (``ModelCost.dtype``); one made by hand, for a what-if: bf16.
    dtype: TrainingDType = "bf16"
    #: The dtype the data-parallel gradient sums run in (all-reduce, ZeRO's reduce-scatter); None:
    #: ``dtype``, as Paddle sums them (the gradient is in the parameter's dtype). PyTorch FSDP's
    #: ``MixedPrecision(reduce_dtype=torch.float32)`` (Composer's default ``mixed_precision``)
    #: sums bf16 gradients in fp32: twice the bytes of the gradients it reduces.
    grad_reduce_dtype: TrainingDType | None = None

    @property
    def usable_memory(self) -> float:
        return self.device.memory_bytes * MEMORY_USABLE


@dataclass(frozen=True)
class Implicit:
    """Collectives Paddle inserts by itself: bytes one rank sends per token of a micro-batch
    (forward and backward), in ``count`` collectives each way (the gathers of the plan's own
    ``reshard`` hooks are the blocks', :attr:`BlockCost.gather_fwd_per_token`).
    ``entries``: what Paddle inserts, as the plan's ``implicit_comm`` lists it."""

    sent_per_token: float = 0.0
    count: int = 0
    entries: tuple = ()


@dataclass(frozen=True)
class Breakdown:
    """An estimate plus the times behind it (seconds per step), for ranking and explaining."""

    estimate: Estimate
    compute_s: float
    mp_comm_s: float
    dp_comm_s: float
    pp_comm_s: float
    bubble_s: float
    optimizer_s: float
    peak_stage: int
    ep_comm_s: float = 0.0

    @property
    def comm_bytes(self) -> int:
        c = self.estimate.comm_bytes
        return c.mp + c.dp + c.pp + c.ep + c.implicit


class StageTable:
    """Prefix sums over the blocks, so a stage's totals cost O(1) whatever its size."""

    _FIELDS = (
        "params_split",
        "params_whole",
        "param_tensors",
        "flops_per_token",
        "flops_per_token_seq",
        "allreduce_fwd_per_token",
        "allreduce_bwd_per_token",
        "allreduce_fwd_count",
        "allreduce_bwd_count",
        "gather_fwd_per_token",
        "gather_bwd_per_token",
        "gather_fwd_count",
        "gather_bwd_count",
    )

    def __init__(self, cost: ModelCost):
        self.cost = cost
        # Blocks that cost the same (equal but for their name) share a kind: the index of the
        # first of them. A strategy prices each kind once; the kinds are found here, once for
        # every strategy the search prices (comparing whole BlockCosts is not cheap).
        first: dict[BlockCost, int] = {}
        self.kind = [first.setdefault(replace(b, layer=""), i) for i, b in enumerate(cost.blocks)]
        # Most models repeat one block: then a stage's costs depend only on how many it holds.
        self.uniform = len(first) <= 1
        self._prefix = {name: [0.0, *accumulate(getattr(b, name) for b in cost.blocks)] for name in self._FIELDS}
        for name in ("saved_outside", "saved_inside", "saved_inside_seq"):
            for part in ("floats", "masks"):
                values = (getattr(getattr(b, name), part) for b in cost.blocks)
                self._prefix[f"{name}.{part}"] = [0.0, *accumulate(values)]
        for part in ("floats", "masks"):  # the scores of cores that run whole on every mp rank
            values = (getattr(b.saved_inside_seq, part) * b.core_whole for b in cost.blocks)
            self._prefix[f"saved_whole_seq.{part}"] = [0.0, *accumulate(values)]
        # what selective recompute runs again (BlockCost.selective), as ``selective.<field>``
        recomputed = [b.selective or BlockCost(layer="") for b in cost.blocks]
        for name in ("allreduce_fwd_per_token", "allreduce_fwd_count", "gather_fwd_per_token", "gather_fwd_count"):
            self._prefix[f"selective.{name}"] = [0.0, *accumulate(getattr(b, name) for b in recomputed)]
        for name in ("saved_outside", "saved_inside", "saved_inside_seq"):
            for part in ("floats", "masks"):
                values = (getattr(getattr(b, name), part) for b in recomputed)
                self._prefix[f"selective.{name}.{part}"] = [0.0, *accumulate(values)]
        for part in ("floats", "masks"):
            values = (getattr(b.saved_inside_seq, part) * b.core_whole for b in recomputed)
            self._prefix[f"selective.saved_whole_seq.{part}"] = [0.0, *accumulate(values)]

    def total(self, name: str, start: int, stop: int) -> float:
        prefix = self._prefix[name]
        return prefix[stop] - prefix[start]

    def signature(self, start: int, stop: int) -> object:
        """Equal for two block ranges that cost the same."""
        return stop - start if self.uniform else (start, stop)

    def saved(self, name: str, start: int, stop: int) -> Saved:
        """The saved elements of field ``name`` (``selective.<field>``: of the sub-layers selective
        recompute runs again) over blocks ``start:stop``."""
        return Saved(self.total(f"{name}.floats", start, stop), self.total(f"{name}.masks", start, stop))

    @cached_property
    def largest_block(self) -> BlockCost | None:
        return max(self.cost.blocks, key=lambda b: (b.saved_outside + b.saved_inside).floats, default=None)

    @cached_property
    def largest_selective(self) -> BlockCost | None:
        """The recomputed sub-layer (``BlockCost.selective``) that drops the most."""
        recomputed = [b.selective for b in self.cost.blocks if b.selective is not None]
        return max(recomputed, key=lambda b: (b.saved_outside + b.saved_inside).floats, default=None)


def stage_ranges(num_blocks: int, pp: int) -> list[tuple[int, int]]:
    """Blocks ``[start, stop)`` of each stage, from the plan's own split
    (:func:`autodist.schemas.schedules.block_stages`, one chunk per stage; every stage has a
    block). VPP's chunks are priced as this contiguous split: same block count per stage.

    >>> stage_ranges(10, 4)
    [(0, 3), (3, 6), (6, 8), (8, 10)]
    """
    stages = block_stages(num_blocks, pp)
    return [(stages.index(s), len(stages) - stages[::-1].index(s)) for s in range(pp)]


def vocab_split(cost: ModelCost, mp: int) -> bool:
    """Whether embedding and head are split over the vocabulary (it must divide by mp)."""
    return mp > 1 and cost.vocab_size is not None and cost.vocab_size % mp == 0


@dataclass(frozen=True)
class _Context:
    """What every stage of one strategy's estimate shares."""

    table: StageTable
    strategy: Strategy
    setup: Setup
    implicit: Implicit | None
    #: Whether the token lookups run on local tensors (:func:`_lookups`).
    local_views: bool = False

    @property
    def cost(self) -> ModelCost:
        return self.table.cost

    @cached_property
    def width(self) -> int:
        return training_bytes(self.setup.dtype)

    @cached_property
    def grad_width(self) -> int:
        """Bytes per element of a gradient summed over dp (:attr:`Setup.grad_reduce_dtype`)."""
        return training_bytes(self.setup.grad_reduce_dtype or self.setup.dtype)

    @cached_property
    def tokens(self) -> int:
        """Tokens per micro-batch on one dp rank."""
        return self.setup.global_batch // (self.strategy.dp * self.strategy.micro_batches) * self.setup.seq_len

    @cached_property
    def vocab_div(self) -> int:
        return self.strategy.mp if vocab_split(self.cost, self.strategy.mp) else 1

    def looks_up_locally(self, edge: EdgeCost) -> bool:
        """Whether ``edge``'s token lookup runs on local tensors (``plan.vocab_lookup``): its
        table split over the vocabulary, its layer can, and the strategy runs local views."""
        return self.vocab_div > 1 and self.local_views and edge.lookup_table > 0 and edge.lookup_output > 0

    @cached_property
    def act_div(self) -> int:
        """Sequence parallelism splits what lies outside the tensor-parallel region too."""
        return self.strategy.mp if self.strategy.sequence_parallel and self.strategy.mp > 1 else 1

    def link(self, size: int, stride: int) -> Link:
        return group_link(size, stride, self.setup.devices_per_node, self.setup.device)

    def overlapped(self, comm_s: float, compute_s: float, chunks: int) -> float:
        """:func:`overlapped` with the device's loss of compute speed beside a collective
        (:func:`~autodist.planner.cost.compute.overlap_loss`: 1 where collectives block compute,
        so that every collective waits for the compute and the other way round)."""
        return overlapped(comm_s, compute_s, chunks, overlap_loss(self.setup.device))

    @cached_property
    def _block_times(self) -> dict[int, tuple[float, float, float]]:
        return {}

    def block_forward(self, index: int) -> tuple[float, float, float]:
        """(forward seconds of block ``index`` per micro-batch, of which the sub-layer selective
        recompute runs again (``BlockCost.selective``), and what its backward recomputes whatever
        the mode: a flash core's scores); priced once per kind of block (:attr:`StageTable.kind`)."""
        kind = self.table.kind[index]
        if kind not in self._block_times:
            block = self.table.cost.blocks[kind]
            forward_s, rescore_s = _block_forward(self, block)
            selective_s = _block_forward(self, block.selective)[0] if block.selective is not None else 0.0
            self._block_times[kind] = (forward_s, selective_s, rescore_s)
        return self._block_times[kind]

    def gemm_time(self, gemm: Gemm) -> float:
        mp, vocab = self.strategy.mp, self.vocab_div
        n = gemm.n / (mp if gemm.split == "column" else vocab if gemm.split == "vocab" else 1)
        k = gemm.k / (mp if gemm.split == "row" else 1)
        return matmul_time(self.tokens, n, k, self.setup.device, self.setup.dtype)

    def roof_time(self, flops: float) -> float:
        """Seconds for FLOPs the trace gave no shape for: at the compute roof."""
        device = self.setup.device
        return flops / (device.peak_flops[self.setup.dtype] * device.matmul_efficiency) if flops > 0 else 0.0

    def moved_time(self, moved: Moved, core: float | None = None) -> float:
        """Seconds the memory-bound ops of one micro-batch take in the forward pass; ``core``: the
        part of the attention-score shaped elements this rank moves (:func:`core_share`; 1/mp)."""
        per_token = (
            moved.outside / self.act_div
            + moved.inside / self.strategy.mp
            + moved.inside_seq * self.setup.seq_len * (1 / self.strategy.mp if core is None else core)
            + moved.vocab / self.vocab_div
        )
        device = self.setup.device
        return memory_time(per_token * self.tokens * self.width, device) + moved.ops * fixed_op_time(device)


@dataclass(frozen=True)
class _MoeGrads:
    """The MoE layers' gradients under expert parallelism, which apply_plan sums itself before
    the optimizer step: the routers' over dp, the held experts' over the dp / ep ranks holding
    the same experts (elements and tensors per rank; part of the stage's ``params``)."""

    router_params: float
    router_tensors: int
    expert_params: float
    expert_tensors: int


@dataclass(frozen=True)
class _Stage:
    """One pipeline stage's share of one micro-batch (times in seconds, sizes in bytes)."""

    compute_s: float  # forward, backward and recompute
    backward_s: float  # of which the backward pass (with what full recompute redoes in it)
    mp_s: float
    mp_bytes: float
    implicit_bytes: float
    p2p_s: float
    p2p_bytes: float
    states: StateBytes
    activations_per_micro_batch: float
    activations_working: float  # alive once, whatever is in flight (full recompute's rebuild)
    params: float  # elements per rank, before ZeRO
    param_tensors: int  # each is a gradient collective and an optimizer update
    ep_s: float = 0.0  # expert parallelism's gathers and sums
    ep_bytes: float = 0.0
    moe_grads: _MoeGrads | None = None  # under expert parallelism
    #: Fused multi-query weights held whole on every mp rank (:func:`multi_query_whole`): their
    #: elements (part of ``params``) and tensors, whose gradients are all-reduced over mp.
    mp_grad_params: float = 0.0
    mp_grad_tensors: int = 0
    #: The local views' parameters (elements per rank, part of ``params``, and tensors): under
    #: ZeRO 3 gathered over dp in each micro-batch's forward alone (:func:`_dp_sync`).
    view_params: float = 0.0
    view_tensors: int = 0
    #: The token lookup's table on this stage (elements per rank, part of ``params``), whether
    #: it is looked up on local tensors and whether an LM head on the stage reads it too (tied):
    #: under ZeRO 3 every op reading it gathers it over dp, in the forward and again in the
    #: backward, but the local lookup, whose backward needs no table values (:func:`_dp_sync`).
    lookup_rows: float = 0.0
    lookup_local: bool = False
    lookup_tied: bool = False

    def optimizer_s(self, device: DeviceProfile) -> float:
        """The optimizer step: every state read and written once (memory-bound), one update
        op per parameter."""
        return memory_time(2 * self.states.total, device) + self.param_tensors * fixed_op_time(device)

    @property
    def time_s(self) -> float:
        return self.compute_s + self.mp_s + self.p2p_s + self.ep_s


def estimate(
    table: StageTable,
    strategy: Strategy,
    setup: Setup,
    implicit: Implicit | None = None,
    *,
    local_views: bool | None = None,
) -> Breakdown:
    """Price one strategy. ``implicit``: the collectives Paddle inserts on its own for these
    placements (from the analysis), per micro-batch, for the whole model. ``local_views``:
    whether the token lookups run on local tensors (:func:`_lookups`); None, as apply_plan runs
    them under ``strategy`` (:func:`~autodist.schemas.parallel_dims.runs_local_views`). ``table``
    holds the model as ``strategy`` runs it (``PricedModel.cost_for``): which sub-layers run as
    local views, whether the MoE layers run whole on every mp rank.
    bench/published.py passes True: Megatron-LM looks up locally under every strategy.

    Example: see ``tests/test_cost_formulas.py`` and :func:`autodist.planner.cost.search.search`.
    """
    local = runs_local_views(strategy) if local_views is None else local_views
    setup = replace(setup, device=as_run(setup.device, strategy.dp, strategy.mp))  # its kind's time per op
    ctx = _Context(table, strategy, setup, implicit, local)
    pp, m = strategy.pp, strategy.micro_batches
    ranges = stage_ranges(len(table.cost.blocks), pp) if table.cost.blocks else [(0, 0)] * pp
    # stages that cost the same, once: (stage, its dp and its mp gradient sync)
    priced: dict[tuple, tuple[_Stage, tuple[float, float], tuple[float, float]]] = {}
    stages, dp, mp_grads = [], [], []
    for k, (start, stop) in enumerate(ranges):
        key = (table.signature(start, stop), k == 0, k == pp - 1)
        if key not in priced:
            stage = _stage(ctx, k, start, stop)
            priced[key] = (stage, _dp_sync(ctx, stage, stop - start), _mp_grad_sync(ctx, stage, stop - start))
        stages.append(priced[key][0])
        dp.append(priced[key][1])
        mp_grads.append(priced[key][2])
    pipeline_s, bubble_s = _pipeline_time(strategy, [s.time_s for s in stages])
    dp_s = max(t for t, _ in dp)
    mp_grad_s = max(t for t, _ in mp_grads)
    optimizer_s = max(s.optimizer_s(setup.device) for s in stages)
    if strategy.schedule == "sequential":
        # The sequential schedule runs the whole model on every rank (stage hand-off hooks, no
        # PipelineModel): each rank's optimizer holds every parameter and calls its update, the
        # other stages' skipped by Paddle but each still dispatched (one fixed op cost each).
        tensors = sum(s.param_tensors for s in stages)
        optimizer_s = max(
            s.optimizer_s(setup.device) + (tensors - s.param_tensors) * fixed_op_time(setup.device) for s in stages
        )
    step = pipeline_s + dp_s + mp_grad_s + optimizer_s
    # 1F1B: stage k holds the activations of min(pp - k, m) micro-batches; otherwise of one.
    in_flight = [min(pp - k, m) if strategy.schedule in ("1F1B", "VPP") else 1 for k in range(pp)]
    activations = [n * s.activations_per_micro_batch + s.activations_working for n, s in zip(in_flight, stages)]
    peak_stage = max(range(pp), key=lambda k: stages[k].states.total + activations[k])
    peak, peak_activations = stages[peak_stage], activations[peak_stage]
    seq = setup.seq_len
    model_flops = 3 * table.cost.forward_flops(setup.global_batch * seq, seq)
    est = Estimate(
        step_time_s=step,
        tokens_per_s=setup.global_batch * seq / step if step > 0 else 0.0,
        mfu=model_flops / (step * setup.world * setup.device.peak_flops[setup.dtype]) if step > 0 else 0.0,
        memory=MemoryEstimate(
            params=round(peak.states.params),
            grads=round(peak.states.grads),
            optimizer=round(peak.states.optimizer),
            activations=round(peak_activations),
            total=round(peak.states.total + peak_activations),
        ),
        comm_bytes=CommEstimate(
            mp=round(m * max(s.mp_bytes for s in stages) + max(b for _, b in mp_grads)),
            dp=round(max(b for _, b in dp)),
            pp=round(m * max(s.p2p_bytes for s in stages)),
            ep=round(m * max(s.ep_bytes for s in stages)),
            implicit=round(m * max(s.implicit_bytes for s in stages)),
        ),
    )
    return Breakdown(
        est,
        compute_s=m * max(s.compute_s for s in stages),
        mp_comm_s=m * max(s.mp_s for s in stages) + mp_grad_s,
        dp_comm_s=dp_s,
        pp_comm_s=m * max(s.p2p_s for s in stages),
        bubble_s=bubble_s,
        optimizer_s=optimizer_s,
        peak_stage=peak_stage,
        ep_comm_s=m * max(s.ep_s for s in stages),
    )


def _stage(ctx: _Context, k: int, start: int, stop: int) -> _Stage:
    """Compute, collectives and memory of stage ``k`` (blocks ``start:stop``) per micro-batch."""
    edges = ([ctx.cost.first] if k == 0 else []) + ([ctx.cost.last] if k == ctx.strategy.pp - 1 else [])
    forward_s, backward_s = _stage_compute(ctx, start, stop, edges)
    mp_s, mp_bytes, implicit_bytes = _stage_mp_comm(ctx, start, stop, edges)
    p2p_s, p2p_bytes = _stage_handoff(ctx, k, start, stop)
    experts = _stage_experts(ctx, start, stop)
    forward_s += experts.shared_s
    backward_s += (3 if ctx.setup.recompute == "full" else 2) * experts.shared_s
    blocks = ctx.cost.blocks[start:stop]
    whole = [n for b in blocks for n in multi_query_whole(b, ctx.strategy.mp)]
    # each block's local-view parameters a rank holds, and of those the ones it computes with
    # (keeps for the backward), where local views run (not at mp 1)
    runs = runs_local_views(ctx.strategy)
    views = [view_params_per_rank(b, ctx.strategy.mp) for b in blocks] if runs else []
    kept = [view_params_kept(b, ctx.strategy.mp) for b in blocks] if runs else []
    params, states, activations, working, tensors = _stage_memory(ctx, start, stop, edges, experts, sum(whole), kept)
    return _Stage(
        forward_s + backward_s,
        backward_s,
        mp_s,
        mp_bytes,
        implicit_bytes,
        p2p_s,
        p2p_bytes,
        states,
        activations,
        working,
        params,
        tensors,
        ep_s=experts.ep_s,
        ep_bytes=experts.ep_bytes,
        moe_grads=experts.moe_grads,
        mp_grad_params=sum(whole),
        mp_grad_tensors=len(whole),
        view_params=sum(views),
        view_tensors=sum(b.view_param_tensors for b in blocks) if views else 0,
        lookup_rows=sum(e.lookup_table / ctx.vocab_div for e in edges),
        lookup_local=any(ctx.looks_up_locally(e) for e in edges),
        lookup_tied=len(edges) == 2 and ctx.cost.tied_vocab_params > 0,
    )


def _stage_compute(ctx: _Context, start: int, stop: int, edges: list[EdgeCost]) -> tuple[float, float]:
    """Compute: forward, backward twice the forward, plus what recompute does again in backward
    (seconds of the stage's blocks and ``edges`` per micro-batch: forward, backward)."""
    table, tokens = ctx.table, ctx.tokens
    forward_s = selective_s = rescore_s = 0.0
    for index in range(start, stop if not table.uniform else min(stop, start + 1)):
        block_s, block_selective_s, block_rescore_s = ctx.block_forward(index)
        times = 1 if not table.uniform else stop - start
        forward_s, selective_s = forward_s + times * block_s, selective_s + times * block_selective_s
        rescore_s += times * block_rescore_s
    blocks_s = forward_s
    for edge in edges:
        shaped = sum(2.0 * g.n * g.k / (ctx.vocab_div if g.split == "vocab" else 1) for g in edge.gemms)
        flops = edge.flops_vocab_per_token / ctx.vocab_div + edge.flops_whole_per_token
        forward_s += (
            sum(ctx.gemm_time(g) for g in edge.gemms)
            + ctx.roof_time((flops - shaped) * tokens)
            + ctx.moved_time(edge.moved)
        )
    recomputed_s = {"full": blocks_s, "selective": selective_s}.get(ctx.setup.recompute, 0.0) + rescore_s
    return forward_s, 2 * forward_s + recomputed_s


def _stage_mp_comm(ctx: _Context, start: int, stop: int, edges: list[EdgeCost]) -> tuple[float, float, float]:
    """Tensor-parallel all-reduces and the gathers of fused projections (forward again under full
    recompute) and implicit collectives: (seconds, bytes sent, of which implicit)."""
    mp, tokens, width, table = ctx.strategy.mp, ctx.tokens, ctx.width, ctx.table
    mp_link = ctx.link(mp, 1)
    collectives = [_allreduces(ctx, "fwd", start, stop, edges), _allreduces(ctx, "bwd", start, stop, edges)]
    gathers = [
        (table.total(f"gather_{d}_per_token", start, stop), table.total(f"gather_{d}_count", start, stop))
        for d in ("fwd", "bwd")
    ]
    if ctx.setup.recompute == "full":
        collectives.append(collectives[0])
        gathers.append(gathers[0])
    if ctx.setup.recompute == "selective":  # the recomputed sub-layers' forward collectives (_selective_mp)
        collectives.append(_selective_mp(ctx, "allreduce", start, stop))
        gathers.append(_selective_mp(ctx, "gather", start, stop))
    mp_s = sum(all_reduce_time(n * tokens * width, mp, mp_link, count) for n, count in collectives)
    mp_bytes = sum(all_reduce_bytes(n * tokens * width, mp) for n, _ in collectives)
    mp_s += sum(all_gather_time(n * tokens * width, mp, mp_link, round(count)) for n, count in gathers)
    mp_bytes += sum(all_gather_bytes(n * tokens * width, mp) for n, _ in gathers)
    for seconds, sent, _ in _lookups(ctx, edges):
        mp_s, mp_bytes = mp_s + seconds, mp_bytes + sent
    implicit_bytes = 0.0
    if ctx.implicit and mp > 1 and ctx.cost.blocks:
        share = (stop - start) / len(ctx.cost.blocks)  # the implicit collectives sit in the blocks
        implicit_bytes = ctx.implicit.sent_per_token * tokens * share
        mp_s += (
            share * ctx.implicit.count * 2 * (mp - 1) * mp_link.step_latency(mp) + implicit_bytes / mp_link.bandwidth
        )
    return mp_s, mp_bytes, implicit_bytes


def _selective_mp(ctx: _Context, kind: str, start: int, stop: int) -> tuple[float, int]:
    """(elements per token, collectives) of ``kind`` (``allreduce``, ``gather``) over mp that
    the sub-layers selective recompute runs again run again in the backward (``BlockCost.selective``:
    the gathers of their fused projections, the sums of row outputs read inside them; a local
    view's none)."""
    table = ctx.table
    return table.total(f"selective.{kind}_fwd_per_token", start, stop), int(
        table.total(f"selective.{kind}_fwd_count", start, stop)
    )


def _stage_handoff(ctx: _Context, k: int, start: int, stop: int) -> tuple[float, float]:
    """Pipeline hand-off to the next stage: the activation forward, its gradient backward
    (seconds, bytes)."""
    strategy, tokens, width = ctx.strategy, ctx.tokens, ctx.width
    pp, mp = strategy.pp, strategy.mp
    p2p_s = p2p_bytes = 0.0
    if k < pp - 1 and stop > start:
        handoff = ctx.cost.blocks[stop - 1].output_per_token * tokens * width / ctx.act_div
        p2p_s, p2p_bytes = 2 * p2p_time(handoff, ctx.link(pp, mp * strategy.dp)), 2 * handoff
    if strategy.schedule == "VPP" and stop > start:
        # Each rank hands each of its chunks on (the last rank wraps around to the first, except
        # after the model's last chunk): v hand-offs each way, v - 1 on the last rank.
        v = strategy.virtual_stages
        sends = v if k < pp - 1 else v - 1
        handoff = ctx.cost.blocks[stop - 1].output_per_token * tokens * width / ctx.act_div
        one = p2p_time(handoff, ctx.link(pp, mp * strategy.dp))
        p2p_s, p2p_bytes = 2 * sends * one, 2 * sends * handoff
    return p2p_s, p2p_bytes


@dataclass(frozen=True)
class _StageExperts:
    """What the MoE layers of a stage add, when they run locally (all zero otherwise)."""

    moe: list[BlockCost]  # the stage's blocks with experts
    ep_s: float = 0.0  # the ep group's gathers and sums
    ep_bytes: float = 0.0
    expert_params: float = 0.0  # elements of the experts this rank does not hold
    dropped_tensors: float = 0.0
    shared_s: float = 0.0  # the shared experts the group's first rank runs for the others
    moe_grads: _MoeGrads | None = None


def _stage_experts(ctx: _Context, start: int, stop: int) -> _StageExperts:
    """Expert parallelism (the module docstring): around each MoE layer, an all-gather of the ep
    group's inputs and an all-reduce of the gathered output, ep x B each, on ep ranks stride mp
    (neighbours on the dp axis); the backward does the same, full recompute the forward again.
    Each rank then holds 1 / ep of the experts, whole (the MoE layer is not split over mp)."""
    strategy, setup, tokens, width = ctx.strategy, ctx.setup, ctx.tokens, ctx.width
    ep, moe = strategy.ep, [b for b in ctx.cost.blocks[start:stop] if b.experts]
    if not (
        runs_moe_locally(strategy, bool(ctx.cost.local_only_in_moe)) and moe
    ):  # at ep 1: no gathers, the gradient sums alone
        return _StageExperts(moe)
    # The shared experts run on the group's first rank alone, on ep x the tokens: that rank,
    # the slowest, does (ep - 1) x more of them than one rank's tokens (at the compute roof).
    gathered = ep * sum(b.dispatch_per_token for b in moe) * tokens * width
    link, passes = ctx.link(ep, strategy.mp), 3 if setup.recompute == "full" else 2
    return _StageExperts(
        moe,
        ep_s=passes * (all_gather_time(gathered, ep, link, len(moe)) + all_reduce_time(gathered, ep, link, len(moe))),
        ep_bytes=passes * (all_gather_bytes(gathered, ep) + all_reduce_bytes(gathered, ep)),
        expert_params=sum(b.expert_params for b in moe) * (1 - 1 / ep),
        dropped_tensors=sum(b.expert_tensors for b in moe) * (1 - 1 / ep),
        shared_s=ctx.roof_time((ep - 1) * sum(b.shared_flops_per_token for b in moe) * tokens),
        moe_grads=_MoeGrads(
            router_params=sum(b.router_params for b in moe),
            router_tensors=sum(b.router_tensors for b in moe),
            expert_params=sum(b.expert_params for b in moe) / ep,
            expert_tensors=round(sum(b.expert_tensors for b in moe) / ep),
        ),
    )


def _stage_memory(
    ctx: _Context,
    start: int,
    stop: int,
    edges: list[EdgeCost],
    experts: _StageExperts,
    held_whole: float = 0.0,
    views: list[float] | None = None,
) -> tuple[float, StateBytes, float, float, int]:
    """Memory: model states under ZeRO, activations per micro-batch in flight: (parameter
    elements per rank, their states, activation bytes per micro-batch, working bytes alive
    once, parameter tensors). ``held_whole``: elements of split parameters each mp rank holds
    whole (fused multi-query weights, :func:`multi_query_whole`); ``views``: elements of each
    block's local-view parameters a rank computes with (:func:`view_params_kept`), which ZeRO 3
    gathers over dp for the views and keeps for their backward."""
    table, strategy, setup = ctx.table, ctx.strategy, ctx.setup
    mp, seq, tokens, width, ep, moe = strategy.mp, setup.seq_len, ctx.tokens, ctx.width, strategy.ep, experts.moe
    params = (
        (table.total("params_split", start, stop) - held_whole) / mp
        + held_whole
        + table.total("params_whole", start, stop)
        - experts.expert_params
        + sum(e.params_vocab / ctx.vocab_div + e.params_whole for e in edges)
        - (ctx.cost.tied_vocab_params / ctx.vocab_div if len(edges) == 2 else 0)
    )  # one stage holds both
    states = model_state_bytes(params, strategy.dp, strategy.sharding_stage, setup.dtype, setup.optimizer)
    per_token = _stage_activation_bytes(table, start, stop, mp, ctx.act_div, seq, width, setup.recompute)
    per_token += sum(e.saved_whole.bytes(width) + e.saved_vocab.bytes(width) / ctx.vocab_div for e in edges)
    working = 0.0
    rebuilt = {"full": table.largest_block, "selective": table.largest_selective}.get(setup.recompute)
    if rebuilt is not None and stop > start:  # what the backward rebuilds, one (sub-)layer at a time
        working = tokens * _block_activation_bytes(rebuilt, mp, ctx.act_div, seq, width)
    # A vocabulary-split table gathered for the lookup's backward (not when looked up locally):
    # whole on every mp rank with its whole gradient, before that is sliced to this rank's rows. Counted once, at the peak: an
    # upper bound (the embedding's backward runs when most of its micro-batch's activations are
    # freed).
    working += sum(held for _, _, held in _lookups(ctx, edges))
    if ep > 1 and moe:  # the MoE layer's own saved tensors hold the ep group's tokens
        router = [(ep - 1) * b.saved_router.bytes(width) for b in moe]
        if setup.recompute == "full":  # rebuilt one block at a time
            working += tokens * max(router)
        else:
            per_token += sum(router)
    tensors = round(
        table.total("param_tensors", start, stop) + sum(e.param_tensors for e in edges) - experts.dropped_tensors
    )
    held = 0.0
    if strategy.sharding_stage == 3 and strategy.dp > 1:
        # Paddle gathers a parameter at the op reading it and frees it after; the op's backward
        # gathers it again and holds it with its gradient, whole over dp until ZeRO's hook
        # reduce-scatters it (measured, docs/paddle-notes.md): the largest one's, once.
        working += 2 * _largest_gathered(ctx, start, stop, edges) * width
    if strategy.sharding_stage == 3 and strategy.dp > 1 and views:  # the views' parameters gathered over dp
        if setup.recompute == "full":  # gathered again as each block is rebuilt, held while it is
            working += max(views) * width
        else:  # held from each micro-batch's forward to its backward
            held = sum(views) * width
    return params, states, tokens * per_token + held, working, tensors


def _largest_gathered(ctx: _Context, start: int, stop: int, edges: list[EdgeCost]) -> float:
    """Elements one rank gathers over dp of the largest parameter of blocks ``start:stop`` and
    ``edges``: split over mp (or the vocabulary), or held whole (a multi-query weight held whole
    over mp, :func:`multi_query_whole`). An expert's is counted as if every rank held it."""
    mp, blocks = ctx.strategy.mp, ctx.cost.blocks[start:stop]
    sizes = [max(b.largest_split / mp, b.largest_whole, *multi_query_whole(b, mp)) for b in blocks]
    sizes += [max(e.largest_vocab / ctx.vocab_div, e.largest_whole) for e in edges]
    return max(sizes, default=0.0)


def _block_forward(ctx: _Context, block: BlockCost) -> tuple[float, float]:
    """(forward seconds of ``block`` (a block, or the sub-layer selective recompute runs again)
    for one micro-batch on one rank, and the part of its core every backward recomputes).

    A flash core (``block.fused_attention``) is one kernel: its FLOPs at the compute roof or its
    reads and writes of q, k, v and the output at the memory roof, whichever is longer, plus one
    op's fixed cost per core (two traced matmuls each). Its backward recomputes the scores, one of
    its two matmuls: half its forward again (FlashAttention-2's backward: 2.5x the forward's
    FLOPs, Dao 2023, sec. 3.2).
    """
    mp, seq, share = ctx.strategy.mp, ctx.setup.seq_len, core_share(block, ctx.strategy.mp)
    shaped = sum(2.0 * g.n * g.k for g in block.gemms)
    linear_s = sum(ctx.gemm_time(g) for g in block.gemms) + ctx.roof_time(
        (block.flops_per_token - shaped) / mp * ctx.tokens
    )
    core_flops = block.flops_per_token_seq * seq * ctx.tokens * share
    moved_s = ctx.moved_time(replace(block.moved, inside_seq=0.0))
    if block.fused_attention:
        device = ctx.setup.device
        io_bytes = block.attention_io_per_token * ctx.tokens * share * ctx.width
        cores = max(block.attention_matmuls // 2, 1)
        core_s = max(ctx.roof_time(core_flops), memory_time(io_bytes, device)) + cores * fixed_op_time(device)
        return linear_s + core_s + moved_s, ctx.roof_time(core_flops) / 2
    if block.attention_matmuls and core_flops > 0:
        # One batched matmul per traced attention matmul, (seq x seq) by the head dim, over the
        # micro-batch's sequences x this rank's heads.
        batch = max(ctx.tokens / seq, 1) * max(block.num_heads * share, 1)
        per_matmul = core_flops / block.attention_matmuls
        head_dim = per_matmul / (2.0 * seq * seq * batch)
        core_s = block.attention_matmuls * matmul_time(seq, seq, head_dim, ctx.setup.device, ctx.setup.dtype, batch)
    else:
        core_s = ctx.roof_time(core_flops)
    core_s += ctx.moved_time(Moved(inside_seq=block.moved.inside_seq), share)
    return linear_s + core_s + moved_s, 0.0


def _allreduces(ctx: _Context, direction: str, start: int, stop: int, edges: list[EdgeCost]) -> tuple[float, int]:
    """(elements per token, collectives) all-reduced over mp in one direction on a stage: the
    blocks', and backward the column-parallel head's input gradient (the vocabulary-split
    lookup's output, when all-reduced: :func:`_lookups`)."""
    elements = ctx.table.total(f"allreduce_{direction}_per_token", start, stop)
    count = int(ctx.table.total(f"allreduce_{direction}_count", start, stop))
    if ctx.vocab_div > 1 and direction == "bwd":
        for edge in edges:
            extra = edge.allreduce_bwd_per_token
            elements, count = elements + extra, count + (1 if extra else 0)
    return elements, count


#: (seconds, bytes one rank sends) of each collective, by the name Paddle's behaviour is told in.
_COLLECTIVES = {"all_gather": (all_gather_time, all_gather_bytes), "all_reduce": (all_reduce_time, all_reduce_bytes)}


def _lookups(ctx: _Context, edges: list[EdgeCost]) -> list[tuple[float, float, float]]:
    """The collectives the token lookups of a stage's ``edges`` run over mp per micro-batch when
    the vocabulary is split, as :func:`autodist.planner.cost.comm.vocab_lookup_collective` says:
    one all-reduce of the output where the plan looks up on local tensors (the layer can and the
    strategy runs them, :func:`~autodist.schemas.parallel_dims.runs_local_views`, emit's rule too;
    ``ctx.local_views``),
    else the whole table all-gathered in the forward and again in the backward (full recompute
    does not redo the edges): ``[(seconds, bytes one rank sends, bytes held for the backward)]``,
    exposed."""
    if ctx.vocab_div == 1:
        return []
    mp, link, out = ctx.strategy.mp, ctx.link(ctx.strategy.mp, 1), []
    for edge in edges:
        if edge.lookup_table:
            output = ctx.tokens * edge.lookup_output if ctx.looks_up_locally(edge) else 0
            name, message, times, working = vocab_lookup_collective(edge.lookup_table, output, ctx.width)
            time_of, sent = _COLLECTIVES[name]
            out.append((time_of(times * message, mp, link, times), sent(times * message, mp), working))
    return out


def _pipeline_time(strategy: Strategy, stage_times: list[float]) -> tuple[float, float]:
    """(time of all micro-batches through the pipeline, of which bubble)."""
    m, pp, slowest = strategy.micro_batches, strategy.pp, max(stage_times)
    if pp == 1:
        return m * slowest, 0.0
    if strategy.schedule == "sequential":
        total = m * sum(stage_times)
    else:
        chunks = strategy.virtual_stages if strategy.schedule == "VPP" else 1
        total = (m + (pp - 1) / chunks) * slowest  # bubble (pp - 1) / (v m) of the ideal
    return total, total - m * slowest


def overlapped(comm_s: float, compute_s: float, chunks: int, loss: float = 0.0) -> float:
    """Exposed seconds of ``comm_s`` of communication run in ``chunks`` equal pieces against
    ``compute_s`` of compute in as many pieces, each piece of communication overlapping one of
    compute (a two-stage pipeline: a gather ahead of the block that needs it, a bucket's
    reduction after the block that made it). One piece is always exposed. ``loss``: the
    fraction of compute speed lost while a collective runs beside it (the device's,
    :func:`~autodist.planner.cost.compute.overlap_loss`: NCCL's kernels hold SMs). A piece of
    ``c`` seconds of communication beside ``k`` of compute: compute runs at ``1 - loss`` for
    ``c``, then at full speed, so the pair takes ``max(c, k + loss c)``: each of the ``n - 1``
    overlapped pieces exposes ``max(c - k, loss c)`` (a link that keeps up still costs
    ``loss c``; one that does not exposes ``c - k``, or ``loss c`` while the slowed compute
    outlasts it). With ``loss`` 1 nothing hides, as where collectives block compute.

    >>> overlapped(1.0, 10.0, 4), overlapped(10.0, 4.0, 4)   # 4 x 2.5 + 1 = 11 = 4 + 7
    (0.25, 7.0)
    >>> round(overlapped(1.0, 10.0, 4, loss=0.24), 6)    # keeps up: 0.25 + 3 x 0.24 x 0.25
    0.43
    >>> round(overlapped(10.0, 4.0, 4, loss=0.24), 6)    # link-bound: 2.5 + 3 x (2.5 - 1), as without loss
    7.0
    >>> round(overlapped(4.4, 4.0, 4, loss=0.24), 6)     # 1.1 beside 1: 1.1 + 3 x max(0.1, 0.264)
    1.892
    >>> overlapped(1.0, 10.0, 4, loss=1.0)               # nothing hides
    1.0
    """
    if comm_s <= 0:
        return 0.0
    n = max(chunks, 1)
    c, k = comm_s / n, compute_s / n
    return c + (n - 1) * max(c - k, loss * c)


def _dp_sync(ctx: _Context, stage: _Stage, num_blocks: int) -> tuple[float, float]:
    """(exposed seconds, bytes sent) of one stage's data-parallel synchronisation per step."""
    dp, zero, m = ctx.strategy.dp, ctx.strategy.sharding_stage, ctx.strategy.micro_batches
    link = ctx.link(dp, ctx.strategy.mp)
    state_bytes, grad_bytes = stage.params * ctx.width, stage.params * ctx.grad_width
    backward_s, forward_s = stage.backward_s, stage.compute_s - stage.backward_s
    chunks, count = max(num_blocks, 1), max(stage.param_tensors, 1)  # one collective per parameter
    if zero == 0 and stage.moe_grads:
        return _dp_sync_with_experts(ctx, stage, stage.moe_grads, backward_s, chunks)
    if zero == 0:
        return ctx.overlapped(all_reduce_time(grad_bytes, dp, link, count), backward_s, chunks), all_reduce_bytes(
            grad_bytes, dp
        )
    reduce = reduce_scatter_time(grad_bytes, dp, link, count)
    reduced = all_gather_bytes(grad_bytes, dp)  # a reduce-scatter sends what an all-gather does
    if zero < 3:
        # Updated parameters are gathered after the optimizer step: nothing left to hide behind.
        after = all_gather_time(state_bytes, dp, link, count)
        return ctx.overlapped(reduce, backward_s, chunks) + after, all_gather_bytes(state_bytes, dp) + reduced
    # Each op reading a parameter gathers it, in the forward and again in the backward (Paddle's
    # reshard before each op: nothing gathered is held, measured), so a table an LM head on the
    # stage reads too (tied) is gathered twice in each. But the local views' parameters are held
    # from the forward to the backward, not gathered again there (applier/modes/local_calls.py
    # param_local), unless full recompute runs the forward again in the backward; and a local
    # lookup gathers its rows in the forward alone (its backward needs no table values, measured).
    held = stage.view_params * ctx.width if ctx.setup.recompute != "full" else 0.0
    tied, local = stage.lookup_tied, stage.lookup_local
    rows, table = stage.lookup_rows * ctx.width, 1 if stage.lookup_rows else 0
    forward_bytes, forward_count = state_bytes + tied * rows, count + tied * table
    backward_bytes = state_bytes - held + (tied - local) * rows
    backward_count = count - (stage.view_tensors if held else 0) + (tied - local) * table
    gather = all_gather_time(forward_bytes, dp, link, forward_count)  # block by block
    again = all_gather_time(backward_bytes, dp, link, max(backward_count, 1))
    exposed = (
        m * ctx.overlapped(gather, forward_s, chunks)
        + (m - 1) * ctx.overlapped(again, backward_s, chunks)
        + ctx.overlapped(again + reduce, backward_s, chunks)
    )
    return exposed, m * (all_gather_bytes(forward_bytes, dp) + all_gather_bytes(backward_bytes, dp)) + reduced


def _mp_grad_sync(ctx: _Context, stage: _Stage, num_blocks: int) -> tuple[float, float]:
    """(exposed seconds, bytes sent) of one stage's gradient all-reduces over mp per step: the
    fused multi-query weights each mp rank holds whole (``stage.mp_grad_params``), whose
    gradients each rank computes its share of, summed over mp in the backward of every
    micro-batch (applier/modes/local_calls.py ``_call_value``: they then enter the optimizer, and
    ZeRO's gradient hook, Partial over dp alone). One collective per parameter on the mp link
    per micro-batch, overlapped with that micro-batch's backward, one piece per block.
    """
    if not stage.mp_grad_params:
        return 0.0, 0.0
    mp, grads, m = ctx.strategy.mp, stage.mp_grad_params * ctx.width, ctx.strategy.micro_batches
    seconds = all_reduce_time(grads, mp, ctx.link(mp, 1), max(stage.mp_grad_tensors, 1))
    return m * ctx.overlapped(seconds, stage.backward_s, max(num_blocks, 1)), m * all_reduce_bytes(grads, mp)


def _dp_sync_with_experts(
    ctx: _Context, stage: _Stage, moe: _MoeGrads, backward_s: float, chunks: int
) -> tuple[float, float]:
    """(exposed seconds, bytes sent) of :func:`_dp_sync` under expert parallelism (ZeRO 0): the
    gradients outside the MoE layers all-reduced over dp during the backward as usual; the MoE
    layers' summed by apply_plan after it, exposed: the routers' over dp, the held experts' over
    the dp / ep ranks holding the same experts (one each ep-th dp rank: stride mp x ep)."""
    dp, ep, mp, width = ctx.strategy.dp, ctx.strategy.ep, ctx.strategy.mp, ctx.grad_width
    link, replicas = ctx.link(dp, mp), dp // ep
    rest = (stage.params - moe.router_params - moe.expert_params) * width
    rest_count = max(stage.param_tensors - moe.router_tensors - moe.expert_tensors, 1)
    router, experts = moe.router_params * width, moe.expert_params * width
    exposed = (
        ctx.overlapped(all_reduce_time(rest, dp, link, rest_count), backward_s, chunks)
        + all_reduce_time(router, dp, link, moe.router_tensors)
        + all_reduce_time(experts, replicas, ctx.link(replicas, mp * ep), moe.expert_tensors)
    )
    return exposed, all_reduce_bytes(rest, dp) + all_reduce_bytes(router, dp) + all_reduce_bytes(experts, replicas)


def _stage_activation_bytes(
    table: StageTable, start: int, stop: int, mp: int, act_div: int, seq: int, width: int, recompute: str
) -> float:
    """Bytes per token one micro-batch leaves saved on a stage's blocks."""
    if recompute == "full":
        # Only each block's input is kept (Korthikanti sec. 4.3); split with sequence parallelism.
        return sum(b.output_per_token for b in table.cost.blocks[start:stop]) * width / act_div
    kept = _saved_bytes(table, "", start, stop, mp, act_div, seq, width)
    if recompute == "selective":  # all but what the recomputed sub-layers saved (BlockCost.selective)
        kept -= _saved_bytes(table, "selective.", start, stop, mp, act_div, seq, width)
    return kept


def _saved_bytes(
    table: StageTable, prefix: str, start: int, stop: int, mp: int, act_div: int, seq: int, width: int
) -> float:
    """Bytes per token one rank holds of the saved fields ``prefix`` + ``saved_*`` of blocks
    ``start:stop``: outside the mp region split by sequence parallelism alone, inside 1/mp, the
    scores of whole cores whole and of the rest 1/mp (:func:`core_share`)."""
    total = table.saved(f"{prefix}saved_outside", start, stop).bytes(width) / act_div
    total += table.saved(f"{prefix}saved_inside", start, stop).bytes(width) / mp
    scores, whole = (
        table.saved(f"{prefix}{name}", start, stop).bytes(width) for name in ("saved_inside_seq", "saved_whole_seq")
    )
    return total + (whole + (scores - whole) / mp) * seq


def _block_activation_bytes(block: BlockCost, mp: int, act_div: int, seq: int, width: int) -> float:
    """One block's full activations per token: what full recompute rebuilds during backward (of a
    recomputed sub-layer, ``BlockCost.selective``: what selective recompute rebuilds)."""
    return (
        block.saved_outside.bytes(width) / act_div
        + block.saved_inside.bytes(width) / mp
        + block.saved_inside_seq.bytes(width) * seq * core_share(block, mp)
    )
