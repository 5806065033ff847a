"""The checkpoint format: what ``PATH/checkpoint.json`` says, read strictly.

A checkpoint is a folder::

    PATH/checkpoint.json        this metadata; replacing it is the commit of a save
    PATH/data-<token>/rank<R>.bin   the shards rank R wrote, raw C-order bytes, one after another

Tensors are keyed by parameter FQN (optimizer states by FQN and state kind), so a checkpoint
does not depend on the plan it was saved under. Each tensor lists the shards that tile it:
where each sits in the full tensor (``offset``, ``shape``) and where its bytes are (``file``,
``byte_offset``). Replicated copies are written once. The metadata also records the step, the
model's parameter fingerprint, the plan (fingerprint, mesh, strategy) and the LR scheduler.

Like plans, checkpoint metadata is untrusted input: decoded by msgspec with unknown fields
rejected, file names restricted to plain names (no path can leave the folder), and every
tensor's shards checked to tile it exactly, and each file's bytes to be its shards' and no
two shards' at once, before any byte is read. Each shard carries a checksum of its bytes bound
to its tensor's name and place (:func:`shard_digest`), checked before anything is loaded.

What that holds against (docs/checkpoints.md, "Integrity"): corruption and careless or
mistaken edits, such as bytes overwritten, two tensors' entries or offsets swapped, one shard
pointed at another's bytes. Against someone who edits the metadata on purpose and recomputes
the checksums, only a signature holds: a job with a secret signs the metadata (which holds
every shard's checksum) with a key derived from it (:func:`signature_of`), and a job with the
same secret checks it (:func:`signature_problem`).

Example::

    >>> meta = read_checkpoint("ckpt")                        # doctest: +SKIP
    >>> meta.step, meta.plan.strategy.mp, sorted(meta.params)[:1]   # doctest: +SKIP
    (2, 2, ['embed_tokens.weight'])
"""

from __future__ import annotations

import errno
import hashlib
import hmac
import math
import os
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any, Final, Literal

import msgspec

from autodist.schemas.errors import printable
from autodist.schemas.inputs import InputFileError, read_input_file
from autodist.schemas.io import constraint_in_words, duplicate_key, rename_mesh_axes
from autodist.schemas.plan import Base, Fqn, Identifier, Mesh, NonNegativeInt, PositiveInt, Sha256, Strategy
from autodist.schemas.vocabulary import DTYPE_BYTES, DType

CHECKPOINT_FORMAT: Final = "autodist.checkpoint"
#: Version 5: the metadata may be signed (:class:`Signature`). Version 4: the position of the
#: loader saved with it (optional). Version 3: every shard carries
#: :func:`shard_digest` of its bytes. Version 2: the saved plan's
#: mesh names its axes ``axes`` (version 1: ``dim_names``). Metadata of versions 1 and 2 still
#: reads (:func:`upgrade_checkpoint`), without checksums to check.
CHECKPOINT_VERSION: Final = 5
#: The first version whose shards all carry a checksum.
CHECKSUM_VERSION = 3
#: The first version whose metadata may carry a signature.
SIGNATURE_VERSION = 5
#: What the key a checkpoint is signed with is derived for (``derived_key`` in
#: applier/ranks/jobkey.py): that key signs checkpoints and nothing else.
SIGNING_PURPOSE: Final = b"autodist checkpoint v1"
#: The metadata file inside a checkpoint folder.
METADATA_FILE = "checkpoint.json"

#: The largest ``checkpoint.json`` read, in bytes. The metadata grows with tensors x shards
#: (about 150 bytes a shard): a 70B model with AdamW states split over 64 ranks needs ~35 MB.
MAX_METADATA_BYTES = 512 * 2**20
#: How deep LR schedulers may wrap each other (``LinearWarmup(CosineAnnealingDecay(...))`` is 2).
MAX_SCHEDULER_DEPTH = 8
#: Bounds on a scheduler state value: integers exact as floats, short strings and lists.
_MAX_STATE_INT = 2**53
_MAX_STATE_STR = 256
_MAX_STATE_LIST = 256
#: Descriptors this module opens are not inherited by processes the caller starts.
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)

#: A file or folder name inside the checkpoint: no separators, no "..", no hidden names.
FileName = Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$", max_length=128)]


