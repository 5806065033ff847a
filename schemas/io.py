"""Reading and writing plans: strict decode, canonical encode, atomic save.

Example::

    >>> from autodist.schemas import load_plan, dump_plan, save_plan
    >>> plan = load_plan("plan.json")          # doctest: +SKIP
    >>> dump_plan(plan) == open("plan.json", "rb").read()   # a saved plan is canonical  # doctest: +SKIP
    True
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import re
import signal
import socket
import tempfile
import threading
import typing
from pathlib import Path
from typing import Any, Iterator

import msgspec

from autodist.schemas.checks import check_plan
from autodist.schemas.errors import PlanError, printable
from autodist.schemas.inputs import InputFileError, read_input_file
from autodist.schemas.plan import FORMAT, PATTERN_MEANINGS, VERSION, Plan

#: Struct fields in their declared order (a plan opens with ``format``, ``version``, ``model``,
#: ..., and ends with ``alternatives``), maps such as ``params`` sorted by key: canonical either way.
_ENCODER = msgspec.json.Encoder(order="deterministic")
_PLAIN_KEY = re.compile(r"[A-Za-z_][A-Za-z_0-9]*\Z")
_PATH_SEGMENT = re.compile(r"\.([A-Za-z_][A-Za-z_0-9]*)|\[(\d+)\]|\[\.\.\.\]")
#: The largest plan file read: a plan for a 1,000,000-rank mesh is about 10 MB.
MAX_PLAN_BYTES = 64 << 20


def load_plan(source: str | os.PathLike | bytes | Plan) -> Plan:
    """Decode and check a plan from a path, JSON bytes, or an already-built :class:`Plan`.

    Raises :class:`PlanError` naming the JSON path of every problem, or telling the user to
    upgrade autodist when the plan is newer than this version understands.
    """
    if isinstance(source, Plan):
        plan, name = source, "plan"
    else:
        data, name = _read(source)
        plan = _decode(data, name)
    problems = check_plan(plan)
    if problems:
        raise PlanError(problems, source=name)
    return plan


def dump_plan(plan: Plan) -> bytes:
    """The canonical bytes of a plan: every object's fields in the order :class:`Plan` and its
    parts declare them, map keys (parameter names, arguments) sorted, two-space indent, shortest
    round-trip floats, newline at the end. The same plan always gives the same bytes, whatever
    order the file it was read from had."""
    return msgspec.json.format(_ENCODER.encode(plan), indent=2) + b"\n"


def save_plan(plan: Plan, path: str | os.PathLike) -> None:
    """Write ``plan`` to ``path`` atomically: a temp file in the same folder, then a rename, so
    a reader never sees a half-written plan and an interrupted write leaves the old file.

    What is written is checked first as :func:`load_plan` will read it: a plan that would be
    refused (a NaN estimate, a name outside the grammar) raises :class:`PlanError` and writes
    nothing."""
    data = dump_plan(plan)
    load_plan(data)
    write_atomically(path, data)


def write_atomically(path: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temp file of a unique name in the same folder and a
    rename: a reader never sees half a file, two writers never share a temp file, and a failed or
    interrupted write leaves the old file and removes its temp file. The one file writer of
    autodist (plans, exported configs, SVGs, graphs, calibrate's cluster.toml).

    Interrupted means by an exception, Ctrl-C, or SIGTERM or SIGHUP (while the write runs they
    raise here, the temp file is removed, and the process then dies of the signal as it would
    have). SIGKILL cannot be caught: the temp file (``.<name>.<host>-<pid>.<random>.tmp``, hidden,
    beside ``path``, there for the milliseconds of one write) is removed by the next write of
    ``path`` on this host once its process is gone."""
    path = Path(path)
    folder = path.parent if str(path.parent) else Path(".")
    _remove_stale_temps(folder, path.name)
    tmp = None
    with _signals_interrupt():
        try:
            fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.{_HOST}-{os.getpid()}.", suffix=".tmp", dir=folder)
            # mkstemp creates the file owner-only; what autodist writes is meant to be shared, so
            # give it the permissions an ordinary new file gets under the user's umask.
            umask = os.umask(0)
            os.umask(umask)
            os.chmod(tmp, 0o666 & ~umask)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            if tmp is not None:
                Path(tmp).unlink(missing_ok=True)
            raise


