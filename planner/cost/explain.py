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
    device h100-sxm x 8 (1 node(s) x 8), global batch 32 x seq 1024, bf16, adam, recompute none; ... priced
      #  strategy ... step(ms) ... tok/s ... MFU  mem(GB) = params/grads/opt/act ... comm(MB) mp/dp/pp/implicit
      1  dp...
    where the time of #1 goes (ms per step): compute ...
    rejected:
    ...dp1 mp1 pp8 m1: pp=8 is more than the 4 blocks of the model (each stage needs at least one block)
"""

from __future__ import annotations

from autodist.planner.cost.search import SearchResult, describe
from autodist.schemas import Candidate

_HEADER = (f"{'#':>3}  {'strategy':<30} {'step(ms)':>10} {'tok/s':>12} {'MFU':>6}  "
           f"{'mem(GB) = params/grads/opt/act':<34} {'comm(MB) mp/dp/pp/implicit'}")


def explain_table(result: SearchResult) -> str:
    """The search result as a table for a terminal (the CLI prints it on stderr).

    Example::

        >>> print(explain_table(search(analysis, SearchRequest(devices_per_node=8))))  # doctest: +SKIP
    """
    lines = []
    if result.setup is not None:
        s = result.setup
        lines.append(f"device {s.device.name} x {s.world} ({s.nodes} node(s) x {s.devices_per_node}), "
                     f"global batch {s.global_batch} x seq {s.seq_len}, {s.dtype}, {s.optimizer}, "
                     f"recompute {s.recompute}; {result.evaluated} strategies priced")
    lines.append(_HEADER)
    for rank, candidate in enumerate([result.best, *result.accepted], start=1):
        lines.append(_row(rank, candidate))
    if result.breakdowns:
        b = result.breakdowns[0]
        lines.append(f"where the time of #1 goes (ms per step): compute {b.compute_s * 1e3:.1f}, "
                     f"mp comm {b.mp_comm_s * 1e3:.1f}, dp comm {b.dp_comm_s * 1e3:.1f} (exposed), "
                     f"pp p2p {b.pp_comm_s * 1e3:.1f}, pipeline bubble {b.bubble_s * 1e3:.1f}, "
                     f"optimizer {b.optimizer_s * 1e3:.1f}; "
                     f"memory peaks on stage {b.peak_stage}")
    for note in result.notes:
        lines.append(f"note: {note}")
    if result.rejected:
        lines.append("rejected:")
        lines.extend(f"  {describe(r.strategy)}: {r.reason}" for r in result.rejected)
    return "\n".join(lines)


def _row(rank: int, candidate: Candidate) -> str:
    est = candidate.estimate
    mem, comm = est.memory, est.comm_bytes
    memory = (f"{mem.total / 1e9:.1f} = {mem.params / 1e9:.1f}/{mem.grads / 1e9:.1f}/"
              f"{mem.optimizer / 1e9:.1f}/{mem.activations / 1e9:.1f}")
    traffic = "/".join(f"{n / 1e6:,.0f}" for n in (comm.mp, comm.dp, comm.pp, comm.implicit))
    return (f"{rank:>3}  {describe(candidate.strategy):<30} {est.step_time_s * 1e3:>10.1f} "
            f"{est.tokens_per_s:>12,.0f} {est.mfu:>6.1%}  {memory:<34} {traffic}")