class CheckpointError(ValueError):
    """A checkpoint cannot be saved or loaded; the message is one line naming the problem.

    Example::

        >>> print(CheckpointError("no checkpoint.json here", path="ckpt"))
        ckpt: no checkpoint.json here
    """

    def __init__(self, problem: str, path: str | os.PathLike = "checkpoint"):
        self.problem = problem
        self.path = str(path)
        super().__init__(f"{self.path}: {problem}")


class Signature(Base):
    """HMAC-SHA256 of the metadata without its signature (:func:`signed_bytes`), under the key
    the saving job derived from its secret for checkpoints (:data:`SIGNING_PURPOSE`)."""

    #: Names the key, not secret (:func:`key_id`): a load under another key says so.
    key_id: Annotated[str, msgspec.Meta(pattern=r"^[0-9a-f]{16}$")]
    hmac_sha256: Sha256


class Shard(Base):
    """One piece of a tensor: its place in the full tensor, where its bytes are, and their
    checksum (:func:`shard_digest`; None in metadata older than :data:`CHECKSUM_VERSION`)."""

    file: FileName
    byte_offset: NonNegativeInt
    offset: list[NonNegativeInt]
    shape: list[NonNegativeInt]
    sha256: Sha256 | None = None


class SavedTensor(Base):
    """A full tensor's shape and dtype, and the shards that tile it."""

    shape: list[NonNegativeInt]
    dtype: DType
    shards: list[Shard]


class SavedModel(Base):
    class_name: Identifier
    num_parameters: NonNegativeInt
    #: :func:`autodist.schemas.parameter_fingerprint` of the model's parameter table.
    param_fingerprint: Sha256


class SavedPlan(Base):
    """The plan the run was distributed by when it saved."""

    #: sha256 of the plan's canonical bytes (:func:`autodist.schemas.dump_plan`).
    fingerprint: Sha256
    mesh: Mesh
    strategy: Strategy


class SavedOptimizer(Base):
    class_name: Identifier
    #: ``{parameter FQN: {state kind: tensor}}``; kinds are Paddle's accumulator names
    #: (``moment1``, ``beta1_pow_acc``, ...) and ``master_weight``. Parameters the optimizer has
    #: no state for yet (never updated) are absent.
    states: dict[Fqn, dict[Identifier, SavedTensor]] = {}


class SavedScheduler(Base):
    """An LR scheduler's state: its ``state_dict()`` (and what Paddle leaves out of it, see
    applier/checkpoint/scheduler_state.py), with the state of a scheduler it wraps (``LinearWarmup``'s
    ``LinearWarmup_LR``) in ``nested`` under the same key."""

    class_name: Identifier
    #: Plain values (:func:`state_value_problem`): numbers, strings, null, flat lists of them.
    state: dict[Identifier, Any]
    nested: dict[Identifier, SavedScheduler] = {}


class SavedLoader(Base):
    """Where the loader ``apply_plan`` returned stood at the save: ``step`` global batches of
    pass ``epoch`` (from 0) were trained; its order is Paddle's ``DistributedBatchSampler``'s,
    a function of ``shuffle_seed`` alone (the sampler's epoch; None: not shuffled), so it is the
    same under every plan (applier/placement/data.py)."""

    epoch: NonNegativeInt
    step: NonNegativeInt
    #: Global batches in a pass when it was saved: a loader of another length is refused at load.
    batches: NonNegativeInt
    shuffle_seed: NonNegativeInt | None = None


#: A file where the loader of each machine's first rank (applier/placement/data.py) keeps how many of the batches it handed out in
#: this process were trained (it counts one when the next batch is asked for or a checkpoint
#: saved); autodist-run sets it for each launch, to say how many steps a failure cost.
PROGRESS_ENV: Final = "AUTODIST_RUN_PROGRESS"