#: This host's name as temp file names carry it (no dots: they separate the name's parts).
_HOST = re.sub(r"[^A-Za-z0-9_-]", "_", socket.gethostname()) or "host"


def _remove_stale_temps(folder: Path, name: str) -> None:
    """Remove the temp files :func:`write_atomically` left for ``name`` in ``folder`` when a
    process writing it was killed (SIGKILL): those of this host whose process is gone."""
    try:
        leftovers = list(folder.glob(f".{glob.escape(name)}.{_HOST}-*.tmp"))
    except OSError:
        return
    for leftover in leftovers:
        pid = leftover.name[len(f".{name}.{_HOST}-") :].partition(".")[0]
        if pid.isdigit() and not _alive(int(pid)):
            leftover.unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # someone else's process: alive
        return True
    return True


class _Signalled(BaseException):
    """SIGTERM or SIGHUP arrived during a write (raised by :func:`_signals_interrupt`'s handler)."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


@contextlib.contextmanager
def _signals_interrupt() -> Iterator[None]:
    """While the block runs, SIGTERM and SIGHUP (when nobody handles them: their default action
    kills the process without unwinding) raise :class:`_Signalled`, so the block's cleanup runs;
    then the signal is delivered again under its default action. Only the main thread can set
    handlers; elsewhere the block runs as it is."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum: int, frame: Any) -> None:
        raise _Signalled(signum)

    previous = {}
    for sig in (signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(sig) == signal.SIG_DFL:
            previous[sig] = signal.signal(sig, interrupt)
    try:
        yield
    except _Signalled as caught:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        previous.clear()
        os.kill(os.getpid(), caught.signum)  # die of it, as without the handler
        raise
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def plan_json_schema() -> dict[str, Any]:
    """The JSON Schema (2020-12) of the plan format, generated from the Structs."""
    schema = msgspec.json.schema(Plan)
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["title"] = f"{FORMAT} v{VERSION}"
    return schema


# -- internals ---------------------------------------------------------------------------------------


def _read(source: str | os.PathLike | bytes) -> tuple[bytes, str]:
    if isinstance(source, (bytes, bytearray, memoryview)):
        return bytes(source), "plan"
    try:
        return read_input_file(source, what="plan file", max_bytes=MAX_PLAN_BYTES), str(source)
    except InputFileError as exc:
        problem = str(exc).removeprefix(printable(os.fspath(source)) + ": ")
        raise PlanError(problem, source=str(source)) from None


def _decode(data: bytes, name: str) -> Plan:
    try:
        raw = msgspec.json.decode(data)
    except msgspec.DecodeError as exc:
        raise PlanError(f"not valid JSON ({exc})", source=name) from None
    except RecursionError:
        raise PlanError("not a plan: JSON nested too deeply", source=name) from None
    duplicate = duplicate_key(data, raw)
    if duplicate:
        raise PlanError(duplicate, source=name)
    if not isinstance(raw, dict):
        raise PlanError(f"$: expected a JSON object, got {type(raw).__name__}", source=name)
    if raw.get("format") != FORMAT:
        raise PlanError(
            f'$.format: expected "{FORMAT}", got {_short(raw.get("format"))}: not an autodist plan', source=name
        )
    version = raw.get("version")
    if isinstance(version, int) and not isinstance(version, bool) and version > VERSION:
        raise PlanError(
            f"$.version: this plan is format version {version}, but this autodist reads versions up "
            f"to {VERSION}: upgrade autodist (pip install -U paddle-autodist) to use it",
            source=name,
        )
    try:
        return msgspec.convert(upgrade(raw), Plan)
    except msgspec.ValidationError as exc:
        raise PlanError(_name_the_path(constraint_in_words(str(exc)), raw), source=name) from None


def upgrade(raw: dict) -> dict:
    """A decoded plan of an older format version as the current version writes it (the input is
    not changed). Version 1 gave every hook both ``placements`` and ``to_stage``; version 2 keeps
    each only on the hook kind that uses it, and calls mesh axes axes: version 1's
    ``mesh.dim_names`` and ``data.shard_dims`` are ``mesh.axes`` and ``data.shard_axes``.

    >>> old = {"version": 1, "hooks": [{"action": "stage_handoff", "layer": "l.1", "when": "post",
    ...                                 "placements": [], "to_stage": 1, "reason": ""}]}
    >>> upgrade(old)["hooks"]
    [{'action': 'stage_handoff', 'layer': 'l.1', 'when': 'post', 'to_stage': 1, 'reason': ''}]
    >>> upgrade({"version": 1, "mesh": {"dim_names": ["dp"], "shape": [2]}, "data": {"shard_dims": ["dp"]}})
    {'version': 2, 'mesh': {'axes': ['dp'], 'shape': [2]}, 'data': {'shard_axes': ['dp']}}
    """
    if raw.get("version") != 1:
        return raw
    raw = dict(raw, version=VERSION)
    if isinstance(raw.get("hooks"), list):
        raw["hooks"] = [_upgrade_hook(hook) for hook in raw["hooks"]]
    if isinstance(raw.get("mesh"), dict):
        raw["mesh"] = rename_mesh_axes(raw["mesh"])
    if isinstance(raw.get("data"), dict):
        raw["data"] = _rename_key(raw["data"], "shard_dims", "shard_axes")
    return raw


def rename_mesh_axes(mesh: dict) -> dict:
    """A mesh as format version 1 wrote it (``dim_names``) with its axes named as now (``axes``),
    in the same key position; also used for the mesh a version 1 checkpoint records."""
    return _rename_key(mesh, "dim_names", "axes")


def _rename_key(obj: dict, old: str, new: str) -> dict:
    return {new if key == old else key: value for key, value in obj.items()}


def _upgrade_hook(hook: Any) -> Any:
    if not isinstance(hook, dict):
        return hook  # msgspec names the problem
    unused = {"placements": "reshard", "to_stage": "stage_handoff"}
    return {k: v for k, v in hook.items() if k not in unused or unused[k] == hook.get("action")}


class _DuplicateKey(Exception):
    pass


def _refuse_duplicates(pairs: list[tuple[str, Any]]) -> dict:
    keys = [key for key, _ in pairs]
    if len(set(keys)) != len(keys):
        raise _DuplicateKey(next(k for k in keys if keys.count(k) > 1), dict(pairs))
    return dict(pairs)


def duplicate_key(data: bytes, raw: Any) -> str | None:
    """A problem naming the first object key given twice in the JSON ``data`` (``raw``: as
    decoded, to name where), or None. JSON lets a reader keep the last of two equal keys, so two
    plans (or checkpoints' metadata) that differ could read as the same one: neither may hold
    any. (msgspec keeps the last silently; Python's json reports pairs.)

    >>> duplicate_key(b'{"step": 1, "step": 2}', {"step": 2})
    '$: the key "step" appears more than once (JSON readers would keep only one)'
    """
    try:
        json.loads(data, object_pairs_hook=_refuse_duplicates)
    except _DuplicateKey as dup:
        key, obj = dup.args
        where = _path_of_object(raw, obj) or "$"
        return f"{where}: the key {json.dumps(key)} appears more than once (JSON readers would keep only one)"
    except (ValueError, RecursionError):  # msgspec read it; anything else here is not a duplicate
        return None
    return None


def _path_of_object(node: Any, obj: dict, path: str = "$") -> str | None:
    """The JSON path of the first object in ``node`` equal to ``obj`` (as read, last key wins)."""
    if isinstance(node, dict):
        if node == obj:
            return path
        children = ((f".{k}" if _PLAIN_KEY.match(k) else f"[{json.dumps(k)}]", v) for k, v in node.items())
    elif isinstance(node, list):
        children = ((f"[{i}]", v) for i, v in enumerate(node))
    else:
        return None
    for step, child in children:
        found = _path_of_object(child, obj, path + step)
        if found:
            return found
    return None


def constraint_in_words(message: str) -> str:
    """msgspec's ``Expected `str` matching regex '<regex>'`` in words (plans and checkpoints).

    >>> from autodist.schemas.plan import Identifier
    >>> import typing
    >>> constraint_in_words(f"Expected `str` matching regex {typing.get_args(Identifier)[1].pattern!r}")
    'Expected `str` (an ASCII identifier)'
    """
    for pattern, meaning in PATTERN_MEANINGS.items():
        message = message.replace(f"matching regex {pattern!r}", f"({meaning})")
    return message


def _short(value: Any) -> str:
    text = json.dumps(value) if isinstance(value, (str, int, float, bool, type(None))) else type(value).__name__
    return text if len(text) <= 40 else text[:37] + "..."


def _name_the_path(message: str, raw: Any) -> str:
    """Rewrite msgspec's ``... - at `$.params[...].placements[1]``` into
    ``$.params["model.fc.weight"].placements[1]: ...`` by finding the failing dict key."""
    text, sep, path = message.rpartition(" - at `")
    if not sep:
        return message
    path = path.rstrip("`")
    in_key = path.startswith("key` in `")  # a dict key is wrong, not a value
    path = path.removeprefix("key` in `")
    resolved, node, tp = "$", raw, Plan
    for match in _PATH_SEGMENT.finditer(path[1:]):
        field, index = match.group(1), match.group(2)
        if field is not None:
            resolved += f".{field}"
            tp = _field_type(tp, field)
            node = node.get(field) if isinstance(node, dict) else None
        elif index is not None:
            resolved += f"[{index}]"
            tp = _item_type(tp)
            node = node[int(index)] if isinstance(node, list) and int(index) < len(node) else None
        else:  # "[...]": a dict key msgspec does not name
            tp = _item_type(tp)
            key = _failing_key(node, tp) if isinstance(node, dict) else None
            resolved += "[...]" if key is None else f"[{json.dumps(key)}]"
            node = node.get(key) if key is not None else None
    if in_key and isinstance(node, dict):
        key_type = typing.get_args(_unwrap(tp))[0] if typing.get_args(_unwrap(tp)) else Any
        bad = [k for k in sorted(node, key=str) if not _converts(k, key_type)]
        if bad:
            return f"{resolved}[{json.dumps(bad[0])}]: the key is not {text.removeprefix('Expected `str` (').removesuffix(')')}"
    return f"{resolved}: {text}"


def _unwrap(tp: Any) -> Any:
    while typing.get_origin(tp) is typing.Annotated:
        tp = typing.get_args(tp)[0]
    return tp


def _field_type(tp: Any, field: str) -> Any:
    tp = _unwrap(tp)
    if isinstance(tp, type) and issubclass(tp, msgspec.Struct):
        for info in msgspec.structs.fields(tp):
            if info.encode_name == field:
                return info.type
    return Any


def _item_type(tp: Any) -> Any:
    args = typing.get_args(_unwrap(tp))
    return args[-1] if args else Any


def _failing_key(node: dict, value_type: Any) -> str | None:
    return next((key for key in sorted(node, key=str) if not _converts(node[key], value_type)), None)


def _converts(value: Any, tp: Any) -> bool:
    try:
        msgspec.convert(value, tp)
    except msgspec.ValidationError:
        return False
    return True
