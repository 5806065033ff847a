"""Every rank starts from rank 0's model and rank 0's random stream: the model one device builds.

A script that seeds each rank differently before building its model (PaddleFormers' ``set_seed``
after a bare ``fleet.init`` gives each data-parallel rank ``seed + rank``; hand-written scripts
call ``paddle.seed(seed + rank)`` for their dropout) builds a different model on each rank. Rank 0
was seeded as one device is, so its model is the one device's. Before anything is sharded,
``apply_plan`` gives every rank rank 0's random state (:func:`equalise_random`) and then rank 0's
parameters and buffers, whole (:func:`equalise_dense`), as PyTorch's DDP broadcasts rank 0's module
state when it is built. So:

- every piece of every parameter is rank 0's draw: the dp replicas of a parameter start equal,
  and the columns of an mp-split weight that rank 1 alone holds are rank 0's columns, as on one
  device. (Megatron keeps each tensor-parallel rank's own draw there, a model no single device
  builds; a run started under mp2 then trained another model than one device, without a word);
- a lazily built model (lazy.py) has nothing to copy: every rank draws every parameter whole,
  now from rank 0's generator, so it draws rank 0's values;
- from then on a dropout draws alike on every rank (docs/internals.md, "Randomness").

The ranks first compare a digest of what they hold (one sum of a few integers); only where they
differ are the values copied, by sums over the world to which all but rank 0 give zeros
(:func:`~autodist.applier.placement.clip.sum_over`, through ``dist.reshard``: ``dist.new_group``
is unreliable on gloo), one per dtype and :data:`PACK_BYTES` of values. The digest saves the copy
when every rank seeded alike (docs/benchmarks.md, "Copying rank 0's model").

Example (one rank: nothing to copy)::

    >>> import paddle
    >>> layer = paddle.nn.Linear(2, 3)
    >>> before = layer.weight.numpy().copy()
    >>> equalise_dense(layer, rank=0, world=1)
    >>> bool((layer.weight.numpy() == before).all())
    True
"""

from __future__ import annotations

import hashlib
import itertools
from typing import Any

import numpy as np
import paddle
import paddle.distributed as dist

from autodist.applier.placement.clip import sum_over


def equalise_dense(model: paddle.nn.Layer, rank: int, world: int) -> None:
    """Give every parameter and buffer of ``model``, not yet distributed, rank 0's value, before
    ``apply_plan`` shards it or a framework that shards later itself does (PaddleFormers'
    Trainer, whose ``train()`` slices each rank's own dense tensors). A lazily built parameter
    holds no value yet and is skipped (its draw is equalised by :func:`equalise_random`). Call on
    every rank of the ``world`` (it communicates when ``world`` > 1)."""
    if world <= 1:
        return
    tensors = [p for _, p in model.named_parameters() if p._is_initialized()]
    tensors += [b for _, b in model.named_buffers()]
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
    ranks' digests, then, where they differ, one sum per pack of values (:func:`_packs`)."""
    mesh = dist.ProcessMesh(group, dim_names=["replicas"])
    kept = [t for t in tensors if t.size > 0]
    if _same_everywhere(kept, mesh, group.index(rank)):
        return
    for batch in _packs(kept):
        dtype = _summed_dtype(batch[0])
        packed = paddle.concat([t.astype(dtype).flatten() for t in batch])
        first = sum_over(packed if rank == group[0] else paddle.zeros_like(packed), mesh)
        offset = 0
        for tensor in batch:
            piece = first[offset : offset + tensor.size].reshape(tensor.shape).astype(tensor.dtype)
            tensor.copy_(piece, False)
            offset += tensor.size


#: The most bytes of values packed into one sum: the copy's temporary memory (the pack and the
#: sum's result) stays small beside the model it copies.
PACK_BYTES = 1 << 28


def _packs(tensors: list[paddle.Tensor]) -> list[list[paddle.Tensor]]:
    """``tensors`` in batches of one summed dtype and at most :data:`PACK_BYTES` (a larger tensor
    alone), in one order on every rank."""
    packs: list[list[paddle.Tensor]] = []
    for _, same in itertools.groupby(sorted(tensors, key=_summed_dtype), key=_summed_dtype):
        packs.append([])
        room = 0
        for tensor in same:
            size = tensor.size * tensor.element_size()
            if packs[-1] and room + size > PACK_BYTES:
                packs.append([])
                room = 0
            packs[-1].append(tensor)
            room += size
    return packs


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
