"""``autodist-plan --explain``: the search's choice, its runners-up and the rejected, as text.

Example, on a cost description written by hand (four blocks of a Llama-7B-sized layer; the
numbers are left out here, they move with the cost model)::

    >>> from autodist.planner.cost.blocks import BlockCost, ModelCost
    >>> from autodist.planner.cost.search import SearchRequest, search
    >>> block = BlockCost(layer="layers.0", num_heads=32, num_kv_heads=32, intermediate_size=11008,
    ...                   params_split=200_000_000, flops_per_token=4e8, allreduce_fwd_per_token=8192,
    ...                   allreduce_bwd_per_token=8192, allreduce_fwd_count=2, allreduce_bwd_count=2,
    ...                   output_per_token=4096)
    >>> cost = ModelCost(blocks=(block,) * 4, hidden_size=4096, traced_batch=32, traced_seq=1024)
    >>> print(explain_table(search(cost, SearchRequest(devices_per_node=8))))  # doctest: +ELLIPSIS
    device h100-sxm x 8 (1 node(s) x 8), global batch 32 x seq 1024, dtype bf16, adam, recompute none; ... priced
     #  strategy ... step  tokens/s  MFU ... activations  mp comm ... implicit comm
     1  dp...
    where the time of #1 goes (per step): compute ...
    kernels: attention eager (as traced)
    rejected:
    ...dp1 mp1 pp8 m1: pp=8 is more than the 4 blocks of the model (each stage needs at least one block)
"""

from __future__ import annotations

from collections import Counter

from autodist.planner.cost.search import SearchResult
from autodist.planner.cost.strategy_analysis import AnalysisFor
from autodist.planner.recognise.analysis import ModelAnalysis
from autodist.planner.recognise.reshards import sublayer_modes
from autodist.planner.review.format import human_bytes, human_count, human_seconds
from autodist.schemas.describe import strategy_text
from autodist.schemas import Candidate, Plan

#: The table's columns: heading, and whether its cells are numbers (right-aligned). Sizes, times
#: and counts are written as ``autodist-plan show`` writes them (binary units: MiB, GiB).
_COLUMNS = (
    ("#", True),
    ("strategy", False),
    ("step", True),
    ("tokens/s", True),
    ("MFU", True),
    ("memory", True),
    ("params", True),
    ("grads", True),
    ("optimizer", True),
    ("activations", True),
    ("mp comm", True),
    ("dp comm", True),
    ("pp comm", True),
    ("implicit comm", True),
)


def explain_table(result: SearchResult) -> str:
    """The search result as a table for a terminal (the CLI prints it on stderr).

    Example::

        >>> print(explain_table(search(analysis, SearchRequest(devices_per_node=8))))  # doctest: +SKIP
    """
    lines = []
    if result.setup is not None:
        s = result.setup
        lines.append(
            f"device {s.device.name} x {s.world} ({s.nodes} node(s) x {s.devices_per_node}), "
            f"global batch {s.global_batch} x seq {s.seq_len}, dtype {s.dtype}, {s.optimizer}, "
            f"recompute {s.recompute}; {result.evaluated} strategies priced"
        )
    rows = [[heading for heading, _ in _COLUMNS]]
    rows += [_row(rank, candidate) for rank, candidate in enumerate([result.best, *result.accepted], start=1)]
    lines += aligned(rows, right=[number for _, number in _COLUMNS])
    if result.breakdowns:
        b = result.breakdowns[0]
        lines.append(
            f"where the time of #1 goes (per step): compute {human_seconds(b.compute_s)}, "
            f"mp comm {human_seconds(b.mp_comm_s)}, dp comm {human_seconds(b.dp_comm_s)} (exposed), "
            f"pp p2p {human_seconds(b.pp_comm_s)}, "
            + (f"ep gathers and sums {human_seconds(b.ep_comm_s)}, " if b.ep_comm_s else "")
            + f"pipeline bubble {human_seconds(b.bubble_s)}, "
            f"optimizer {human_seconds(b.optimizer_s)}; "
            f"memory peaks on stage {b.peak_stage}"
        )
    kernels = result.kernels
    lines.append(
        f"kernels: attention {kernels.attention} ({kernels.reason or 'as traced'})"
        + (f"; fused {', '.join(kernels.fused)}" if kernels.fused else "")
    )
    for note in result.notes:
        lines.append(f"note: {note}")
    if result.rejected:
        lines.append("rejected:")
        lines.extend(f"  {strategy_text(r.strategy, 'short')}: {r.reason}" for r in result.rejected)
    return "\n".join(lines)


