"""Which pipeline schedule the applier can run: the one predicate the planner (its candidates,
``--schedule``) and the applier (validation) both ask.

A pipeline cuts the model between *units*, the layers whose forward it can start and stop at
(the recognised blocks; the children of a ``paddle.nn.Sequential``). ``stages`` lists the stage
of each unit in forward order. ``sequential`` runs any split; ``1F1B`` and ``VPP`` run Paddle's
pipelining schedules over *chunks*, the runs of consecutive units on one stage:

- ``1F1B``: one chunk per rank, in order ``0, 1, ..., pp-1``;
- ``VPP``: ``v >= 2`` chunks per rank, cycling ``0, ..., pp-1`` ``v`` times, and a micro-batch
  count that is a multiple of ``max(1, n // pp)`` (Paddle's ``ScheduleVPP`` rule);
- both: at least ``pp`` micro-batches, so every stage has work in the steady state.

Example::

    >>> schedule_problems("1F1B", pp=2, micro_batches=4, stages=[0, 0, 1, 1])
    []
    >>> schedule_problems("VPP", pp=2, micro_batches=4, stages=[0, 0, 1, 1])
    ["VPP needs the units' stages to cycle 0..1 at least twice, got chunks [0, 1]"]
    >>> block_stages(5, pp=2)
    [0, 0, 0, 1, 1]
    >>> block_stages(4, pp=2, virtual_stages=2)
    [0, 1, 0, 1]
"""

from __future__ import annotations

from typing import Literal

#: Schedules that run as Paddle's pipelining schedules (micro-batches overlap across stages).
PIPELINING_SCHEDULES: tuple[Literal["1F1B"], Literal["VPP"]] = ("1F1B", "VPP")


def block_stages(num_blocks: int, pp: int, virtual_stages: int = 1) -> list[int]:
    """The stage of each block: ``pp * virtual_stages`` chunks as even as possible (the first
    chunks take one more block), chunk ``c`` on stage ``c % pp``."""
    chunks = pp * virtual_stages
    sizes = [num_blocks // chunks + (1 if c < num_blocks % chunks else 0) for c in range(chunks)]
    return [c % pp for c, size in enumerate(sizes) for _ in range(size)]


def chunk_stages(stages: list[int]) -> list[int]:
    """The stage of each chunk: ``stages`` with consecutive repeats merged."""
    return [s for i, s in enumerate(stages) if i == 0 or stages[i - 1] != s]


def schedule_problems(schedule: str, pp: int, micro_batches: int, stages: list[int]) -> list[str]:
    """Why the applier cannot run ``schedule`` over units on ``stages``; empty when it can."""
    if schedule not in PIPELINING_SCHEDULES:
        return []
    if not stages:
        return [f"{schedule} cuts the model between its blocks, and none was recognised (use sequential)"]
    chunks = chunk_stages(stages)
    problems = []
    if schedule == "1F1B" and chunks != list(range(pp)):
        problems.append(f"1F1B needs the units' stages in order 0..{pp - 1}, got chunks {chunks}")
    cycles = chunks == [i % pp for i in range(len(chunks))] and len(chunks) % pp == 0
    if schedule == "VPP" and (not cycles or len(chunks) == pp):
        problems.append(f"VPP needs the units' stages to cycle 0..{pp - 1} at least twice, got chunks {chunks}")
    if micro_batches < pp:
        problems.append(f"{schedule} needs at least pp={pp} micro-batches, got {micro_batches}")
    rounds = max(1, micro_batches // pp)
    if schedule == "VPP" and micro_batches % rounds:
        problems.append(f"VPP needs a multiple of {rounds} micro-batches (max(1, n // pp)), got {micro_batches}")
    return problems
