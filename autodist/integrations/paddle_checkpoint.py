"""Paddle's distributed checkpoints (``paddle.distributed.save_state_dict``) read on CPU on any mesh.

A checkpoint folder holds one ``*.metadata`` file (each piece's tensor key, global offset and
local shape, and the ``*.distcp`` file holding it) and each saving rank's ``{rank}_{id}.distcp``.
Paddle 3.3's ``load_state_dict`` moves a piece saved by one rank to another through the GPU only
(``flex_checkpoint/dcp/reshard_comm.py``: ``src_tensor.cuda()``). :func:`load_here` reads instead
every piece overlapping this rank's box of each tensor straight from the files, so every rank's
files must be readable on this machine: on one machine they are; a job on several machines needs
the checkpoint on a shared filesystem. What it cannot read is refused in one line, before any
tensor is changed (:func:`checkpoint_problems`, :class:`~autodist.schemas.PlanError`).

Used by :mod:`autodist.integrations.paddleformers` to resume a Trainer's checkpoint under another
plan's mesh on CPU::

    from autodist.integrations.paddle_checkpoint import load_here
    load_here(model.sharded_state_dict(), "out/checkpoint-1/model_state")   # on every rank
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from autodist.schemas import PlanError

from autodist.applier.placement.layout import assemble

__all__ = ["load_here", "checkpoint_problems", "placed"]


def checkpoint_problems(path: str | Path) -> list[str]:
    """Why ``path`` (a ``save_state_dict`` folder) cannot be read on this machine: no single
    metadata file, a data file it names missing, a flattened (ZeRO) piece; [] when it can."""
    try:
        _read_metadata(Path(path))
    except PlanError as err:
        return [f"{Path(path).name}: {err.problems[0]}"]
    return []


def load_here(state_dict: dict[str, Any], path: str | Path) -> None:
    """Set every tensor of ``state_dict`` (nested dicts of tensors, distributed or not, as
    ``paddle.distributed.load_state_dict`` takes) to its box of the checkpoint at ``path``: this
    rank's local piece assembled from the pieces of every rank's files that overlap it. All is
    read and checked (shapes, dtypes, every element covered) before any tensor is set; a problem
    is a :class:`~autodist.schemas.PlanError` naming it."""
    import paddle
    from paddle.distributed.flex_checkpoint.dcp.utils import flatten_state_dict

    folder = Path(path)
    pieces = _read_metadata(folder)
    files: dict[str, dict[str, Any]] = {}
    loaded = []
    for key, value in flatten_state_dict(state_dict)[0].items():
        held = _held(value)
        if held is not None:
            local, global_shape, offset, shape = held
            loaded.append((local, _assemble(key, global_shape, offset, shape, str(local.dtype), pieces, folder, files)))
    for local, values in loaded:
        paddle.assign(paddle.to_tensor(values, place=local.place), local)


def placed(sharded: dict[str, Any], tensors: dict[str, Any]) -> dict[str, Any]:
    """``sharded`` (a model's ``sharded_state_dict()``) with each piece of a distributed tensor
    where it sits: Paddle 3.3 builds a ``ShardedWeight`` of a DistTensor with its local shape
    but the offset of a whole copy (``make_replicated_sharded_weight``: all zeros), so a
    checkpoint saved from it records both halves of an mp-split weight at offset 0 and keeps only
    one (measured: PaddleFormers' Trainer in auto-parallel mode). ``tensors``: the tensors by
    name (``local_tensor.name``), the DistTensors whose placements say where each piece sits.
    The optimizer's pieces take their offsets from these (``AdamW.sharded_state_dict``)."""
    from paddle.distributed.flex_checkpoint.dcp.utils import compute_local_shape_and_global_offset

    for weight in sharded.values():
        tensor = tensors.get(weight.local_tensor.name)
        if tensor is not None and tensor.is_dist() and not weight.is_flattened:
            shape, offset = compute_local_shape_and_global_offset(
                list(tensor.shape), tensor.process_mesh, tensor.placements
            )
            if shape is not None:
                weight.global_shape, weight.global_offset = tuple(tensor.shape), tuple(offset)
    return sharded


# -- internals ------------------------------------------------------------------------------------

#: One saved piece: its global offset, local shape, dtype and the data file holding it.
Piece = tuple[tuple[int, ...], tuple[int, ...], str, str]


def _read_metadata(folder: Path) -> dict[str, list[Piece]]:
    """The pieces of every tensor in ``folder``'s newest checkpoint (Paddle's ``get_max_id``),
    one per saved piece (replicas other than the first left out, as Paddle's loader does)."""
    import paddle
    from paddle.distributed.flex_checkpoint.dcp.utils import get_max_id

    names = os.listdir(folder) if folder.is_dir() else []
    newest = get_max_id(str(folder)) if names else 0
    metadata_files = [name for name in names if name.endswith(f"{newest}.metadata")]
    if len(metadata_files) != 1:
        raise PlanError(f"{len(metadata_files)} metadata files ending {newest}.metadata, one needed", str(folder))
    metadata = paddle.load(str(folder / metadata_files[0]))
    dtypes = {key: saved[0].dtype for key, saved in metadata.state_dict_metadata.items()}
    pieces: dict[str, list[Piece]] = {}
    for index, file in metadata.storage_metadata.items():
        if index.replica_id not in (None, 0):
            continue
        if index.is_flattened:
            raise PlanError(
                f"{index.tensor_key} is saved flattened (ZeRO), which this reader does not read", str(folder)
            )
        if file not in names:
            raise PlanError(
                f"{file}, which holds {index.tensor_key}, is not on this machine (every rank's files are read "
                "here: on several machines the checkpoint must be on a shared filesystem)",
                str(folder),
            )
        piece = (tuple(index.global_offset), tuple(index.local_shape), dtypes[index.tensor_key], file)
        pieces.setdefault(index.tensor_key, []).append(piece)
    return pieces


def _held(value: Any) -> tuple[Any, list[int], list[int], list[int]] | None:
    """What this rank holds of ``value`` (a tensor, distributed or not, or a ``ShardedWeight``):
    its local tensor, the global shape, and its box's offset and shape; None when it holds
    nothing (a tensor on a mesh without this rank)."""
    from paddle.distributed.flex_checkpoint.dcp.sharded_weight import ShardedWeight
    from paddle.distributed.flex_checkpoint.dcp.utils import compute_local_shape_and_global_offset

    if isinstance(value, ShardedWeight):
        if value.is_flattened:
            raise PlanError(f"{value.key} is held flattened (ZeRO), which this reader does not fill", "checkpoint")
        offset, shape = list(value.global_offset), list(value.local_shape)
        return value.local_tensor, list(value.global_shape), offset, shape
    if not value._is_initialized():
        return None
    if not value.is_dist():
        return value, list(value.shape), [0] * len(value.shape), list(value.shape)
    shape, offset = compute_local_shape_and_global_offset(list(value.shape), value.process_mesh, value.placements)
    return None if shape is None else (value._local_value(), list(value.shape), list(offset), list(shape))


def _assemble(
    key: str,
    global_shape: list[int],
    offset: list[int],
    shape: list[int],
    dtype: str,
    pieces: dict[str, list[Piece]],
    folder: Path,
    files: dict[str, dict[str, Any]],
) -> Any:
    """The values of ``key``'s box (``offset``, ``shape``) from the pieces overlapping it, read
    from their files once (``files``, numpy) and put together by the applier's own
    :func:`~autodist.applier.placement.layout.assemble`. Refused: a tensor the checkpoint lacks,
    or holds with another dtype or global shape, or whose pieces do not tile it (their sizes must add up
    to its size: pieces recorded at one offset, as Paddle 3.3 records a DistTensor's unless
    :func:`placed` corrected it, would fill one rank's box with another's values)."""
    import numpy as np
    import paddle

    if key not in pieces:
        raise PlanError(f"the checkpoint has no {key}", str(folder))
    saved = pieces[key]
    saved_shape = [max(o[d] + s[d] for o, s, _, _ in saved) for d in range(len(global_shape))]
    have, want = saved[0][2], dtype.replace("paddle.", "")
    if saved_shape != global_shape or have != want:
        raise PlanError(
            f"{key} is saved as {have} {saved_shape}, this run holds it as {want} {global_shape}", str(folder)
        )
    size = int(np.prod(global_shape))
    if sum(int(np.prod(s)) for _, s, _, _ in saved) != size:
        raise PlanError(
            f"the checkpoint's {len(saved)} pieces of {key} do not tile its shape {global_shape} (pieces saved at one "
            "offset: a Trainer checkpoint saved without autodist's install)",
            str(folder),
        )

    def read(i: int) -> Any:
        file = saved[i][3]
        if file not in files:
            files[file] = paddle.load(str(folder / file), return_numpy=True)
        return files[file][key]

    boxes = [(list(start), list(extent)) for start, extent, _, _ in saved]
    return assemble((offset, shape), boxes, read, read(0).dtype)
