"""Collective times by the alpha-beta ring model, and which link a process group uses.

For p ranks on a ring, message size n bytes, latency alpha (s) per step and per-byte time beta = 1/bandwidth
(Thakur, Rabenseifner and Gropp, "Optimization of Collective Communication Operations in
MPICH", 2005; the ring forms NCCL uses):

- all-reduce      2(p-1) alpha + 2(p-1)/p n beta
- all-gather      (p-1) alpha + (p-1)/p n beta     (n: the gathered, full size)
- reduce-scatter  (p-1) alpha + (p-1)/p n beta     (n: the full size before scattering)
- point-to-point  alpha + n beta

alpha is the latency of one step for two ranks, plus ``latency_per_rank_s`` for each rank beyond
two (:meth:`Link.step_latency`): 0 on the named GPUs, where a ring step costs the same at any size;
gloo on 4 ranks sharing 2 CPU cores measured 4x the two-rank step (docs/benchmarks.md), which
one alpha for all sizes under-prices.

Ranks are numbered with mp innermost, then dp, then pp (the plan's mesh order ``pp, dp, mp``),
so a group is ``size`` ranks ``stride`` apart; it stays inside a node exactly when its span
``size * stride`` fits in (and divides) a node. A group that spans nodes is limited by the
inter-node links, and it has one of them per member in a node: NCCL runs one ring channel per
NIC, so a collective over g ranks of every node moves its cross-node traffic over g NICs at
once (the NCCL documentation on multi-rail / ``NCCL_MIN_NCHANNELS``; nccl-tests' "bus
bandwidth" across DGX nodes is about the sum of the node's NICs). Its bandwidth is then
min(intra-node, g x inter-node) per rank.

Example::

    >>> link = Link(bandwidth=100e9, latency_s=0.0)
    >>> all_reduce_time(1e9, 4, link)      # 2 * 3/4 * 1 GB at 100 GB/s
    0.015
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from autodist.schemas import DeviceProfile


@dataclass(frozen=True)
class Link:
    """What one rank's transfers see: bandwidth in bytes/s per direction, latency per step of a
    two-rank group and how much it grows per rank beyond two (:meth:`step_latency`)."""

    bandwidth: float
    latency_s: float
    latency_per_rank_s: float = 0.0

    def step_latency(self, p: int) -> float:
        """Seconds of latency one ring step pays in a group of ``p`` ranks: ``latency_s`` for two,
        plus ``latency_per_rank_s`` for each rank beyond (0 on a GPU fabric; on gloo over shared
        CPU cores every step of a larger ring waits longer for its peers, as calibrate measures).

        >>> link = Link(bandwidth=1e9, latency_s=1e-6, latency_per_rank_s=2e-6)
        >>> [round(link.step_latency(p) * 1e6, 9) for p in (2, 4)]   # microseconds
        [1.0, 5.0]
        """
        return self.latency_s + max(p - 2, 0) * self.latency_per_rank_s


def all_reduce_time(nbytes: float, p: int, link: Link, count: int = 1) -> float:
    """``count`` all-reduces of ``nbytes`` in total (each pays the latency, the bytes once)."""
    if p <= 1 or nbytes <= 0:
        return 0.0
    return 2 * (p - 1) * link.step_latency(p) * max(count, 1) + 2 * (p - 1) / p * nbytes / link.bandwidth


def all_gather_time(nbytes: float, p: int, link: Link, count: int = 1) -> float:
    """``count`` all-gathers of ``nbytes`` (gathered size) in total."""
    if p <= 1 or nbytes <= 0:
        return 0.0
    return (p - 1) * link.step_latency(p) * max(count, 1) + (p - 1) / p * nbytes / link.bandwidth


#: Reduce-scatter moves the same data as all-gather, the other way round.
reduce_scatter_time = all_gather_time


def p2p_time(nbytes: float, link: Link) -> float:
    if nbytes <= 0:
        return 0.0
    return link.latency_s + nbytes / link.bandwidth


def all_reduce_bytes(nbytes: float, p: int) -> float:
    """Bytes one rank sends in a ring all-reduce of ``nbytes`` (twice an all-gather's)."""
    return 2 * (p - 1) / p * nbytes if p > 1 else 0.0


def all_gather_bytes(nbytes: float, p: int) -> float:
    """Bytes one rank sends in a ring all-gather or reduce-scatter of ``nbytes`` in full."""
    return (p - 1) / p * nbytes if p > 1 else 0.0


class LookupCollective(NamedTuple):
    """A collective a token lookup runs: its name (as calibrate measures it), its message (bytes),
    how many times each micro-batch runs it, and the bytes the lookup holds for its backward
    beyond its output (a gathered table and its whole gradient)."""

    name: str
    nbytes: float
    per_micro_batch: int
    working: float


def vocab_lookup_collective(table_elements: float, output_elements: float, width: int) -> LookupCollective:
    """What a token lookup in a vocabulary-split table costs: the one owner for the step time and
    calibrate's ``plan_messages``. ``table_elements``: the whole table's; ``output_elements``: the
    lookup's output on one rank for one micro-batch (tokens x hidden) when the plan runs it on
    local tensors (``plan.vocab_lookup``), else 0; ``width``: bytes per element in the training
    dtype.

    Run on local tensors (Megatron's way, applier/modes/vocab_lookup.py), each rank looks up its own
    rows and one all-reduce of the output sums the ranks' answers in the forward; the backward
    needs no collective for the table, and no rank holds it whole. Run in Paddle 3.3.1's global
    view, the ``embedding`` SPMD rule asks for the table replicated, so it is all-gathered whole
    (``SToRReshard`` -> ``AllGather``) before each lookup, whose output is replicated, and again
    in its backward for ``embedding_grad`` (the saved table is the split one); the gathered table
    and its whole gradient are held for the backward (docs/paddle-notes.md, "SPMD rules").

    >>> vocab_lookup_collective(1000 * 64, 0, 2)          # a [1000, 64] table in bf16, global view
    LookupCollective(name='all_gather', nbytes=128000, per_micro_batch=2, working=256000)
    >>> vocab_lookup_collective(1000 * 64, 512 * 64, 2)   # the same looked up locally, 512 tokens
    LookupCollective(name='all_reduce', nbytes=65536, per_micro_batch=1, working=0.0)
    """
    if output_elements:
        return LookupCollective("all_reduce", output_elements * width, 1, 0.0)
    return LookupCollective("all_gather", table_elements * width, 2, 2 * table_elements * width)


def group_within_node(size: int, stride: int, devices_per_node: int) -> bool:
    """Whether a group of ``size`` ranks, ``stride`` apart, sits inside one node.

    >>> group_within_node(8, 1, 8), group_within_node(2, 8, 8), group_within_node(4, 1, 6)
    (True, False, False)
    """
    span = size * stride
    return size <= 1 or (span <= devices_per_node and devices_per_node % span == 0)


def group_link(size: int, stride: int, devices_per_node: int, device: DeviceProfile) -> Link:
    """The link a group's collectives run at: NVLink-class inside a node, else the network,
    over as many NICs as the group has members in one node.

    >>> from autodist.planner.cost.hardware import PROFILES
    >>> h100 = PROFILES["h100-sxm"]
    >>> [group_link(16, s, 8, h100).bandwidth / 1e9 for s in (1, 2, 8)]   # 8, 4 and 1 NICs of 50 GB/s
    [400.0, 200.0, 50.0]
    """
    if group_within_node(size, stride, devices_per_node):
        return Link(device.intra_node_bandwidth, device.intra_node_latency_s, device.intra_node_latency_per_rank_s)
    per_node = min(size, max(1, devices_per_node // stride)) if stride < devices_per_node else 1
    bandwidth = min(device.intra_node_bandwidth, per_node * device.inter_node_bandwidth)
    return Link(bandwidth, device.inter_node_latency_s, device.inter_node_latency_per_rank_s)
