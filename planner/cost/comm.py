"""Collective times by the alpha-beta ring model, and which link a process group uses.

For p ranks on a ring, message size n bytes, latency alpha (s) and per-byte time beta = 1/bandwidth
(Thakur, Rabenseifner and Gropp, "Optimization of Collective Communication Operations in
MPICH", 2005; the ring forms NCCL uses):

- all-reduce      2(p-1) alpha + 2(p-1)/p n beta
- all-gather      (p-1) alpha + (p-1)/p n beta     (n: the gathered, full size)
- reduce-scatter  (p-1) alpha + (p-1)/p n beta     (n: the full size before scattering)
- point-to-point  alpha + n beta

Ranks are numbered with mp innermost, then dp, then pp (the plan's mesh order ``pp, dp, mp``),
so a group is ``size`` ranks ``stride`` apart; it stays inside a node exactly when its span
``size * stride`` fits in (and divides) a node. A group that spans nodes is limited by the
inter-node link.

Example::

    >>> link = Link(bandwidth=100e9, latency_s=0.0)
    >>> all_reduce_time(1e9, 4, link)      # 2 * 3/4 * 1 GB at 100 GB/s
    0.015
"""

from __future__ import annotations

from dataclasses import dataclass

from autodist.schemas import DeviceProfile


@dataclass(frozen=True)
class Link:
    """What one rank's transfers see: bandwidth in bytes/s per direction, latency per step."""

    bandwidth: float
    latency_s: float


def all_reduce_time(nbytes: float, p: int, link: Link, count: int = 1) -> float:
    """``count`` all-reduces of ``nbytes`` in total (each pays the latency, the bytes once)."""
    if p <= 1 or nbytes <= 0:
        return 0.0
    return 2 * (p - 1) * link.latency_s * max(count, 1) + 2 * (p - 1) / p * nbytes / link.bandwidth


def all_gather_time(nbytes: float, p: int, link: Link, count: int = 1) -> float:
    """``count`` all-gathers of ``nbytes`` (gathered size) in total."""
    if p <= 1 or nbytes <= 0:
        return 0.0
    return (p - 1) * link.latency_s * max(count, 1) + (p - 1) / p * nbytes / link.bandwidth


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


def group_within_node(size: int, stride: int, devices_per_node: int) -> bool:
    """Whether a group of ``size`` ranks, ``stride`` apart, sits inside one node.

    >>> group_within_node(8, 1, 8), group_within_node(2, 8, 8), group_within_node(4, 1, 6)
    (True, False, False)
    """
    span = size * stride
    return size <= 1 or (span <= devices_per_node and devices_per_node % span == 0)


def group_link(size: int, stride: int, devices_per_node: int, device: DeviceProfile) -> Link:
    """The link a group's collectives run at: NVLink-class inside a node, else the network."""
    if group_within_node(size, stride, devices_per_node):
        return Link(device.intra_node_bandwidth, device.intra_node_latency_s)
    return Link(device.inter_node_bandwidth, device.inter_node_latency_s)
