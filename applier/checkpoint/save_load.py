"""Checkpoints that survive re-planning: save under one plan, load under another.

Every rank writes the pieces of parameters and optimizer states it holds into its own file,
with where each piece sits in the full tensor (replicated copies once); loading assembles the
piece each rank needs under *its* plan from those files with numpy. Keys are parameter FQNs,
so the checkpoint does not depend on the plan: a dp2 checkpoint loads under mp2, a
single-device one into a distributed run, a distributed one into one process, and
:func:`export_checkpoint` writes one full ``paddle.save`` state dict. Paddle's own
``dist.load_state_dict`` cannot do this on CPU: its resharding calls ``.cuda()``
(docs/paddle-notes.md, "Checkpoints"). Loading moves no tensor data between ranks (one
all-gather of the problems the ranks found, so that a problem on one stops all); the folder
must be on a file system every rank sees. Under expert parallelism, where a rank holds only its experts,
each expert is written whole by the lowest rank holding it and loaded only where it is held
(docs/checkpoints.md, "Expert parallelism"); under a pipeline schedule each rank saves and
loads its stage's parameters by their names in the whole model (docs/checkpoints.md, "Pipelines").

A save is atomic: shards go into a new ``data-<step>-<token>`` folder, every file is fsynced,
and only then rank 0 replaces ``checkpoint.json`` (a temp file, fsync, rename), which is the
commit. A run killed before that leaves the previous checkpoint as it was; the orphaned
folder is removed by the next save. Ranks exchange their problems before writing and their
results after, so a problem on one rank is raised on every rank, never left hanging.

When the job has a secret (``AUTODIST_AGREE_SECRET_FILE``, applier/ranks/jobkey.py) the metadata
is signed with a key derived from it for checkpoints alone, inside ``checkpoint.json``, so the
one rename commits data and signature together; a load under a secret checks the signature
before anything else, and refuses an unsigned checkpoint unless ``AUTODIST_CHECKPOINT_UNSIGNED=accept``
(docs/checkpoints.md, "Integrity").

The user's loop (every rank; see README "Checkpoints")::

    model, opt, loader = apply_plan(model, opt, loader, "plan.json")
    start = load_checkpoint(model, opt, "ckpt", loader=loader).step if resuming else 0
    for step, (x, y) in enumerate(loader, start=start):   # resumed: from the first untrained batch
        ...
        save_checkpoint(model, opt, "ckpt", step=step + 1, loader=loader)
"""

from __future__ import annotations

import hashlib
import math
import mmap
import os
import secrets
import shutil
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import paddle
import paddle.distributed as dist

from autodist.schemas import PlanError, dump_plan, dtype_name, parameter_fingerprint, parameter_table
from autodist.schemas.checkpoint import (
    METADATA_FILE,
    SIGNING_PURPOSE,
    Checkpoint,
    CheckpointError,
    SavedModel,
    SavedOptimizer,
    SavedPlan,
    SavedScheduler,
    SavedTensor,
    Shard,
    decode_checkpoint,
    encode_checkpoint,
    open_folder,
    open_inside,
    read_checkpoint,
    saved_tensors,
    shard_digest,
    signature_of,
    signature_problem,
)
from autodist.schemas.vocabulary import DTYPE_BYTES, as_dtype

from autodist.applier.checkpoint import scheduler_state
from autodist.applier.modes.accumulate import AccumulatingOptimizer
from autodist.applier.apply import applied_plan
from autodist.applier.modes.local_calls import LocalViews
from autodist.applier.placement.clip import GlobalNormClip
from autodist.applier.placement.data import resumable
from autodist.applier.modes.expert_dispatch import ExpertGradSync, dropped_parameters, expert_holders
from autodist.applier.placement.layout import assemble, distinct_shards, rank_coords, shard_box
from autodist.applier.placement.optimizer import optimizer_parameters, state_elsewhere
from autodist.applier.modes.pipeline import PipelineModel
from autodist.applier.ranks.jobkey import SECRET_ENV, SECRET_FILE_ENV, derived_key

#: The state kind of an optimizer's fp32 master copy of a low-precision parameter.
MASTER_WEIGHT = "master_weight"
_DATA_PREFIX = "data-"
_TMP_SUFFIX = ".tmp"
#: A shard's checksum until its writer has hashed the bytes it wrote (like ``data-pending``).
_PENDING_DIGEST = "0" * 64
#: ``accept``: a job with a secret loads a checkpoint that is not signed (saved before
#: checkpoints were signed, or by a job without a secret), with a warning.
UNSIGNED_ENV = "AUTODIST_CHECKPOINT_UNSIGNED"
#: What an optimizer state of each kind holds, checked at load: Adam's and AdamW's powers of
#: their betas lie in (0, 1], and their second moments are not negative. A learning rate is
#: checked by applier/checkpoint/scheduler_state.py.
_STATE_RANGES: dict[str, tuple[float, float]] = {
    "beta1_pow_acc": (0.0, 1.0),
    "beta2_pow_acc": (0.0, 1.0),
    "moment2": (0.0, math.inf),
}


