"""``autodist-plan --explain``: the search's choice, its runners-up and the rejected, as text.

Example output (shortened)::

    device h100-sxm x 8 (1 node x 8), global batch 32 x seq 1024, bf16, adam, recompute none
      #  strategy                  step(ms)   tok/s     MFU   mem(GB) params/grads/opt/act   comm(MB) mp/dp/pp
      1  dp8 m1                       412.3   79,480  45.1%   31.2 = 1.9/1.9/11.2/16.2       0/3,400/0
    where the time of #1 goes: compute 380.1 ms, mp 0.0, dp 32.2, pp 0.0, bubble 0.0
    rejected:
      dp1 mp1 pp8: pp=8 is more than the 4 blocks of the model (each stage needs at least one block)
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
                     f"pp p2p {b.pp_comm_s * 1e3:.1f}, pipeline bubble {b.bubble_s * 1e3:.1f}; "
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
