"""Where each rank's piece of a distributed tensor sits in the full tensor (numpy only).

A tensor on a mesh is described here by the mesh's process ids laid out in its shape and, per
mesh axis, the tensor dim that mesh axis splits (``None``: replicated along it). A split is
Paddle's balanced one: chunks of ``ceil(n / k)`` rows, the last one shorter. (Several mesh axes
splitting one tensor dim would split it one after another, outer mesh axis first; the checkpoint
code refuses such tensors, as that order is not verified against Paddle.) The checkpoint code
checks every rank's real local shape against these boxes before it writes, so a layout Paddle
computes differently is refused, never saved wrong.

Example::

    >>> ids = np.array([[0, 1], [2, 3]])                 # dp2 x mp2
    >>> shard_box([8, 6], ids.shape, (1, 0), [None, 1])  # rank 2: replicated on dp, S(1) on mp
    ([0, 0], [8, 3])
    >>> [(r, off) for r, off, _ in distinct_shards([8, 6], ids, [None, 1])]
    [(0, [0, 0]), (1, [0, 3])]
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

Box = tuple[list[int], list[int]]  # (offset, shape) in the full tensor


def shard_box(
    shape: Sequence[int], mesh_shape: Sequence[int], coords: Sequence[int], split: Sequence[int | None]
) -> Box:
    """The ``(offset, shape)`` of the piece held at mesh coordinates ``coords``."""
    offset, size = [0] * len(shape), [int(n) for n in shape]
    for mesh_axis, dim in enumerate(split):
        if dim is None:
            continue
        parts = mesh_shape[mesh_axis]
        chunk = -(-size[dim] // parts)  # ceil
        start = min(coords[mesh_axis] * chunk, size[dim])
        offset[dim] += start
        size[dim] = min(chunk, size[dim] - start)
    return offset, size


def distinct_shards(
    shape: Sequence[int], ids: np.ndarray, split: Sequence[int | None]
) -> list[tuple[int, list[int], list[int]]]:
    """One ``(writer rank, offset, shape)`` per distinct piece, in rank order. Replicated copies
    are written once, by the rank at coordinate 0 of every mesh axis that does not split."""
    shards = []
    for coords in np.ndindex(*ids.shape):
        if all(c == 0 for c, dim in zip(coords, split) if dim is None):
            offset, size = shard_box(shape, ids.shape, coords, split)
            shards.append((int(ids[coords]), offset, size))
    return sorted(shards, key=lambda s: s[0])


def rank_coords(ids: np.ndarray, rank: int) -> tuple[int, ...] | None:
    """``rank``'s coordinates in the mesh, or None when it is not part of it."""
    found = np.argwhere(ids == rank)
    return tuple(int(c) for c in found[0]) if len(found) else None


def assemble(box: Box, shards: Sequence[Box], read: Callable[[int], np.ndarray], dtype) -> np.ndarray:
    """The values of ``box`` from the saved ``shards`` (each an ``(offset, shape)``);
    ``read(i)`` returns shard ``i``'s array (e.g. a memory map, so only the rows used are read).
    The shards must tile the tensor (the format checks it), so every element is filled once.

    Example::

        >>> full = np.arange(12.0).reshape(4, 3)
        >>> pieces = [([0, 0], [2, 3]), ([2, 0], [2, 3])]
        >>> out = assemble(([1, 1], [2, 2]), pieces, lambda i: full[2 * i : 2 * i + 2], "float64")
        >>> out.tolist()
        [[4.0, 5.0], [7.0, 8.0]]
    """
    offset, size = box
    out = np.empty(size, dtype=dtype)
    if out.size == 0:
        return out
    for i, (s_off, s_size) in enumerate(shards):
        lo = [max(a, b) for a, b in zip(offset, s_off)]
        hi = [min(a + n, b + m) for a, n, b, m in zip(offset, size, s_off, s_size)]
        if any(h <= low for low, h in zip(lo, hi)):
            continue
        src = tuple(slice(a - b, c - b) for a, c, b in zip(lo, hi, s_off))
        dst = tuple(slice(a - b, c - b) for a, c, b in zip(lo, hi, offset))
        out[dst] = read(i)[src]
    return out