def save_checkpoint(
    model: paddle.nn.Layer,
    optimizer: Any,
    path: str | os.PathLike,
    *,
    step: int,
    scheduler: paddle.optimizer.lr.LRScheduler | None = None,
    loader: Any = None,
) -> Checkpoint:
    """Save ``model``'s parameters, ``optimizer``'s states (may be None), the LR scheduler
    (by default the optimizer's own) and where ``loader`` (the one ``apply_plan`` returned;
    optional) stands to the folder ``path``, on every rank. Returns the metadata written. Raises
    :class:`CheckpointError` on every rank, with nothing committed, when anything cannot be saved.

    Example::

        >>> save_checkpoint(model, opt, "ckpt", step=100, loader=loader)        # doctest: +SKIP
    """
    path = Path(path)
    rank, world = dist.get_rank(), dist.get_world_size()
    scheduler = scheduler if scheduler is not None else _scheduler_of(optimizer)
    # 1. Every rank lays out the pieces of the tensors it holds; the ranks exchange their
    #    problems, rank 0's name for the new data folder and the layouts each rank is the first
    #    holder of (an expert under expert parallelism, a pipeline stage's tensors: other ranks
    #    do not hold them).
    problems: list[str] = []
    layouts: dict[str, _Layout] = {}
    mine: dict[tuple[str, tuple[int, ...]], paddle.Tensor] = {}
    saved_scheduler = saved_loader = key = None
    try:
        _check_target_folder(path)
        _check_step(step)
        _check_between_updates(optimizer)
        key = _signing_key(path)
        layouts, mine = _layouts(model, optimizer, rank)
        if scheduler is not None:
            saved_scheduler = scheduler_state.saved_scheduler(scheduler)
        if loader is not None:
            kept = resumable(loader)
            kept.report_finished()
            saved_loader = kept.position()
    except CheckpointError as exc:
        problems.append(exc.problem)
    except ValueError as exc:  # the loader's
        problems.append(str(exc))
    first_held = {name: layout for name, layout in layouts.items() if layout.first_holder == rank}
    proposals = _agree(world, (problems, f"{step}-{secrets.token_hex(4)}", first_held))
    _raise_first([p for peer_problems, _, _ in proposals for p in peer_problems], path)
    # Every rank now describes the same save (so a problem found below is found on every
    # rank), each tensor as its first holder laid it out; for a weight tied across pipeline
    # stages, as the lowest rank's copy (the copies hold the same values).
    everyone: dict[str, _Layout] = {}
    for _, _, proposed in proposals:
        for name, layout in proposed.items():
            everyone.setdefault(name, layout)
    meta, pieces = _describe(model, optimizer, saved_scheduler, step, world, rank, everyone, mine)
    meta.data = _DATA_PREFIX + proposals[0][1]
    meta.loader = saved_loader
    decode_checkpoint(encode_checkpoint(meta), path)  # never commit what could not be read back

    # 2. Every rank writes and fsyncs its own file and hashes what it wrote; a failure anywhere
    #    is raised everywhere. Every rank then holds every shard's checksum.
    digests: dict[tuple[str, int], str] = {}
    try:
        digests = _write_pieces(path / meta.data, pieces)
        status = None
    except Exception as exc:  # any failure must reach the other ranks, not leave them waiting
        status = f"rank {rank} could not write its shards: {getattr(exc, 'strerror', None) or exc}"
    written = _agree(world, (status, digests))
    _raise_first([s for s, _ in written if s], path)
    everyones = {where: digest for _, theirs in written for where, digest in theirs.items()}
    for tensor in saved_tensors(meta).values():
        for shard in tensor.shards:
            shard.sha256 = everyones[(shard.file, shard.byte_offset)]
    if key is not None:  # the metadata holds every shard's checksum: signing it covers the data
        meta.signature = signature_of(meta, key)

    # 3. Rank 0 commits (replaces checkpoint.json, the signature inside it: one rename commits both);
    #    every rank returns once it has.
    status = None
    if rank == 0:
        try:
            _commit(path, meta)
        except Exception as exc:
            status = f"commit failed: {exc}"
    _raise_first([s for s in _agree(world, status) if s], path)
    return meta


def load_checkpoint(
    model: paddle.nn.Layer,
    optimizer: Any,
    path: str | os.PathLike,
    *,
    scheduler: paddle.optimizer.lr.LRScheduler | None = None,
    loader: Any = None,
) -> Checkpoint:
    """Load the checkpoint at ``path`` into ``model`` (and ``optimizer`` and the LR
    scheduler, by default the optimizer's own), whatever plan it was saved under: each rank
    reads the piece of every tensor its own layout needs. Call it after ``apply_plan``. With
    ``loader`` (the one ``apply_plan`` returned), the loader's next pass starts where the
    saved one stood (``save_checkpoint(..., loader=...)``): the batches an uninterrupted run
    reads next, none skipped, none repeated. Returns the metadata (``.step``, ``.plan``,
    ``.loader``). Everything is checked first: a checkpoint of another model, optimizer,
    scheduler or loader raises one-line :class:`CheckpointError` and nothing is changed.

    Example::

        >>> model, opt, loader = apply_plan(model, opt, loader, "plan_b.json")   # doctest: +SKIP
        >>> start = load_checkpoint(model, opt, "ckpt", loader=loader).step      # doctest: +SKIP
    """
    path = Path(path)
    meta = _read_signed(path)
    scheduler = scheduler if scheduler is not None else _scheduler_of(optimizer)
    problems = _model_problems(model, meta)
    if optimizer is not None:
        problems += _optimizer_problems(model, optimizer, meta)
    if optimizer is not None or scheduler is not None:  # not when loading only the model (evaluation)
        problems += _scheduler_problems(scheduler, meta)
    if loader is not None:
        problems += _loader_problems(loader, meta)
    with _ShardFiles(path, meta) as files:
        problems += files.problems
        targets = {f"param/{fqn}": p for fqn, p in _held_parameters(model).items()}
        undo = _nothing
        if not problems:
            try:
                if optimizer is not None and meta.optimizer is not None:
                    states, undo = _prepared_states(model, optimizer, meta, path)
                    targets.update(states)
                problems += files.content_problems(meta, sorted(targets))
            except CheckpointError as exc:
                problems.append(exc.problem)
        if applied_plan(model) is not None:  # applied on every rank: a problem any rank finds stops them all
            problems = list(dict.fromkeys(p for found in _agree(dist.get_world_size(), problems) for p in found))
        if problems:
            undo()
            _raise_first(problems, path)
        saved = saved_tensors(meta)
        for name in sorted(targets):
            _fill(targets[name], saved[name], files, name.split("/")[1], LocalViews(applied_plan(model)))
    if scheduler is not None and meta.scheduler is not None:
        scheduler_state.restore(scheduler, meta.scheduler)
    if loader is not None and meta.loader is not None:
        resumable(loader).resume(meta.loader)
    return meta


