"""Formatting shared by the review commands (show, diff, check, export, render).

FQNs collapse into patterns -- a 32-layer model has hundreds of parameters but only a handful of
distinct layouts, and ``llama.layers.*.self_attn.q_proj.weight`` stands for all of them -- and
sizes and times read the same way in every command (strategies: :func:`autodist.schemas.describe.strategy_text`).

Example::

    >>> [(row.pattern, row.value) for row in collapse({"l.0.w": "a", "l.1.w": "a", "l.2.w": "b"})]
    [('l.{0-1}.w', 'a'), ('l.2.w', 'b')]
    >>> human_bytes(3 * 2**30), human_seconds(0.0131), human_count(312672)
    ('3.0 GiB', '13.1 ms', '312.7k')

Plans are untrusted input: every line a review command prints or draws goes through
:func:`printable` (control characters escaped) and names in columns through :func:`clip`.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Hashable, Iterable, Mapping

from autodist.schemas import Plan
from autodist.schemas.vocabulary import FLOAT_DTYPES, TRAINING_DTYPES
from autodist.schemas import printable as printable  # the one escaping function (PlanError uses it too)
from autodist.schemas.describe import index_ranges as index_ranges  # the one way to say runs of indices

#: The widest a name column gets in text output; longer names end in an ellipsis (``--json``
#: output keeps them whole).
MAX_NAME_WIDTH = 80


def abridged(items: list[tuple], most: int) -> list[tuple]:
    """At most ``most`` of ``(key, value)`` items: the first ones, a ``("…", None)`` marker, and
    the last one, so a drawing of a mesh of any size stays small (``show``, ``render``).

    >>> abridged([(i, i) for i in range(100)], 5)
    [(0, 0), (1, 1), (2, 2), ('…', None), (99, 99)]
    """
    if len(items) <= most:
        return items
    return items[: most - 2] + [("…", None)] + items[-1:]


def clip(text: str, width: int = MAX_NAME_WIDTH) -> str:
    """``text`` cut to ``width`` characters, the last one an ellipsis when cut.

    >>> clip("llama.layers.0.mlp.up_proj.weight", 12)
    'llama.layer…'
    """
    return text if len(text) <= width else text[: width - 1] + "…"


# -- collapsing FQNs into patterns -------------------------------------------------------------------


def is_index(part: str) -> bool:
    """An index segment of an FQN: ASCII digits only (``"²".isdigit()`` is true, ``int("²")`` fails)."""
    return part.isascii() and part.isdigit()


def natural_key(fqn: str) -> tuple:
    """Sort key that orders ``layers.2`` before ``layers.10``."""
    return tuple((0, int(part), "") if is_index(part) else (1, 0, part) for part in fqn.split("."))


def wildcard(fqn: str) -> str:
    """``llama.layers.3.mlp.up_proj.weight`` -> ``llama.layers.*.mlp.up_proj.weight``."""
    return ".".join("*" if is_index(part) else part for part in fqn.split("."))


@dataclass(frozen=True)
class Collapsed:
    """One row of a collapsed listing: every FQN in ``members`` has ``value``.

    ``pattern`` uses ``*`` for a numeric path segment that takes every index the model has, and
    ``{0-3,8}`` for a subset of them; it names exactly ``members``, never more.
    """

    pattern: str
    value: Any
    members: tuple[str, ...]


def collapse(values: Mapping[str, Hashable], explicit: bool = False, universe: Iterable[str] = ()) -> list[Collapsed]:
    """Group FQNs that differ only in layer indices and share a value, in natural order.

    Exact by construction: a pattern is only used when the FQNs it names are precisely the
    group; otherwise the FQNs are listed one by one. ``*`` means every index among the FQNs of
    ``values`` and ``universe`` (pass all of a plan's FQNs when ``values`` is a subset, so that
    ``*`` never claims more than it should). ``explicit`` writes index ranges
    (``layers.{0-15}``) even where ``*`` would do, for listings such as stage contents.
    """
    everyone: dict[str, list[str]] = defaultdict(list)
    for fqn in sorted(set(values) | set(universe), key=natural_key):
        everyone[wildcard(fqn)].append(fqn)
    rows: list[Collapsed] = []
    for members in everyone.values():
        groups: dict[Hashable, list[str]] = {}
        for fqn in members:
            if fqn in values:
                groups.setdefault(values[fqn], []).append(fqn)
        for value, group in groups.items():
            rows.extend(Collapsed(p, value, tuple(m)) for p, m in _index_patterns(group, members, explicit))
    return sorted(rows, key=lambda row: natural_key(row.members[0]))


def _index_patterns(group: list[str], members: list[str], explicit: bool) -> list[tuple[str, list[str]]]:
    """Name ``group`` (a subset of ``members``, all of one wildcard pattern) with index sets,
    or FQN by FQN when no single pattern names exactly the group."""
    if len(group) == 1:
        return [(group[0], group)]
    split = [fqn.split(".") for fqn in group]
    positions = [i for i, part in enumerate(split[0]) if is_index(part)]
    chosen = {i: {int(parts[i]) for parts in split} for i in positions}
    every = {i: {int(m.split(".")[i]) for m in members} for i in positions}
    named = [m for m in members if all(int(m.split(".")[i]) in chosen[i] for i in positions)]
    if named != group:
        return [(fqn, [fqn]) for fqn in group]
    parts = list(split[0])
    for i in positions:
        if len(chosen[i]) == 1:
            parts[i] = str(next(iter(chosen[i])))
        elif chosen[i] == every[i] and not explicit:
            parts[i] = "*"
        else:
            parts[i] = "{" + index_ranges(sorted(chosen[i])) + "}"
    return [(".".join(parts), group)]


# -- small formatters shared by show and diff ---------------------------------------------------------


def human_bytes(n: float) -> str:
    """``human_bytes(3 * 2**30) == "3.0 GiB"``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def human_seconds(s: float) -> str:
    """``human_seconds(0.0131) == "13.1 ms"``."""
    if s >= 1:
        return f"{s:.2f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.1f} ms"
    return f"{s * 1e6:.1f} us"