# mypy cannot follow autodist.schemas.plan.Base (an Any to it), so it refuses kw_only here.
class Checkpoint(Base, kw_only=True):  # type: ignore[call-arg]
    format: Literal["autodist.checkpoint"] = CHECKPOINT_FORMAT
    version: Literal[1, 2, 3, 4, 5] = CHECKPOINT_VERSION
    step: NonNegativeInt
    #: Ranks of the run that saved it.
    world_size: PositiveInt
    model: SavedModel
    #: None when the model was not distributed by ``apply_plan`` (a single-device run).
    plan: SavedPlan | None = None
    params: dict[Fqn, SavedTensor]
    optimizer: SavedOptimizer | None = None
    scheduler: SavedScheduler | None = None
    #: None when saved without ``loader=`` (and before version 4).
    loader: SavedLoader | None = None
    #: The folder holding the shard files, and each file's size in bytes.
    data: FileName
    files: dict[FileName, NonNegativeInt] = {}
    #: None when the saving job had no secret (and before version 5).
    signature: Signature | None = None


_ENCODER = msgspec.json.Encoder(order="sorted")


def encode_checkpoint(meta: Checkpoint) -> bytes:
    """The metadata's canonical JSON bytes (sorted keys, indented)."""
    return msgspec.json.format(_ENCODER.encode(meta), indent=1) + b"\n"


def signed_bytes(meta: Checkpoint) -> bytes:
    """What a signature covers: the metadata's canonical bytes without the signature. Every
    field the loader uses is in them (every shard's checksum, so the data too), as decoded, so
    an editor cannot change what loads by re-spacing or reordering the JSON."""
    return encode_checkpoint(msgspec.structs.replace(meta, signature=None))


def key_id(key: bytes) -> str:
    """A name for a signing key that tells nothing of it: the first 8 bytes of its HMAC of a
    fixed text (never of metadata, whose bytes start with ``{``)."""
    return hmac.digest(key, b"autodist checkpoint key id", "sha256")[:8].hex()


def signature_of(meta: Checkpoint, key: bytes) -> Signature:
    """The signature of ``meta`` under ``key`` (the saving job's, derived for :data:`SIGNING_PURPOSE`).

    >>> meta = Checkpoint(step=1, world_size=1, data="data-1-x", params={},
    ...                   model=SavedModel(class_name="M", num_parameters=0, param_fingerprint="0" * 64))
    >>> meta.signature = signature_of(meta, b"k" * 32)
    >>> signature_problem(meta, b"k" * 32), signature_problem(msgspec.structs.replace(meta, step=2), b"k" * 32)
    (None, 'its metadata does not match its signature: it was changed after it was saved')
    """
    mac = hmac.digest(key, signed_bytes(meta), "sha256").hex()
    return Signature(key_id=key_id(key), hmac_sha256=mac)


def signature_problem(meta: Checkpoint, key: bytes) -> str | None:
    """Why ``meta``'s signature does not hold under ``key``: it has none, it names another key,
    or its HMAC differs (compared in constant time); None when it holds."""
    if meta.signature is None:
        return "it is not signed"
    if meta.signature.key_id != key_id(key):
        return (
            f"it was signed with another key than this job's (key id {meta.signature.key_id}, this job's "
            f"{key_id(key)}): the job's secret differs from the saving job's"
        )
    if not hmac.compare_digest(signature_of(meta, key).hmac_sha256, meta.signature.hmac_sha256):
        return "its metadata does not match its signature: it was changed after it was saved"
    return None


def read_checkpoint(path: str | os.PathLike) -> Checkpoint:
    """Decode and check ``path/checkpoint.json``; raise :class:`CheckpointError` (one line)
    when it is missing, not a regular file (a symlink is refused), larger than
    :data:`MAX_METADATA_BYTES`, newer than this autodist, malformed, or names shards that do
    not tile their tensors or do not fit in their files. Reads no shard data."""
    path = Path(path)
    file = path / METADATA_FILE
    if not os.path.lexists(file):
        raise CheckpointError(f"not a checkpoint (no {METADATA_FILE} in it)", path)
    try:
        data = read_input_file(file, what="checkpoint's metadata", max_bytes=MAX_METADATA_BYTES, follow_symlinks=False)
    except InputFileError as err:
        problem = str(err).removeprefix(f"{printable(str(file))}: ")
        raise CheckpointError(f"{METADATA_FILE}: {problem}", path) from None
    return decode_checkpoint(data, path)


@contextmanager
def open_folder(path: str | os.PathLike, inside: int | None = None) -> Iterator[int]:
    """``with open_folder(path) as fd``: a descriptor of the folder ``path`` (the user named it,
    so it may be a symlink), or with ``inside``, of the folder ``path`` directly inside that one
    (never through a symlink), for :func:`open_inside`."""
    if inside is None:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | _CLOEXEC)
    else:
        fd = open_inside(inside, str(path), path, folder=True)
    try:
        yield fd
    finally:
        os.close(fd)