def export_checkpoint(path: str | os.PathLike, out: str | os.PathLike) -> dict[str, Any]:
    """Write the checkpoint's parameters as one full state dict with ``paddle.save`` (for
    evaluation or inference on one device: ``model.set_state_dict(paddle.load(out))``).
    Needs no distributed run. Returns the state dict.

    Example::

        >>> sd = export_checkpoint("ckpt", "model.pdparams")          # doctest: +SKIP
    """
    path = Path(path)
    meta = _read_signed(path)
    state = {}
    with _ShardFiles(path, meta) as files:
        _raise_first(files.problems or files.content_problems(meta, [f"param/{fqn}" for fqn in meta.params]), path)
        for fqn, saved in sorted(meta.params.items()):
            tensor = paddle.zeros(saved.shape, dtype=saved.dtype)
            tensor.set_value(_read_box(saved, ([0] * len(saved.shape), list(saved.shape)), files))
            state[fqn] = tensor
    paddle.save(state, str(out))
    return state


# -- what is saved -----------------------------------------------------------------------------------


@dataclass
class _Layout:
    """A tensor's global shape and dtype and its distinct pieces ``(writer rank, offset, shape)``;
    ``first_holder``: the lowest rank holding it (its mesh's; for an expert, the lowest rank of
    its group holding it), which proposes this layout to the others."""

    shape: list[int]
    dtype: str
    pieces: list[tuple[int, list[int], list[int]]]
    first_holder: int = 0


def _check_step(step) -> None:
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise CheckpointError(f"step must be a non-negative int, got {step!r}")


def _check_between_updates(optimizer) -> None:
    """A save between the micro-batches of one update would keep the parameters from before it
    but not the gradients summed since: resumed, the update would miss those micro-batches."""
    if isinstance(optimizer, AccumulatingOptimizer) and optimizer.pending:
        raise CheckpointError(
            f"the optimizer has summed {optimizer.pending} of the {optimizer.micro_batches} micro-batches of an "
            f"update, whose gradients a checkpoint does not keep: save after the update's last micro-batch "
            f"(every {optimizer.micro_batches}th opt.step() of the loader apply_plan returned)"
        )


def _layouts(
    model, optimizer, rank: int
) -> tuple[dict[str, _Layout], dict[tuple[str, tuple[int, ...]], paddle.Tensor]]:
    """The layout of every tensor this rank holds (``param/<fqn>``, ``optimizer/<fqn>/<kind>``)
    and the local values of the pieces it writes, by ``(name, offset)``. An expert's tensors are written whole by the
    lowest rank holding it (:func:`~autodist.applier.modes.expert_dispatch.expert_holders`): its placements
    say Replicate although the ranks of an ep group hold different experts."""
    plan = applied_plan(model)
    # A local-view plan holds fused weights (and their optimizer states) rank by rank: their
    # pieces are saved as the boxes of the model's own layout they hold (local_view.py).
    views = LocalViews(plan)
    holders = expert_holders(plan) if plan is not None else {}
    named = {f"param/{fqn}": (fqn, p) for fqn, p in _held_parameters(model).items()}
    elsewhere = state_elsewhere(_inner(optimizer)) if optimizer is not None else None
    if elsewhere:
        raise CheckpointError(elsewhere)
    states = _optimizer_states(model, optimizer) if optimizer is not None else {}
    named.update({f"optimizer/{fqn}/{kind}": (fqn, t) for fqn, kinds in states.items() for kind, t in kinds.items()})
    layouts, mine = {}, {}
    for name, (fqn, tensor) in named.items():
        shape = [int(d) for d in tensor.shape]
        if fqn in holders:
            layout = _Layout(
                shape, dtype_name(tensor.dtype), [(holders[fqn][0], [0] * len(shape), shape)], holders[fqn][0]
            )
        else:
            first = min(tensor.process_mesh.process_ids) if tensor.is_dist() else 0
            layout = _Layout(shape, dtype_name(tensor.dtype), _pieces(tensor, name), first)
        own_pieces = []
        for writer, offset, piece in layout.pieces:
            boxes = views.own_boxes(fqn, offset, piece, shape)
            own_pieces += [(writer, box_offset, box_shape) for box_offset, box_shape, _ in boxes]
            if writer == rank:
                local = tensor._local_value() if tensor.is_dist() else tensor
                if [int(d) for d in local.shape] != piece:
                    raise CheckpointError(
                        f"{name}: rank {rank} holds a piece of shape {list(local.shape)} but Paddle's balanced "
                        f"split gives {piece}: this layout is not supported"
                    )
                for box_offset, box_shape, start in boxes:
                    mine[(name, tuple(box_offset))] = _cut(local, fqn, views, start, box_shape)
        layout.pieces = own_pieces
        layouts[name] = layout
    return layouts, mine