def human_count(n: float) -> str:
    """``human_count(312672) == "312.7k"``."""
    for unit, size in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.1f}{unit}"
    return f"{n:.0f}"


def dtype_text(plan: Plan) -> str:
    """What the plan's estimate is priced in (``provenance.arguments["dtype"]``: ``--dtype``, else
    the model's parameters' dtype), and over which parameters when that differs (mixed precision).

    >>> dtype_text(load_plan("plans/gpt/plan_1x8dev.json"))   # doctest: +SKIP
    'fp32'
    """
    dtype = plan.provenance.arguments.get("dtype")
    if dtype not in TRAINING_DTYPES:
        return "not recorded"
    held = sorted({p.dtype for p in plan.params.values() if p.dtype in FLOAT_DTYPES})
    if held in ([], [TRAINING_DTYPES[dtype]]):
        return dtype
    return f"{dtype} (mixed precision: {', '.join(held)} parameters)"


def mesh_text(plan: Plan) -> str:
    """``dp × mp = 2 × 2``."""
    return f"{' × '.join(plan.mesh.axes)} = {' × '.join(map(str, plan.mesh.shape))}"


def mesh_grid(plan: Plan) -> list[list[list[int]]]:
    """Rank ids as nested lists: one 2-D grid per index of the leading dims beyond two.

    A 1-D mesh is one row, a 2-D mesh one grid, a 3-D ``pp × dp × mp`` mesh one grid per stage.
    """
    shape, ids = list(plan.mesh.shape), list(plan.mesh.process_ids)
    rows, cols = (shape[-2] if len(shape) >= 2 else 1), shape[-1]
    per_grid = rows * cols
    return [[ids[g + r * cols : g + (r + 1) * cols] for r in range(rows)] for g in range(0, len(ids), per_grid)]


def stage_summary(plan: Plan) -> list[dict[str, Any]]:
    """Per pipeline stage: its blocks (collapsed into ranges) and its parameter count."""
    stages = []
    for stage in range(plan.strategy.pp):
        blocks = [b.layer for b in plan.blocks if b.stage == stage]
        kinds = sorted({b.kind for b in plan.blocks if b.stage == stage})
        block_ranges = [row.pattern for row in collapse({layer: 0 for layer in blocks}, explicit=True)]
        params = [fqn for fqn, p in plan.params.items() if p.stage == stage]
        numel = sum(_numel(plan.params[fqn].shape) for fqn in params)
        stages.append(
            {
                "stage": stage,
                "blocks": block_ranges,
                "num_blocks": len(blocks),
                "block_kinds": kinds,
                "num_params": len(params),
                "num_elements": numel,
            }
        )
    return stages


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
