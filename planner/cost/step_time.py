"""Step time, memory and communication of one strategy, from a :class:`ModelCost`.

The model, per pipeline stage and micro-batch (all of it stated so a reviewer can argue with it):

- compute: forward matmul FLOPs x 3 for training (backward is twice the forward), plus one
  more forward of the blocks with full recompute, or of the attention core with selective
  recompute, at ``MATMUL_EFFICIENCY`` of the device's peak;
- tensor parallelism: each block's all-reduces (all-gather + reduce-scatter of the same size
  with sequence parallelism, which the ring model prices the same) on the mp group's link,
  not overlapped with compute;
- pipeline: a send of the block output forward and of its gradient backward per stage boundary;
  1F1B (and VPP, priced the same) takes (m + pp - 1) slots of the slowest stage, which is the
  bubble (pp - 1)/m; ``sequential`` runs stages one after another, no overlap at all;
- data parallelism: the gradient all-reduce (ZeRO 1/2: reduce-scatter, then an all-gather of
  the updated parameters; ZeRO 3: reduce-scatter, plus an all-gather of the parameters in
  forward and backward of every micro-batch) overlaps with the backward pass except for the
  last bucket, as DDP-style bucketing does (Li et al., "PyTorch Distributed", VLDB 2020);
  parameter all-gathers are exposed.

Memory is that of the most loaded stage: model states (ZeRO over dp) plus activations for the
micro-batches in flight (1F1B: stage k holds min(pp - k, m); otherwise one).

Example::

    >>> MATMUL_EFFICIENCY
    0.5
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from itertools import accumulate

from autodist.schemas import CommEstimate, DeviceProfile, Estimate, MemoryEstimate, Strategy

from .blocks import BlockCost, ModelCost, Saved
from .comm import all_gather_bytes, all_gather_time, all_reduce_bytes, all_reduce_time, group_link, p2p_time
from .memory import DTYPE_BYTES, model_state_bytes

#: Fraction of peak FLOP/s that transformer training sustains on large matmuls: Megatron-LM
#: reaches 41-52 % of peak end to end on A100 (Narayanan et al., SC 2021, table 1).
MATMUL_EFFICIENCY = 0.5
#: Part of device memory a plan may use: the rest is CUDA context, allocator fragmentation and
#: kernel workspaces.
MEMORY_USABLE = 0.9
RECOMPUTE_MODES = ("none", "selective", "full")


@dataclass(frozen=True)
class Setup:
    """What is fixed across the candidates of one search."""

    device: DeviceProfile
    devices_per_node: int
    nodes: int
    seq_len: int
    global_batch: int
    dtype: str = "bf16"
    optimizer: str = "adam"
    recompute: str = "none"

    @property
    def world(self) -> int:
        return self.devices_per_node * self.nodes

    @property
    def usable_memory(self) -> float:
        return self.device.memory_bytes * MEMORY_USABLE


@dataclass(frozen=True)
class Implicit:
    """Collectives Paddle inserts by itself: bytes one rank sends per token of a micro-batch
    (forward and backward), in ``count`` collectives each way."""

    sent_per_token: float = 0.0
    count: int = 0


@dataclass(frozen=True)
class Breakdown:
    """An estimate plus the times behind it (seconds per step), for ranking and explaining."""

    estimate: Estimate
    compute_s: float
    mp_comm_s: float
    dp_comm_s: float
    pp_comm_s: float
    bubble_s: float
    peak_stage: int

    @property
    def comm_bytes(self) -> int:
        c = self.estimate.comm_bytes
        return c.mp + c.dp + c.pp + c.implicit


class StageTable:
    """Prefix sums over the blocks, so a stage's totals cost O(1) whatever its size."""

    _FIELDS = ("params_split", "params_whole", "flops_per_token", "flops_per_token_seq",
               "allreduce_fwd_per_token", "allreduce_bwd_per_token", "allreduce_fwd_count", "allreduce_bwd_count")

    def __init__(self, cost: ModelCost):
        self.cost = cost
        self._prefix = {name: [0.0, *accumulate(getattr(b, name) for b in cost.blocks)] for name in self._FIELDS}
        for name in ("saved_outside", "saved_inside", "saved_inside_seq"):
            for part in ("floats", "masks"):
                values = (getattr(getattr(b, name), part) for b in cost.blocks)
                self._prefix[f"{name}.{part}"] = [0.0, *accumulate(values)]

    def total(self, name: str, start: int, stop: int) -> float:
        prefix = self._prefix[name]
        return prefix[stop] - prefix[start]

    def saved(self, name: str, start: int, stop: int) -> Saved:
        return Saved(self.total(f"{name}.floats", start, stop), self.total(f"{name}.masks", start, stop))

    @cached_property
    def largest_block(self) -> BlockCost | None:
        return max(self.cost.blocks, key=lambda b: (b.saved_outside + b.saved_inside).floats, default=None)