def _describe(
    model,
    optimizer,
    scheduler: SavedScheduler | None,
    step: int,
    world: int,
    rank: int,
    layouts: dict[str, _Layout],
    mine: dict,
) -> tuple[Checkpoint, list]:
    """The metadata of a save from the ``layouts`` of every tensor (the same on every rank),
    and this rank's pieces ``[(local tensor, tensor name, dtype, Shard)]`` in the order they
    are written. Checksums and the data folder are filled in once known."""
    sizes: dict[str, int] = {}
    saved, pieces = {}, []
    for name in sorted(layouts):
        layout = layouts[name]
        shards = []
        for writer, offset, shape in layout.pieces:
            file = f"rank{writer}.bin"
            shard = Shard(file=file, byte_offset=sizes.get(file, 0), offset=offset, shape=shape, sha256=_PENDING_DIGEST)
            sizes[file] = shard.byte_offset + math.prod(shape) * DTYPE_BYTES[layout.dtype]
            shards.append(shard)
            if writer == rank:
                pieces.append((mine[(name, tuple(offset))], name, layout.dtype, shard))
        saved[name] = SavedTensor(shape=layout.shape, dtype=as_dtype(layout.dtype), shards=shards)
    table = _parameter_table(model)
    states: dict[str, dict[str, SavedTensor]] = {}
    for name, tensor in saved.items():
        if name.startswith("optimizer/"):
            _, fqn, kind = name.split("/")
            states.setdefault(fqn, {})[kind] = tensor
    plan = applied_plan(model)
    meta = Checkpoint(
        step=step,
        world_size=world,
        model=SavedModel(
            class_name=type(_whole_model(model)).__name__,
            num_parameters=sum(math.prod(shape) for shape, _ in table.values()),
            param_fingerprint=parameter_fingerprint(table),
        ),
        plan=None if plan is None else SavedPlan(
            fingerprint=hashlib.sha256(dump_plan(plan)).hexdigest(), mesh=plan.mesh, strategy=plan.strategy
        ),
        params={name.removeprefix("param/"): t for name, t in saved.items() if name.startswith("param/")},
        optimizer=None if optimizer is None else SavedOptimizer(
            class_name=type(_inner(optimizer)).__name__, states=states
        ),
        scheduler=scheduler,
        data=_DATA_PREFIX + "pending",
        files=sizes,
    )  # fmt: skip
    return meta, pieces


def _parameter_table(model) -> dict[str, tuple[list[int], str]]:
    """The model's parameter table as planned: under expert parallelism with the experts this
    rank dropped (shape and dtype from the plan), so that every rank, under any plan, describes
    the same model."""
    copies = _tied_copies(model)
    table = parameter_table((fqn, p) for fqn, p in _whole_model(model).named_parameters() if fqn not in copies)
    plan = applied_plan(model)
    if plan is None:  # only an applied plan drops experts
        return table
    for fqn in _dropped(model):
        table[fqn] = ([int(d) for d in plan.params[fqn].shape], plan.params[fqn].dtype)
    return table


def _held_parameters(model) -> dict[str, paddle.Tensor]:
    """``{FQN: parameter}`` of the parameters this rank holds, by the user's model's names: a
    pipeline's :class:`~autodist.applier.modes.pipeline.PipelineModel` holds its stage's chunks, whose
    own names (``chunks.0.owned.3``) depend on the plan, so its parameters are named as in the
    whole model it was built from."""
    whole = _whole_model(model)
    if whole is model:
        return dict(model.named_parameters())
    mine = {id(p) for p in model.parameters()}
    copies = _tied_copies(model)
    held: dict[str, paddle.Tensor] = {}
    for fqn, param in whole.named_parameters():
        if id(param) in mine:
            held.setdefault(copies.get(fqn, fqn), param)
    return held


def _tied_copies(model) -> dict[str, str]:
    """``{name: tied parameter}`` of the last pipeline stage's copies of a tied weight held under
    another name (``lm_head.weight`` for ``model.embed_tokens.weight``, ``ParamPlan.tied_stages``)
    in a :class:`~autodist.applier.modes.pipeline.PipelineModel`: the copies hold the same values (the
    schedule sums the pair's gradients), so a checkpoint names the tensor once, by the original,
    as the model itself does."""
    plan = applied_plan(model)
    if plan is None or not isinstance(model, PipelineModel):
        return {}
    return {name: fqn for fqn, param in plan.params.items() for name in param.tied_stages if name != fqn}


def _whole_model(model) -> paddle.nn.Layer:
    """The user's model: a pipeline's whole model (every stage's parameters, the other stages'
    on their own meshes), or ``model`` itself."""
    if isinstance(model, PipelineModel) and len(model.chunks):
        return model.chunks[0].whole
    return model