def sublayer_lines(analysis: ModelAnalysis, plan: Plan) -> list[str]:
    """How the plan runs each block kind's sub-layers over mp
    (:func:`~autodist.planner.recognise.reshards.sublayer_modes`, the rule the estimate prices),
    one line per block kind; nothing at mp 1. A sub-layer that runs one way in some blocks and
    another way in others says how many of each.

    >>> sublayer_lines(analysis, plan)[1]     # GPT-2 at mp2      # doctest: +SKIP
    '  gpt_block x2: attention(qkv) local view; mlp(fc_in) split'
    """
    if plan.strategy.mp == 1:
        return []
    local = frozenset(view.layer for view in plan.local_view)
    for_plan = AnalysisFor(analysis)  # the analysis as the plan's strategy runs it, as emit placed it
    analysis = for_plan(for_plan.runs_as(plan.strategy, local))
    kinds: dict[str, list[list[str]]] = {}  # kind -> each block's sub-layers' modes
    described: dict[str, list[str]] = {}
    for block in analysis.blocks:
        modes = sublayer_modes(block, local)
        kinds.setdefault(block.kind, []).append([mode for _, _, mode in modes])
        described.setdefault(block.kind, [sub.description for _, sub, _ in modes])
    lines = [f"sub-layers over mp={plan.strategy.mp}, by block kind (as the estimate prices them):"]
    for kind, blocks in kinds.items():
        parts = []
        for i, description in enumerate(described[kind]):
            counts = Counter(modes[i] for modes in blocks if i < len(modes))
            if len(counts) == 1:
                parts.append(f"{description} {next(iter(counts))}")
            else:
                parts.append(f"{description} " + ", ".join(f"{mode} in {n}" for mode, n in counts.items()))
        lines.append(f"  {kind} x{len(blocks)}: {'; '.join(parts)}")
    lines.append(
        "  local view: each rank runs it on local tensors at 1/mp width, one all-reduce of its output forward "
        "and of its input gradient backward; gathered: its fused projection's output all-gathered, the rest "
        "whole on every rank, its input gradient gathered back; split: global view, Megatron's placements; "
        "replicated: whole on every rank"
    )
    return lines


def aligned(rows: list[list[str]], right: list[bool]) -> list[str]:
    """Rows of cells as lines whose columns line up: each column as wide as its widest cell,
    numbers (``right``) right-aligned, two spaces between columns.

    >>> aligned([["#", "step"], ["1", "7.3 ms"], ["10", "12.0 ms"]], right=[True, True])
    [' #     step', ' 1   7.3 ms', '10  12.0 ms']
    """
    widths = [max(len(row[i]) for row in rows) for i in range(len(right))]
    return [
        "  ".join(cell.rjust(w) if r else cell.ljust(w) for cell, w, r in zip(row, widths, right)).rstrip()
        for row in rows
    ]


def _row(rank: int, candidate: Candidate) -> list[str]:
    est = candidate.estimate
    mem, comm = est.memory, est.comm_bytes
    return [
        str(rank),
        strategy_text(candidate.strategy, "short"),
        human_seconds(est.step_time_s),
        human_count(est.tokens_per_s),
        f"{est.mfu:.0%}",
        *map(human_bytes, (mem.total, mem.params, mem.grads, mem.optimizer, mem.activations)),
        *map(human_bytes, (comm.mp, comm.dp, comm.pp, comm.implicit)),
    ]
