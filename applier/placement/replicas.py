"""Every value a plan holds on several ranks starts equal on all of them: the first holder's.

A script that seeds each rank differently before building its model (PaddleFormers' ``set_seed``
gives each data-parallel rank ``seed + rank``; hand-written scripts call
``paddle.seed(seed + rank)`` for their dropout) builds a different model on each rank. Under data
parallelism the replicas would start apart and stay apart, while every rank logs the same averaged
loss. So once the ranks have applied the plan, ``apply_plan`` copies every piece of a parameter
that several ranks hold from the first of them (the lowest rank) to the others, as PyTorch's DDP
broadcasts rank 0's module state when it is built:

- the ranks holding the same piece are those of the parameter's stage mesh at the same coordinate
  on every mesh axis that splits it: a ``Replicate`` parameter of a dp2 x mp2 mesh is one group of
  four, an mp-split one two groups along dp, one per mp piece;
- a weight tied across pipeline stages (``tied_stages``) is one value: its copies on the other
  stages join the group of the same piece;
- an expert held by several ranks (ep groups over dp) is copied among those that hold it only;
- every buffer goes from rank 0 to every rank (buffers are not sharded: every rank holds them whole).

A piece only one rank holds (its columns of an mp-split weight, its experts under ep) keeps that
rank's own draw, as Megatron does: it equals one device's only when every rank seeded alike.
A lazily built model is drawn from each rank's generator (lazy.py), so it is copied the same way.

The ranks of a group first compare a digest of what they hold (one sum of a few integers); only
a group whose ranks differ is copied, by a sum over the group's one-axis mesh to which all but
the first rank give zeros (:func:`~autodist.applier.placement.clip.sum_over`, through ``dist.reshard``:
``dist.new_group`` is unreliable on gloo), one per dtype, every tensor of the group packed into
it. The digest saves the copy when every rank seeded alike (docs/benchmarks.md, "Applying a
plan": 1.25 s of copying for a 25 M-parameter model on 4 CPU ranks).

Example::

    >>> groups = replica_groups(plan)     # doctest: +SKIP
    >>> groups["lm_head.weight"]          # doctest: +SKIP
    [[0, 2], [1, 3]]
"""

from __future__ import annotations

import hashlib
import itertools
from typing import Any

import numpy as np
import paddle
import paddle.distributed as dist

from autodist.schemas import Plan
from autodist.schemas.vocabulary import shard_dim

from autodist.applier.placement.clip import sum_over
from autodist.applier.modes.expert_dispatch import expert_holders
from autodist.applier.placement.mesh import mesh_ids


def replica_groups(plan: Plan) -> dict[str, list[list[int]]]:
    """For each planned parameter, the groups of ranks holding the same piece of it (ascending
    ranks, groups in order of their first rank); a piece one rank holds alone makes no group."""
    ids, axes = mesh_ids(plan), list(plan.mesh.axes)
    pp = axes.index("pp") if "pp" in axes else None
    holders = expert_holders(plan)
    out = {}
    for fqn, param in plan.params.items():
        stages = {param.stage, *param.tied_stages.values()}
        split = [a for a, p in enumerate(param.placements) if a != pp and shard_dim(p) is not None]
        pieces: dict[tuple[int, ...], list[int]] = {}
        for coords in np.ndindex(*ids.shape):
            rank = int(ids[coords])
            if (pp is None or coords[pp] in stages) and rank in holders.get(fqn, [rank]):
                pieces.setdefault(tuple(coords[a] for a in split), []).append(rank)
        groups = sorted(sorted(group) for group in pieces.values() if len(group) > 1)
        if groups:
            out[fqn] = groups
    return out


def equalise(plan: Plan, held: dict[str, paddle.Tensor], buffers: list[paddle.Tensor], rank: int) -> None:
    """Give every parameter this rank ``held`` (planned name -> the tensor holding its value here)
    the value of the first rank of its :func:`replica_groups` group, and every buffer rank 0's.
    Call on every rank, after the ranks have applied the plan (it communicates) and before the
    optimizer is sharded (ZeRO 3 splits every parameter over dp then, beyond the plan's placements)."""
    batches: dict[tuple[int, ...], list[paddle.Tensor]] = {}
    for fqn, groups in sorted(replica_groups(plan).items()):
        for ranks in groups:
            if rank in ranks and fqn in held:
                batches.setdefault(tuple(ranks), []).append(held[fqn]._local_value())
    world = tuple(sorted(int(r) for r in mesh_ids(plan).flat))
    if len(world) > 1 and buffers:
        batches.setdefault(world, []).extend(buffers)
    with paddle.no_grad():
        for group in sorted(batches):  # one order on every rank: no two ranks wait on each other
            _copy_from_first(batches[group], list(group), rank)