def _elsewhere(model) -> set[str]:
    """The planned parameters this rank does not hold: experts other ranks hold, other
    pipeline stages' parameters."""
    return set(_parameter_table(model)) - set(_held_parameters(model))


def _dropped(model) -> set[str]:
    """The planned parameters this rank dropped (the experts other ranks hold)."""
    plan = applied_plan(model)
    return dropped_parameters(plan, dist.get_rank()) if plan is not None else set()


def _pieces(tensor, name: str) -> list[tuple[int, list[int], list[int]]]:
    """``(writer rank, offset, shape)`` of each distinct piece of ``tensor``."""
    shape = [int(d) for d in tensor.shape]
    if not tensor.is_dist():
        return [(0, [0] * len(shape), shape)]  # one copy, rank 0 writes it
    return distinct_shards(shape, _mesh_ids(tensor), _split_dims(tensor, name))


def _split_dims(tensor, name: str) -> list[int | None]:
    """Per mesh axis, the tensor dim it splits (None: replicated). Refuses Partial values and a
    tensor dim split by several mesh axes (Paddle writes those ``Shard(dim=0, shard_order=k)``,
    without ``get_dim``): no plan and no ZeRO stage makes one, and the order the pieces nest in
    is not verified here, so refusing is safer than misplacing them."""
    dims: list[int | None] = []
    for mesh_axis, placement in enumerate(tensor.placements):
        if placement.is_partial():
            raise CheckpointError(f"{name} is Partial (an unsummed value) on mesh axis {mesh_axis}: it cannot be saved")
        if not placement.is_shard():
            dims.append(None)
            continue
        dim = placement.get_dim() if hasattr(placement, "get_dim") else None
        if dim is None or dim in dims:
            raise CheckpointError(
                f"{name} is split along one tensor dim by several mesh axes ({tensor.placements}): not supported"
            )
        dims.append(dim)
    return dims


def _mesh_ids(tensor) -> np.ndarray:
    mesh = tensor.process_mesh
    return np.array(mesh.process_ids, dtype=np.int64).reshape(mesh.shape)


def _inner(optimizer):
    """The user's optimizer class under apply_plan's wrappers (it holds the states): through
    :class:`AccumulatingOptimizer` (micro-batches), :class:`ExpertGradSync` (expert
    parallelism), :class:`GlobalNormClip` (clipping) and ``dist.shard_optimizer``'s wrapper."""
    while isinstance(optimizer, (AccumulatingOptimizer, ExpertGradSync, GlobalNormClip)):
        optimizer = optimizer._inner
    return optimizer.__dict__.get("_inner_opt", optimizer)


def _optimizer_states(model, optimizer) -> dict[str, dict[str, paddle.Tensor]]:
    """``{parameter FQN: {state kind: tensor}}`` of the states the optimizer holds now.
    Paddle keys them by the parameter's *name* (``linear_0.w_0.dist``), which depends on the
    plan and on construction order; the FQN does not."""
    inner = _inner(optimizer)
    fqn_of = {p.name: fqn for fqn, p in _held_parameters(model).items()}
    states: dict[str, dict[str, paddle.Tensor]] = {}
    for param_name, master in getattr(inner, "_master_weights", {}).items():
        if param_name in fqn_of:
            fqn_of[master.name] = fqn_of[param_name]  # a master weight's states are keyed by its name
            states.setdefault(fqn_of[param_name], {})[MASTER_WEIGHT] = master
    for kind, per_param in inner._accumulators.items():
        for param_name, tensor in per_param.items():
            if param_name not in fqn_of:
                raise CheckpointError(
                    f"the optimizer holds {kind} of {param_name!r}, which is no parameter of the model"
                )
            states.setdefault(fqn_of[param_name], {})[kind] = tensor
    return states


def _scheduler_of(optimizer):
    return None if optimizer is None else scheduler_state.scheduler_of(_inner(optimizer))


# -- writing and committing ------------------------------------------------------------------------------


def _check_target_folder(path: Path) -> None:
    """Refuse to write into a file, or into a folder that holds something else than a checkpoint."""
    if path.exists() and not path.is_dir():
        raise CheckpointError("exists and is not a folder")
    if path.is_dir() and not (path / METADATA_FILE).exists():
        foreign = [p.name for p in path.iterdir() if not _is_ours(p.name)]
        if foreign:
            raise CheckpointError(
                f"exists and is not an autodist checkpoint (it holds {foreign[0]!r}); not writing into it"
            )


def _is_ours(name: str) -> bool:
    return name.startswith(_DATA_PREFIX) or (name.startswith(f".{METADATA_FILE}.") and name.endswith(_TMP_SUFFIX))


def _write_pieces(folder: Path, mine: list) -> dict[tuple[str, int], str]:
    """Write this rank's pieces, one after another, into ``rank<R>.bin``; fsync it. Returns
    each piece's checksum by ``(file, byte offset)`` (:func:`~autodist.schemas.checkpoint.shard_digest`)."""
    folder.mkdir(parents=True, exist_ok=True)
    digests: dict[tuple[str, int], str] = {}
    if not mine:
        return digests
    with open(folder / mine[0][3].file, "wb") as f:
        for local, name, dtype, shard in mine:
            data = np.ascontiguousarray(local.numpy()).reshape(-1).view(np.uint8).data
            digests[(shard.file, shard.byte_offset)] = shard_digest(name, dtype, shard, data)
            f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return digests