def stage_ranges(num_blocks: int, pp: int) -> list[tuple[int, int]]:
    """Blocks per stage, as even as possible, the first stages taking one more.

    >>> stage_ranges(10, 4)
    [(0, 3), (3, 6), (6, 8), (8, 10)]
    """
    base, extra = divmod(num_blocks, pp)
    bounds = [0]
    for k in range(pp):
        bounds.append(bounds[-1] + base + (1 if k < extra else 0))
    return list(zip(bounds, bounds[1:]))


def vocab_split(cost: ModelCost, mp: int) -> bool:
    """Whether embedding and head are split over the vocabulary (it must divide by mp)."""
    return mp > 1 and cost.vocab_size is not None and cost.vocab_size % mp == 0


def estimate(table: StageTable, strategy: Strategy, setup: Setup, implicit: Implicit | None = None) -> Breakdown:
    """Price one strategy. ``implicit``: the collectives Paddle inserts on its own for these
    placements (from the analysis), per micro-batch.

    Example: see ``tests/test_cost_formulas.py`` and :func:`autodist.planner.search.search`.
    """
    cost = table.cost
    dp, mp, pp, m = strategy.dp, strategy.mp, strategy.pp, strategy.micro_batches
    sp = strategy.sequence_parallel and mp > 1
    width = DTYPE_BYTES[setup.dtype]
    seq = setup.seq_len
    tokens = setup.global_batch // (dp * m) * seq  # tokens per micro-batch per dp rank
    peak = setup.device.peak_flops[setup.dtype] * MATMUL_EFFICIENCY
    split_vocab = vocab_split(cost, mp)
    vocab_div = mp if split_vocab else 1
    act_div = mp if sp else 1
    dpn = setup.devices_per_node
    mp_link = group_link(mp, 1, dpn, setup.device)
    dp_link = group_link(dp, mp, dpn, setup.device)
    pp_link = group_link(pp, mp * dp, dpn, setup.device)
    ranges = stage_ranges(len(cost.blocks), pp) if cost.blocks else [(0, 0)] * pp

    stage_times, stage_memory, stage_bwd = [], [], []
    mp_bytes = pp_bytes = 0.0
    compute_total = mp_time_total = pp_time_total = 0.0
    for k, (start, stop) in enumerate(ranges):
        edges = ([cost.first] if k == 0 else []) + ([cost.last] if k == pp - 1 else [])
        # -- compute
        fwd_blocks = (table.total("flops_per_token", start, stop) + table.total("flops_per_token_seq", start, stop) * seq) / mp
        fwd_edges = sum(e.flops_vocab_per_token / vocab_div + e.flops_whole_per_token for e in edges)
        flops = 3 * (fwd_blocks + fwd_edges)
        if setup.recompute == "full":
            flops += fwd_blocks
        elif setup.recompute == "selective":
            flops += table.total("flops_per_token_seq", start, stop) * seq / mp
        compute = flops * tokens / peak
        # -- tensor-parallel collectives
        fwd = (table.total("allreduce_fwd_per_token", start, stop), table.total("allreduce_fwd_count", start, stop))
        bwd = (table.total("allreduce_bwd_per_token", start, stop), table.total("allreduce_bwd_count", start, stop))
        if split_vocab:
            fwd = (fwd[0] + sum(e.allreduce_fwd_per_token for e in edges), fwd[1] + sum(
                1 for e in edges if e.allreduce_fwd_per_token))
            bwd = (bwd[0] + sum(e.allreduce_bwd_per_token for e in edges), bwd[1] + sum(
                1 for e in edges if e.allreduce_bwd_per_token))
        collectives = [fwd, bwd] + ([fwd] if setup.recompute == "full" else [])
        mp_time = sum(all_reduce_time(n * tokens * width, mp, mp_link, int(count)) for n, count in collectives)
        implicit_sent = implicit.sent_per_token * tokens if implicit and mp > 1 else 0.0
        if implicit_sent:
            mp_time += implicit.count * 2 * (mp - 1) * mp_link.latency_s + implicit_sent / mp_link.bandwidth
        mp_bytes = max(mp_bytes, sum(all_reduce_bytes(n * tokens * width, mp) for n, _ in collectives))
        # -- pipeline hand-off: activation forward, its gradient backward
        p2p = 0.0
        if pp > 1 and k < pp - 1 and stop > start:
            handoff = cost.blocks[stop - 1].output_per_token * tokens * width / act_div
            p2p = 2 * p2p_time(handoff, pp_link)
            pp_bytes = max(pp_bytes, 2 * handoff)
        stage_times.append(compute + mp_time + p2p)
        stage_bwd.append(compute * 2 / 3)
        compute_total = max(compute_total, compute)
        mp_time_total = max(mp_time_total, mp_time)
        pp_time_total = max(pp_time_total, p2p)
        # -- memory
        params = (table.total("params_split", start, stop) / mp + table.total("params_whole", start, stop)
                  + sum(e.params_vocab / vocab_div + e.params_whole for e in edges)
                  - (cost.tied_vocab_params / vocab_div if len(edges) == 2 else 0))  # one stage holds both
        states = model_state_bytes(params, dp, strategy.sharding_stage, setup.dtype, setup.optimizer)
        in_flight = min(pp - k, m) if strategy.schedule in ("1F1B", "VPP") else 1
        per_token = _stage_activation_bytes(table, start, stop, mp, act_div, seq, width, setup.recompute)
        per_token += sum(e.saved_whole.bytes(width) + e.saved_vocab.bytes(width) / vocab_div for e in edges)
        acts = in_flight * tokens * per_token
        if setup.recompute == "full" and table.largest_block is not None and stop > start:
            acts += tokens * _block_activation_bytes(table.largest_block, mp, act_div, seq, width)
        stage_memory.append((states, acts, params))

    # -- schedule
    if pp == 1:
        pipeline = m * stage_times[0]
    elif strategy.schedule == "sequential":
        pipeline = m * sum(stage_times)
    else:
        pipeline = (m + pp - 1) * max(stage_times)
    bubble = pipeline - m * max(stage_times) if pp > 1 else 0.0

    # -- data parallel (per stage, in parallel across stages; the slowest counts)
    dp_time, dp_bytes = 0.0, 0.0
    for k, (states, _acts, params) in enumerate(stage_memory):
        grad_bytes = params * width
        nblocks = max(1, ranges[k][1] - ranges[k][0])
        if strategy.sharding_stage == 0:
            sync, exposed_extra, sent = all_reduce_time(grad_bytes, dp, dp_link), 0.0, all_reduce_bytes(grad_bytes, dp)
        else:
            sync = all_gather_time(grad_bytes, dp, dp_link)  # reduce-scatter of the gradients
            gathers = 1 if strategy.sharding_stage < 3 else 2 * m
            exposed_extra = all_gather_time(gathers * grad_bytes, dp, dp_link, gathers)
            sent = (1 + gathers) * all_gather_bytes(grad_bytes, dp)
        exposed = max(sync - stage_bwd[k], sync / (nblocks + 1)) if sync > 0 else 0.0
        dp_time = max(dp_time, exposed + exposed_extra)
        dp_bytes = max(dp_bytes, sent)

    step = pipeline + dp_time
    peak_stage = max(range(pp), key=lambda k: stage_memory[k][0].total + stage_memory[k][1])
    states, acts, _ = stage_memory[peak_stage]
    model_flops = 3 * cost.forward_flops(setup.global_batch * seq, seq)
    tokens_per_step = setup.global_batch * seq
    est = Estimate(
        step_time_s=step,
        tokens_per_s=tokens_per_step / step if step > 0 else 0.0,
        mfu=model_flops / (step * setup.world * setup.device.peak_flops[setup.dtype]) if step > 0 else 0.0,
        memory=MemoryEstimate(
            params=round(states.params), grads=round(states.grads), optimizer=round(states.optimizer),
            activations=round(acts), total=round(states.total + acts)),
        comm_bytes=CommEstimate(
            mp=round(m * mp_bytes), dp=round(dp_bytes), pp=round(m * pp_bytes),
            implicit=round(m * implicit_sent)),
    )
    return Breakdown(est, compute_s=m * compute_total, mp_comm_s=m * mp_time_total, dp_comm_s=dp_time,
                     pp_comm_s=m * pp_time_total, bubble_s=bubble, peak_stage=peak_stage)


def _stage_activation_bytes(table: StageTable, start: int, stop: int, mp: int, act_div: int, seq: int,
                            width: int, recompute: str) -> float:
    """Bytes per token one micro-batch leaves saved on a stage's blocks."""
    if recompute == "full":
        # Only each block's input is kept (Korthikanti sec. 4.3); split with sequence parallelism.
        return sum(b.output_per_token for b in table.cost.blocks[start:stop]) * width / act_div
    total = table.saved("saved_outside", start, stop).bytes(width) / act_div
    total += table.saved("saved_inside", start, stop).bytes(width) / mp
    if recompute == "none":
        total += table.saved("saved_inside_seq", start, stop).bytes(width) * seq / mp
    return total


def _block_activation_bytes(block: BlockCost, mp: int, act_div: int, seq: int, width: int) -> float:
    """One block's full activations per token: what full recompute rebuilds during backward."""
    return (block.saved_outside.bytes(width) / act_div + block.saved_inside.bytes(width) / mp
            + block.saved_inside_seq.bytes(width) * seq / mp)