def equalise_dense(model: paddle.nn.Layer, rank: int, world: int) -> None:
    """Give every parameter and buffer of ``model``, not yet distributed, rank 0's value: for a
    framework that shards the model later itself (PaddleFormers' Trainer, whose ``train()``
    slices each rank's own dense tensors). Call on every rank of a ``world`` > 1 (it communicates)."""
    tensors = [p for _, p in model.named_parameters()] + [b for _, b in model.named_buffers()]
    with paddle.no_grad():
        _copy_from_first(tensors, list(range(world)), rank)


#: Room for one random generator's state (Paddle's ``GeneratorState.__getstate__``: device,
#: seed, offset and the Mersenne Twister's state as text, about 7,000 characters on CPU).
_STATE_ROOM = 1 << 14


def equalise_random(group: list[int], rank: int) -> None:
    """Every rank of ``group`` takes ``group[0]``'s random state (``paddle.get_rng_state``): from
    here on, dropout and every other random op draw the same numbers on every rank, whatever each
    was seeded with (docs/internals.md, "Randomness"). Call on every rank of ``group`` (it
    communicates, unless the ranks' states are equal already: one digest sum then)."""
    states = paddle.get_rng_state()
    packed = np.zeros([len(states), _STATE_ROOM], dtype=np.int64)
    for row, state in zip(packed, states):
        device, seed, offset, text = state.__getstate__()
        if len(text) + 4 > _STATE_ROOM:
            raise RuntimeError(f"a random generator's state of {len(text)} characters: more than {_STATE_ROOM - 4}")
        row[: 4 + len(text)] = [device, seed, offset, len(text), *text]
    shared = paddle.to_tensor(packed)
    with paddle.no_grad():
        _copy_from_first([shared], group, rank)
    restored = []
    for row in shared.numpy():
        device, seed, offset, size = (int(v) for v in row[:4])
        kind: Any = type(states[0])  # Paddle's GeneratorState (pybind11: no stub for its constructor)
        state = kind.__new__(kind)
        state.__setstate__((device, seed, offset, [int(v) for v in row[4 : 4 + size]]))
        restored.append(state)
    paddle.set_rng_state(restored)


def _copy_from_first(tensors: list[paddle.Tensor], group: list[int], rank: int) -> None:
    """Overwrite ``tensors`` with their values on ``group[0]``, unless every rank of ``group``
    holds the same bytes already (the usual case: every rank seeded alike): one small sum of the
    ranks' digests, then, where they differ, one sum per dtype of the packed values."""
    mesh = dist.ProcessMesh(group, dim_names=["replicas"])
    kept = [t for t in tensors if t.size > 0]
    if _same_everywhere(kept, mesh, group.index(rank)):
        return
    for _, same in itertools.groupby(sorted(kept, key=_summed_dtype), key=_summed_dtype):
        batch = list(same)
        dtype = _summed_dtype(batch[0])
        packed = paddle.concat([t.astype(dtype).flatten() for t in batch])
        first = sum_over(packed if rank == group[0] else paddle.zeros_like(packed), mesh)
        offset = 0
        for tensor in batch:
            piece = first[offset : offset + tensor.size].reshape(tensor.shape).astype(tensor.dtype)
            tensor.copy_(piece, False)
            offset += tensor.size


def _same_everywhere(tensors: list[paddle.Tensor], mesh: dist.ProcessMesh, index: int) -> bool:
    """Whether every rank of ``mesh`` holds the same bytes in ``tensors``: each rank's 63-bit
    digest of them at its index of a vector, summed over the ranks."""
    digest = hashlib.sha1(usedforsecurity=False)  # a checksum (the fastest hashlib has here), not a seal
    for tensor in tensors:
        digest.update(np.ascontiguousarray(tensor.numpy()).data)
    digests = np.zeros([len(mesh.process_ids)], dtype=np.int64)
    digests[index] = int.from_bytes(digest.digest()[:8], "little") >> 1  # non-negative: no sum overflows
    held = sum_over(paddle.to_tensor(digests), mesh).numpy()
    return bool((held == held[0]).all())


def _summed_dtype(tensor: paddle.Tensor) -> str:
    """The dtype a tensor is summed in: its own, but bool as int32 (no sum of bools)."""
    return "int32" if tensor.dtype == paddle.bool else str(tensor.dtype).removeprefix("paddle.")
