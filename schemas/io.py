"""Reading and writing plans: strict decode, canonical encode, atomic save.

Example::

    >>> from autodist.schemas import load_plan, dump_plan, save_plan
    >>> plan = load_plan("plan.json")          # doctest: +SKIP
    >>> dump_plan(plan) == open("plan.json", "rb").read()   # a saved plan is canonical  # doctest: +SKIP
    True
"""

from __future__ import annotations

import os
import re
import tempfile
import typing
from pathlib import Path
from typing import Any

import msgspec

from autodist.schemas.checks import check_plan
from autodist.schemas.errors import PlanError
from autodist.schemas.plan import FORMAT, VERSION, Plan

_ENCODER = msgspec.json.Encoder(order="sorted")
_PATH_SEGMENT = re.compile(r"\.([A-Za-z_][A-Za-z_0-9]*)|\[(\d+)\]|\[\.\.\.\]")


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
    """The canonical bytes of a plan: sorted keys, two-space indent, shortest round-trip floats,
    newline at the end. The same plan always gives the same bytes."""
    return msgspec.json.format(_ENCODER.encode(plan), indent=2) + b"\n"


def save_plan(plan: Plan, path: str | os.PathLike) -> None:
    """Write ``plan`` to ``path`` atomically: a temp file in the same folder, then a rename, so
    a reader never sees a half-written plan and an interrupted write leaves the old file."""
    data = dump_plan(plan)
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent or ".")
    try:
        # mkstemp creates the file owner-only; a plan is meant to be shared, so give it the
        # permissions an ordinary new file gets under the user's umask.
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


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
        return Path(source).read_bytes(), str(source)
    except OSError as exc:
        raise PlanError(f"cannot read the plan file: {exc.strerror or exc}", source=str(source)) from None


def _decode(data: bytes, name: str) -> Plan:
    try:
        raw = msgspec.json.decode(data)
    except msgspec.DecodeError as exc:
        raise PlanError(f"not valid JSON ({exc})", source=name) from None
    if not isinstance(raw, dict):
        raise PlanError(f"$: expected a JSON object, got {type(raw).__name__}", source=name)
    if raw.get("format") != FORMAT:
        raise PlanError(f'$.format: expected "{FORMAT}", got {raw.get("format")!r}: not an autodist plan', source=name)
    version = raw.get("version")
    if isinstance(version, int) and not isinstance(version, bool) and version > VERSION:
        raise PlanError(
            f"$.version: this plan is format version {version}, but this autodist reads versions up "
            f"to {VERSION}: upgrade autodist (pip install -U paddle-autodist) to use it",
            source=name,
        )
    try:
        return msgspec.convert(raw, Plan)
    except msgspec.ValidationError as exc:
        raise PlanError(_name_the_path(str(exc), raw), source=name) from None


def _name_the_path(message: str, raw: Any) -> str:
    """Rewrite msgspec's ``... - at `$.params[...].placements[1]``` into
    ``$.params["model.fc.weight"].placements[1]: ...`` by finding the failing dict key."""
    text, sep, path = message.rpartition(" - at `")
    if not sep:
        return message
    path = path.rstrip("`")
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
            resolved += "[...]" if key is None else f'["{key}"]'
            node = node.get(key) if key is not None else None
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
    for key in sorted(node, key=str):
        try:
            msgspec.convert(node[key], value_type)
        except msgspec.ValidationError:
            return key
    return None