def _commit(path: Path, meta: Checkpoint) -> None:
    """Rank 0, after every rank wrote: check the files, replace ``checkpoint.json``
    atomically, then remove the folders of earlier or abandoned saves."""
    folder = path / meta.data
    for file, size in sorted(meta.files.items()):
        found = (folder / file).stat().st_size if (folder / file).exists() else None
        if found != size:
            raise CheckpointError(
                f"{meta.data}/{file} has {found} bytes, expected {size}: a rank's write was lost", path
            )
    _fsync_dir(folder)
    tmp = path / f".{METADATA_FILE}.{meta.data}{_TMP_SUFFIX}"
    with open(tmp, "wb") as f:
        f.write(encode_checkpoint(meta))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path / METADATA_FILE)
    _fsync_dir(path)
    for entry in path.iterdir():
        if _is_ours(entry.name) and entry.name != meta.data:
            shutil.rmtree(entry) if entry.is_dir() and not entry.is_symlink() else entry.unlink()


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _agree(world: int, mine: Any) -> list[Any]:
    """Every rank's ``mine``, in rank order (one all-gather; just ``[mine]`` in one process)."""
    if world == 1:
        return [mine]
    if not dist.is_initialized():  # dygraph auto-parallel makes no default group (docs/paddle-notes.md, Checkpoints)
        dist.init_parallel_env()
    gathered: list[Any] = []
    dist.all_gather_object(gathered, mine)
    return gathered


def _raise_first(problems: list[str], path: Path) -> None:
    """One line: the first three problems, and how many more there are."""
    if problems:
        more = [f"and {len(problems) - 3} more"] if len(problems) > 3 else []
        raise CheckpointError("; ".join(problems[:3] + more), path)


# -- checking before loading -----------------------------------------------------------------------------


def _signing_key(path: Path) -> bytes | None:
    """The key this job signs and checks the checkpoint at ``path`` with (derived from its
    secret for checkpoints alone); None without a secret. A secret that cannot be used (a weak
    one, a file others can read) is one :class:`CheckpointError`."""
    try:
        return derived_key(SIGNING_PURPOSE)
    except PlanError as err:
        raise CheckpointError("; ".join(err.problems), path) from None


def _read_signed(path: Path) -> Checkpoint:
    """The metadata (:func:`~autodist.schemas.checkpoint.read_checkpoint`), its signature
    checked when this job has a secret: one that does not hold is refused, and so is no
    signature at all unless ``AUTODIST_CHECKPOINT_UNSIGNED=accept``. Every rank reads the same
    file under the same secret, so every rank decides alike."""
    meta = read_checkpoint(path)
    key = _signing_key(path)
    problem = None if key is None else signature_problem(meta, key)
    if problem is None:
        return meta
    if meta.signature is None:
        choice = os.environ.get(UNSIGNED_ENV)
        if choice == "accept":
            warnings.warn(f"autodist: {path}: loading a checkpoint that is not signed ({UNSIGNED_ENV}=accept)")
            return meta
        if choice:
            raise CheckpointError(f"{UNSIGNED_ENV}={choice!r}: the only value is 'accept'", path)
        problem += (
            f", and this job has a secret ({SECRET_FILE_ENV} or {SECRET_ENV}) to check one with: to load a "
            f"checkpoint saved before autodist signed them or by a job without a secret, set {UNSIGNED_ENV}=accept "
            f"once (the next save signs it)"
        )
    raise CheckpointError(f"{problem}; nothing was loaded", path)


def _model_problems(model, meta: Checkpoint) -> list[str]:
    """Every saved parameter against the model's, whatever the fingerprint says (the metadata
    is untrusted): the same FQNs, shapes and dtypes. Optimizer states are held against the
    states the optimizer creates (:func:`_prepared_states`)."""
    table = _parameter_table(model)
    saved = {fqn: (t.shape, t.dtype) for fqn, t in meta.params.items()}
    missing = sorted(set(table) - set(saved))
    extra = sorted(set(saved) - set(table))
    changed = sorted(
        f for f in set(saved) & set(table) if list(saved[f][0]) != table[f][0] or saved[f][1] != table[f][1]
    )
    if not (missing or extra or changed) and parameter_fingerprint(table) == meta.model.param_fingerprint:
        return []
    details = [f"{len(names)} {what}, e.g. {names[0]!r}" for what, names in (
        ("not in the checkpoint", missing), ("only in the checkpoint", extra)
    ) if names]  # fmt: skip
    if changed:
        (shape, dtype), (here_shape, here_dtype) = saved[changed[0]], table[changed[0]]
        details.append(
            f"{len(changed)} of another shape or dtype, e.g. {changed[0]!r} (saved {list(shape)} {dtype}, "
            f"here {here_shape} {here_dtype})"
        )
    return [
        f"saved from a different model ({meta.model.class_name}, {len(saved)} parameters); this "
        f"{type(_whole_model(model)).__name__} has {len(table)}: "
        + "; ".join(details or ["the parameter fingerprint differs"])
    ]