def open_inside(dir_fd: int, name: str, path: str | os.PathLike, *, folder: bool = False) -> int:
    """A read-only descriptor of ``name`` directly inside the open folder ``dir_fd``: a regular
    file (with ``folder``, a folder), never a symlink, FIFO or device, so nothing outside the
    checkpoint folder is read and nothing blocks. Raises :class:`CheckpointError` naming it
    (``path`` is the checkpoint, for the message); FileNotFoundError when it is not there."""
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | _CLOEXEC | (os.O_DIRECTORY if folder else 0)
    try:
        fd = os.open(name, flags, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno not in (errno.ELOOP, errno.ENOTDIR):  # Linux: ELOOP, and ENOTDIR for a folder's link
            raise
        if stat.S_ISLNK(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode):
            raise CheckpointError(
                f"{name} is a symbolic link: a checkpoint's files are read only from inside its folder", path
            ) from None
        raise CheckpointError(f"{name} is not a folder", path) from None
    mode = os.fstat(fd).st_mode
    if not (stat.S_ISDIR(mode) if folder else stat.S_ISREG(mode)):
        os.close(fd)
        raise CheckpointError(f"{name} is not a {'folder' if folder else 'regular file'}", path)
    return fd


class _Header(msgspec.Struct):
    """The two fields read before the rest: what the file is and which version wrote it."""

    format: Any = None
    version: Any = None


def decode_checkpoint(data: bytes, path: str | os.PathLike = "checkpoint") -> Checkpoint:
    """The checks of :func:`read_checkpoint` on metadata bytes (``save_checkpoint`` runs them
    on what it is about to write, so it never commits metadata it could not read back).

    The header is read first; version 2 metadata is then decoded straight into
    :class:`Checkpoint`, version 1 through Python dicts and :func:`upgrade_checkpoint` (20 MB of
    metadata, 128,000 shards: 0.75 s typed, 1.4 s through dicts, plus 0.7 s of layout checks, on
    the 2-core test machine)."""
    try:
        header = msgspec.json.decode(data, type=_Header)
        raw = msgspec.json.decode(data) if header.version == 1 else None
    except msgspec.DecodeError as exc:
        if isinstance(exc, msgspec.ValidationError):  # not a JSON object
            header = _Header()
        else:
            raise CheckpointError(f"{METADATA_FILE} is not valid JSON ({exc})", path) from None
    except RecursionError:  # msgspec's own depth guard, quick at any size
        raise CheckpointError(f"{METADATA_FILE} is nested too deeply to be a checkpoint's metadata", path) from None
    if header.format != CHECKPOINT_FORMAT:
        raise CheckpointError(
            f'{METADATA_FILE}: "format" is not "{CHECKPOINT_FORMAT}": not an autodist checkpoint', path
        )
    duplicate = duplicate_key(data, raw)
    if duplicate:
        raise CheckpointError(f"{METADATA_FILE}: {duplicate}", path)
    version = header.version
    if isinstance(version, int) and not isinstance(version, bool) and version > CHECKPOINT_VERSION:
        raise CheckpointError(
            f"checkpoint format version {version}, this autodist reads up to {CHECKPOINT_VERSION}: upgrade autodist",
            path,
        )
    try:
        if raw is not None:  # version 1
            meta = msgspec.convert(upgrade_checkpoint(raw), Checkpoint)
        else:
            meta = msgspec.json.decode(data, type=Checkpoint)
    except msgspec.ValidationError as exc:
        raise CheckpointError(f"{METADATA_FILE}: {constraint_in_words(str(exc))}", path) from None
    except RecursionError:
        raise CheckpointError(f"{METADATA_FILE} is nested too deeply to be a checkpoint's metadata", path) from None
    problems = layout_problems(meta) + scheduler_problems(meta.scheduler)
    if meta.signature is not None and meta.version < SIGNATURE_VERSION:
        problems.append(f"a signature in version {meta.version} metadata (signed since {SIGNATURE_VERSION})")
    if problems:
        more = f" (and {len(problems) - 1} more problems)" if len(problems) > 1 else ""
        raise CheckpointError(f"{METADATA_FILE}: {problems[0]}{more}", path)
    return meta


def upgrade_checkpoint(raw: dict) -> dict:
    """Decoded metadata of version 1 as version 2 wrote it (the input is not changed): the
    saved plan's ``mesh.dim_names`` is called ``mesh.axes``. (Version 3 only adds checksums,
    which neither older version has; version 4 the loader's position and version 5 the
    signature, both optional.)

    >>> old = {"version": 1, "plan": {"mesh": {"dim_names": ["dp"], "shape": [2], "process_ids": [0, 1]}}}
    >>> upgrade_checkpoint(old)["plan"]["mesh"]
    {'axes': ['dp'], 'shape': [2], 'process_ids': [0, 1]}
    """
    if raw.get("version") != 1:
        return raw
    raw = dict(raw, version=2)
    plan = raw.get("plan")
    if isinstance(plan, dict) and isinstance(plan.get("mesh"), dict):
        raw["plan"] = dict(plan, mesh=rename_mesh_axes(plan["mesh"]))
    return raw


def saved_tensors(meta: Checkpoint) -> dict[str, SavedTensor]:
    """Every tensor of the checkpoint by a flat name: ``param/<fqn>``, ``optimizer/<fqn>/<kind>``."""
    named = {f"param/{fqn}": t for fqn, t in meta.params.items()}
    if meta.optimizer is not None:
        for fqn, kinds in meta.optimizer.states.items():
            named.update({f"optimizer/{fqn}/{kind}": t for kind, t in kinds.items()})
    return named


def scheduler_problems(saved: SavedScheduler | None, where: str = "scheduler", depth: int = 1) -> list[str]:
    """A saved LR scheduler nested deeper than :data:`MAX_SCHEDULER_DEPTH`, or holding a state
    value that is no plain value (:func:`state_value_problem`).

    Example::

        >>> scheduler_problems(SavedScheduler(class_name="StepDecay", state={"last_epoch": 2, "last_lr": 1e999}))
        ['scheduler.last_lr is not a finite number']
    """
    if saved is None:
        return []
    if depth > MAX_SCHEDULER_DEPTH:
        return [f"{where}: LR schedulers nested more than {MAX_SCHEDULER_DEPTH} deep"]
    problems = [f"{where}.{key} {problem}" for key, value in sorted(saved.state.items())
                if (problem := state_value_problem(value))]  # fmt: skip
    for key, inner in sorted(saved.nested.items()):
        problems += scheduler_problems(inner, f"{where}.{key}", depth + 1)
    return problems


def state_key_problem(key: Any) -> str | None:
    """Why ``key`` cannot name a scheduler state value in a checkpoint (it must be an identifier).

    >>> state_key_problem("last_epoch"), state_key_problem("best-metric")
    (None, "'best-metric' is not an identifier")
    """
    try:
        msgspec.convert(key, Identifier)
    except msgspec.ValidationError:
        return f"{key!r:.60} is not an identifier"
    return None


def state_value_problem(value: Any, in_list: bool = False) -> str | None:
    """Why ``value`` is no plain scheduler state value, or None. Plain: null, a bool, an integer
    of magnitude up to 2**53, a finite float, a string of up to 256 characters, or a list of up
    to 256 of those (not of lists).

    >>> state_value_problem(3), state_value_problem([1, "a"]), state_value_problem({"a": 1})
    (None, None, 'is a dict, not a number, string, null or list')
    """
    if value is None or isinstance(value, (bool, str)) and len(str(value)) <= _MAX_STATE_STR:
        return None
    if isinstance(value, int):
        return None if abs(value) <= _MAX_STATE_INT else f"is an integer beyond ±2**53 ({str(value)[:20]}...)"
    if isinstance(value, float):
        return None if math.isfinite(value) else "is not a finite number"
    if isinstance(value, str):
        return f"is a string of {len(value)} characters, more than {_MAX_STATE_STR}"
    if isinstance(value, list) and not in_list:
        if len(value) > _MAX_STATE_LIST:
            return f"is a list of {len(value)} values, more than {_MAX_STATE_LIST}"
        return next((f"[{i}] {p}" for i, v in enumerate(value) if (p := state_value_problem(v, True))), None)
    return f"is a {type(value).__name__}, not a number, string, null{'' if in_list else ' or list'}"


def layout_problems(meta: Checkpoint) -> list[str]:
    """Shards that do not tile their tensor, whose bytes lie outside their file or are another
    shard's too; a shard of version 3 metadata without its checksum."""
    problems = []
    spans: dict[str, list[tuple[int, int, str]]] = {}  # file: (first byte, end, tensor)
    for name, tensor in sorted(saved_tensors(meta).items()):
        tiling = tiling_problem(tensor.shape, [(s.offset, s.shape) for s in tensor.shards])
        if tiling:
            problems.append(f"{name}: {tiling}")
        for shard in tensor.shards:
            end = shard.byte_offset + math.prod(shard.shape) * DTYPE_BYTES[tensor.dtype]
            if shard.sha256 is None and meta.version >= CHECKSUM_VERSION:
                problems.append(f"{name}: a shard has no sha256 (version {meta.version} metadata must have one)")
            if shard.file not in meta.files:
                problems.append(f"{name}: shard file {shard.file!r} is not listed in files")
            elif end > meta.files[shard.file]:
                problems.append(
                    f"{name}: a shard ends at byte {end} of {shard.file!r}, which has {meta.files[shard.file]}"
                )
            spans.setdefault(shard.file, []).append((shard.byte_offset, end, name))
    for file, found in sorted(spans.items()):
        problems += _span_problems(file, sorted(found))
    return problems


def _span_problems(file: str, spans: list[tuple[int, int, str]]) -> list[str]:
    """Shards of one file, sorted by first byte, that share bytes: each shard's bytes are
    written once, after the one before, so two reading the same bytes (an alias) is an edit.

    >>> _span_problems("rank0.bin", [(0, 8, "param/a"), (0, 8, "param/b")])
    ["param/b: its bytes 0..8 in 'rank0.bin' are also param/a's"]
    """
    at, last = 0, ""
    for start, end, name in spans:
        if start < at:
            return [f"{name}: its bytes {start}..{end} in {file!r} are also {last}'s"]
        at, last = end, name
    return []


def shard_digest(name: str, dtype: str, shard: Shard, data: bytes | memoryview) -> str:
    """The checksum a shard carries: sha256 of what it is (its tensor's name as
    :func:`saved_tensors` keys it, the dtype, its offset and shape in the full tensor), then its
    bytes. Bound to the name and place, so bytes that moved to another tensor or another place
    of the same tensor (swapped entries, swapped offsets) do not match either.

    >>> shard = Shard(file="rank0.bin", byte_offset=0, offset=[0], shape=[1])
    >>> shard_digest("param/w", "float32", shard, bytes(4)) == shard_digest("param/v", "float32", shard, bytes(4))
    False
    """
    digest = hashlib.sha256(f"{name}\0{dtype}\0{shard.offset}\0{shard.shape}\0".encode())
    digest.update(data)
    return digest.hexdigest()


def tiling_problem(shape: list[int], boxes: list[tuple[list[int], list[int]]]) -> str | None:
    """Why the ``(offset, shape)`` boxes do not tile a tensor of ``shape`` exactly once, or
    None. Shards of a placement form a grid: along each dim their intervals partition the dim,
    and every cell of the grid is one box.

    Example::

        >>> tiling_problem([4, 6], [([0, 0], [2, 6]), ([2, 0], [2, 6])])
        >>> tiling_problem([4, 6], [([0, 0], [2, 6])])
        'the shards cover rows 0..2 of dim 0, not all 4'
    """
    if any(len(off) != len(shape) or len(size) != len(shape) for off, size in boxes):
        return f"a shard's offset or shape does not have {len(shape)} dims"
    for dim, n in enumerate(shape):
        intervals = sorted({(off[dim], off[dim] + size[dim]) for off, size in boxes})
        end = 0
        for start, stop in intervals:
            if start != end:
                return f"the shards of dim {dim} overlap or leave a gap at {end}"
            end = stop
        if end != n:
            return f"the shards cover rows 0..{end} of dim {dim}, not all {n}"
    if len({tuple(off) for off, _ in boxes}) != len(boxes) or len(boxes) != math.prod(
        len({(off[d], size[d]) for off, size in boxes}) for d in range(len(shape))
    ):
        return "the shards do not form one grid (a piece is missing or written twice)"
    return None