def _optimizer_problems(model, optimizer, meta: Checkpoint) -> list[str]:
    if meta.optimizer is None:
        return ["holds no optimizer state (saved with optimizer=None); load with optimizer=None"]
    inner = _inner(optimizer)
    elsewhere = state_elsewhere(inner)
    if elsewhere:
        return [elsewhere]
    if type(inner).__name__ != meta.optimizer.class_name:
        return [f"optimizer states of {meta.optimizer.class_name}, but the optimizer is {type(inner).__name__}"]
    held = {id(p) for p in optimizer_parameters(inner)}
    fqns = {fqn for fqn, p in _held_parameters(model).items() if id(p) in held}
    not_held = sorted(set(meta.optimizer.states) - fqns - _elsewhere(model))
    if not_held:
        return [
            f"has optimizer states of {len(not_held)} parameters the optimizer does not update, e.g. {not_held[0]!r}"
        ]
    # States the checkpoint does not replace would stay as they are: a mix of two runs.
    try:
        unreplaced = sorted(set(_optimizer_states(model, optimizer)) - set(meta.optimizer.states))
    except CheckpointError as exc:
        return [exc.problem]
    if unreplaced:
        return [
            f"has no optimizer states of {len(unreplaced)} parameters the optimizer holds states of, e.g. "
            f"{unreplaced[0]!r}: they would be left as they are; load into an optimizer that has not stepped"
        ]
    return []


def _loader_problems(loader, meta: Checkpoint) -> list[str]:
    """Why ``loader`` cannot resume where the checkpoint's stood."""
    if meta.loader is None:
        return [
            "it does not say where the loader stood (saved without loader=): pass loader= to save_checkpoint, "
            "or load without loader= and skip the trained batches yourself"
        ]
    try:
        problem = resumable(loader).resume_problem(meta.loader)
    except ValueError as exc:
        problem = str(exc)
    return [problem] if problem else []


def _scheduler_problems(scheduler, meta: Checkpoint) -> list[str]:
    saved = meta.scheduler
    if (scheduler is None) != (saved is None):
        return [f"the checkpoint has {'an LR scheduler ' + saved.class_name if saved else 'no LR scheduler'}, "
                f"the optimizer has {'an LR scheduler ' + type(scheduler).__name__ if scheduler else 'none'}"]  # fmt: skip
    return [] if saved is None else scheduler_state.problems(scheduler, saved)


def _prepared_states(
    model, optimizer, meta: Checkpoint, path: Path
) -> tuple[dict[str, paddle.Tensor], Callable[[], None]]:
    """Create (and, under ZeRO, shard) the optimizer's states for every parameter the
    checkpoint has states for, so they can be filled; check they are the saved kinds, shapes
    and dtypes. Returns them, and a function that puts the optimizer's states back as they were
    (called here on a mismatch, by the caller on a later problem)."""
    saved_optimizer = meta.optimizer
    assert saved_optimizer is not None  # (called for a checkpoint with optimizer states only)
    inner = _inner(optimizer)
    before = ({k: dict(v) for k, v in inner._accumulators.items()}, set(inner._already_create_accumulator),
              dict(getattr(inner, "_master_weights", {})))  # fmt: skip
    params = _held_parameters(model)
    # Under expert parallelism, the states of the experts this rank dropped are not loaded here.
    wanted = sorted(set(saved_optimizer.states) - _elsewhere(model))
    block = paddle.static.default_main_program().global_block()
    for fqn in wanted:
        # Idempotent; on dist.shard_optimizer's wrapper it also shards them (docs/paddle-notes.md, Checkpoints).
        optimizer._create_accumulators(block, [params[fqn]])
    states = _optimizer_states(model, optimizer)
    problems = []
    for fqn in wanted:
        kinds, have = saved_optimizer.states[fqn], states.get(fqn, {})
        if set(have) != set(kinds):
            problems.append(f"{fqn}: optimizer states {sorted(kinds)} saved, the optimizer has {sorted(have)}")
            continue
        for kind, saved in kinds.items():
            got = ([int(d) for d in have[kind].shape], dtype_name(have[kind].dtype))
            if got != (saved.shape, saved.dtype):
                problems.append(f"{fqn}: {kind} saved as {saved.shape} {saved.dtype}, here {got[0]} {got[1]}")

    def undo() -> None:
        inner._accumulators.clear()
        inner._accumulators.update(before[0])
        inner._already_create_accumulator = before[1]
        if hasattr(inner, "_master_weights"):
            inner._master_weights = before[2]

    if problems:
        undo()
        _raise_first(problems, path)
    return {f"optimizer/{fqn}/{kind}": t for fqn, kinds in states.items() for kind, t in kinds.items()
            if fqn in wanted}, undo  # fmt: skip


def _nothing() -> None:
    """Nothing to undo."""


# -- reading --------------------------------------------------------------------------------------------


class _ShardFiles:
    """The checkpoint's shard files, opened before anything is loaded and memory-mapped: each
    directly inside the data folder, itself directly inside the checkpoint (never through a
    symlink, so nothing outside the checkpoint folder is read), a regular file at least as long
    as the metadata says (``problems``, one per file that is not). Reading a piece touches only
    its bytes.

    Example::

        >>> with _ShardFiles(Path("ckpt"), read_checkpoint("ckpt")) as files:   # doctest: +SKIP
        ...     _raise_first(files.problems, Path("ckpt"))
    """

    def __init__(self, path: Path, meta: Checkpoint):
        self.problems: list[str] = []
        self.maps: dict[str, np.ndarray] = {}
        try:
            with open_folder(path) as top, open_folder(meta.data, inside=top) as folder:
                for file, size in sorted(meta.files.items()):
                    self._open(folder, path, meta.data, file, size)
        except FileNotFoundError:
            self.problems.append(f"{meta.data} is missing")
        except CheckpointError as exc:
            self.problems.append(exc.problem)
        except OSError as exc:
            self.problems.append(f"cannot read {meta.data}: {exc.strerror or exc}")

    def _open(self, folder: int, path: Path, data: str, file: str, size: int) -> None:
        try:
            fd = open_inside(folder, file, path)
        except FileNotFoundError:
            fd = None
        except CheckpointError as exc:
            self.problems.append(f"{data}/{exc.problem}")
            return
        status = None if fd is None else os.fstat(fd)
        found = None if status is None else status.st_size
        try:
            if status is not None and status.st_nlink > 1:
                self.problems.append(
                    f"{data}/{file} has {status.st_nlink} hard links: a checkpoint's shard files must be its own"
                )
            elif found is None or found < size:
                self.problems.append(f"{data}/{file} is missing or shorter than {size} bytes (found {found})")
            elif found and fd is not None:
                self.maps[file] = np.frombuffer(mmap.mmap(fd, 0, access=mmap.ACCESS_READ), dtype=np.uint8)
            else:
                self.maps[file] = np.empty(0, np.uint8)
        finally:
            if fd is not None:
                os.close(fd)  # the map keeps its own reference to the file

    def __enter__(self) -> _ShardFiles:
        return self

    def __exit__(self, *exc: object) -> None:
        self.maps.clear()

    def content_problems(self, meta: Checkpoint, names: list[str]) -> list[str]:
        """The tensors ``names`` (:func:`~autodist.schemas.checkpoint.saved_tensors`' keys)
        against their bytes: each shard's checksum (metadata older than checksums has none to
        check), and optimizer states outside what their kind holds (:data:`_STATE_RANGES`).
        Every byte of those tensors is read once."""
        saved = saved_tensors(meta)
        problems = []
        for name in names:
            tensor = saved[name]
            for shard in tensor.shards:
                data = self.maps[shard.file][shard.byte_offset : shard.byte_offset + _nbytes(shard, tensor.dtype)].data
                if shard.sha256 is not None and shard_digest(name, tensor.dtype, shard, data) != shard.sha256:
                    problems.append(
                        f"{name}: the bytes of its shard at {shard.offset} ({meta.data}/{shard.file}, byte "
                        f"{shard.byte_offset}) do not match its sha256: the checkpoint was changed or corrupted"
                    )
                    break
                low, high = _STATE_RANGES.get(
                    name.rsplit("/", 1)[-1] if name.startswith("optimizer/") else "", (None, None)
                )
                values = self.array(shard, tensor.dtype)
                if (
                    low is not None
                    and tensor.dtype in ("float16", "float32", "float64")
                    and values.size
                    and not (low <= values.min() and values.max() <= high)
                ):
                    problems.append(f"{name}: holds values outside [{low}, {high}], which no optimizer step makes")
                    break
        return problems

    def array(self, shard: Shard, dtype: str) -> np.ndarray:
        raw = self.maps[shard.file][shard.byte_offset : shard.byte_offset + _nbytes(shard, dtype)]
        return raw.view(_numpy_dtype(dtype)).reshape(shard.shape)


def _nbytes(shard: Shard, dtype: str) -> int:
    return math.prod(shard.shape) * DTYPE_BYTES[dtype]


def _numpy_dtype(dtype: str) -> np.dtype:
    """numpy has no bfloat16: Paddle hands its bits over as uint16 and takes them back
    (docs/paddle-notes.md, Checkpoints)."""
    return np.dtype("uint16" if dtype == "bfloat16" else dtype)


def _read_box(saved: SavedTensor, box, files: _ShardFiles) -> np.ndarray:
    boxes = [(s.offset, s.shape) for s in saved.shards]
    return assemble(box, boxes, lambda i: files.array(saved.shards[i], saved.dtype), _numpy_dtype(saved.dtype))


def _fill(tensor, saved: SavedTensor, files: _ShardFiles, fqn: str, views: LocalViews) -> None:
    """Set this rank's piece of ``tensor`` (of parameter ``fqn``, or its optimizer state) from
    the saved shards; a fused weight of a local view is read box by box of the model's own layout."""
    shape = [int(d) for d in tensor.shape]
    if tensor.is_dist():
        ids = _mesh_ids(tensor)
        coords = rank_coords(ids, dist.get_rank())
        if coords is None:  # another pipeline stage's tensor: nothing held here
            return
        box = shard_box(shape, ids.shape, coords, _split_dims(tensor, "tensor"))
        local = tensor._local_value()  # shares storage with the tensor (docs/paddle-notes.md)
    else:
        box, local = ([0] * len(shape), shape), tensor
    boxes = views.own_boxes(fqn, box[0], box[1], shape)
    if len(boxes) == 1:
        local.set_value(_read_box(saved, box, files))
        return
    dim = views.weights[fqn].dim
    parts = [_read_box(saved, (offset, size), files) for offset, size, _ in boxes]
    local.set_value(np.concatenate(parts, axis=dim))


def _cut(local, fqn: str, views: LocalViews, start: int, shape: list[int]):
    """The part of a rank's ``local`` piece that one box of the model's own layout holds
    (all of it but for a fused weight of a local view)."""
    if [int(d) for d in local.shape] == shape:
        return local
    dim = views.weights[fqn].dim
    assert dim is not None  # own_boxes splits only along a weight's split dim
    return paddle.slice(local, axes=[dim], starts=[start], ends=[start + shape[dim]])
