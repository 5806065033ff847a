"""What changed between two plans, in words a reviewer reads in a pull request.

Every top-level field of the plan is compared, so two plans either give at least one line or are
byte-for-byte the same once canonically encoded (``dump_plan``); the ``diff`` command exits 1 or 0
on that, like ``diff``.

Example::

    >>> from autodist.schemas import load_plan
    >>> for line in diff_plans(load_plan("old.json"), load_plan("new.json")):   # doctest: +SKIP
    ...     print(line)
    mesh: dp × mp 2 × 4 → 4 × 2
    64 parameters changed placement:
      llama.layers.*.self_attn.q_proj.weight  mp:S(1) → replicated
    estimate: step time 1.21 s → 1.05 s (-13%)
"""

from __future__ import annotations

from typing import Any, Callable

import msgspec

from autodist.schemas import ParamPlan, Plan

from autodist.planner.review.format import (
    clip,
    collapse,
    human_bytes,
    human_count,
    human_seconds,
    natural_key,
    printable,
)

Lines = list[str]


def diff_plans(old: Plan, new: Plan) -> Lines:
    """Readable lines describing every difference; empty when the plans are equal. Plan text
    in them is escaped (:func:`printable`): each line is one line on a terminal."""
    lines: Lines = []
    for field, describe in _DESCRIBERS.items():
        before, after = getattr(old, field), getattr(new, field)
        if msgspec.to_builtins(before) == msgspec.to_builtins(after):
            continue
        described = describe(old, new)
        # A field that differs in a way no describer words still counts: never report "equal" wrongly.
        lines += described or [f"{field}: changed"]
    return [printable(line) for line in lines]


# -- one describer per top-level field ----------------------------------------------------------------


def _changes(label: str, old: Any, new: Any, names: list[str], fmt: Callable[[Any], str] = str) -> Lines:
    """``label: name before → after`` for each named attribute that differs."""
    return [
        f"{label}: {name} {fmt(getattr(old, name))} → {fmt(getattr(new, name))}"
        for name in names
        if getattr(old, name) != getattr(new, name)
    ]


def _format_version(old: Plan, new: Plan) -> Lines:
    return [f"format version {old.version} → {new.version}"]


def _model(old: Plan, new: Plan) -> Lines:
    a, b = old.model, new.model
    lines = _changes("model", a, b, ["class_name", "num_parameters", "traced_layer"])
    if a.param_fingerprint != b.param_fingerprint:
        lines.append("model: parameter fingerprint changed (parameters renamed, resized, added or removed)")
    if a.graph_fingerprint != b.graph_fingerprint:
        lines.append("model: graph fingerprint changed (the traced forward is different)")
    if msgspec.to_builtins(a.input_specs) != msgspec.to_builtins(b.input_specs):
        spec = lambda specs: ", ".join(f"{s.name} {s.dtype} {'x'.join(map(str, s.shape))}" for s in specs)  # noqa: E731
        lines.append(f"model: inputs {spec(a.input_specs)} → {spec(b.input_specs)}")
    return lines


def _cluster(old: Plan, new: Plan) -> Lines:
    a, b = old.cluster, new.cluster
    lines = _changes("cluster", a, b, ["nodes", "devices_per_node"])
    if a.device.name != b.device.name:
        lines.append(f"cluster: device {a.device.name} → {b.device.name}")
    elif a.device != b.device:
        lines.append(f"cluster: device profile {a.device.name} figures changed")
    if a.device.memory_bytes != b.device.memory_bytes:
        lines.append(
            f"cluster: device memory {human_bytes(a.device.memory_bytes)} → {human_bytes(b.device.memory_bytes)}"
        )
    return lines


def _mesh(old: Plan, new: Plan) -> Lines:
    a, b = old.mesh, new.mesh
    shape = lambda m: " × ".join(map(str, m.shape))  # noqa: E731
    if a.axes == b.axes:
        lines = [f"mesh: {' × '.join(a.axes)} {shape(a)} → {shape(b)}"] if a.shape != b.shape else []
    else:
        lines = [f"mesh: {' × '.join(a.axes)} {shape(a)} → {' × '.join(b.axes)} {shape(b)}"]
    if a.process_ids != b.process_ids and len(a.process_ids) == len(b.process_ids):
        lines.append("mesh: ranks placed in a different order")
    return lines


def _strategy(old: Plan, new: Plan) -> Lines:
    names = [f.name for f in msgspec.structs.fields(old.strategy)]
    return _changes("strategy", old.strategy, new.strategy, names, _words)


def _words(value: Any) -> str:
    """A field's value as a reviewer reads it: booleans as on/off."""
    return ("on" if value else "off") if isinstance(value, bool) else str(value)


def placement_by_dim(plan: Plan, param: ParamPlan) -> str:
    """A parameter's placements named by mesh axis, replicated axes left out (``mp:S(1)``), so
    plans over different meshes compare: adding a pp dim does not move a dp×mp parameter."""
    parts = [f"{dim}:{p}" for dim, p in zip(plan.mesh.axes, param.placements) if p != "R"]
    return " ".join(parts) or "replicated"


def _params(old: Plan, new: Plan) -> Lines:
    lines: Lines = []
    added = sorted(set(new.params) - set(old.params))
    removed = sorted(set(old.params) - set(new.params))
    common = set(old.params) & set(new.params)
    universe = set(old.params) | set(new.params)
    lines += _listing(f"{len(added)} parameters added:", {f: 0 for f in added}, lambda v: "", universe)
    lines += _listing(f"{len(removed)} parameters removed:", {f: 0 for f in removed}, lambda v: "", universe)
    aspects: list[tuple[str, Callable[[Plan, ParamPlan], Any]]] = [
        ("changed placement", placement_by_dim),
        ("changed pipeline stage", lambda plan, p: f"stage {p.stage}"),
        ("changed style", lambda plan, p: p.style),
        ("changed shape or dtype", lambda plan, p: f"{'x'.join(map(str, p.shape))} {p.dtype}"),
        ("changed tied parameters", lambda plan, p: ", ".join(p.tied_to) or "none"),
    ]
    for what, view in aspects:
        moved = {
            fqn: (view(old, old.params[fqn]), view(new, new.params[fqn]))
            for fqn in common
            if view(old, old.params[fqn]) != view(new, new.params[fqn])
        }
        lines += _listing(f"{len(moved)} parameters {what}:", moved, lambda v: f"{v[0]} → {v[1]}", universe)
    return lines


def _listing(title: str, values: dict[str, Any], fmt: Callable[[Any], str], universe: set[str]) -> Lines:
    """A title and the FQNs collapsed into patterns (``*`` meaning every index in ``universe``),
    or nothing when ``values`` is empty."""
    if not values:
        return []
    if len(values) == 1:
        title = title.replace("parameters", "parameter", 1).replace("blocks", "block", 1)
    rows = collapse(values, universe=universe)
    width = max(len(clip(row.pattern)) for row in rows)
    return [title] + [f"  {clip(row.pattern):<{width}}  {fmt(row.value)}".rstrip() for row in rows]


def _hooks(old: Plan, new: Plan) -> Lines:
    key = lambda h: (h.layer, h.when, h.action, tuple(getattr(h, "placements", ())), getattr(h, "to_stage", 0))  # noqa: E731
    before, after = {key(h) for h in old.hooks}, {key(h) for h in new.hooks}
    layers = {b.layer for b in old.blocks + new.blocks} | {h.layer for h in old.hooks + new.hooks}
    lines: Lines = []
    for title, keys in (("added", after - before), ("removed", before - after)):
        if not keys:
            continue
        lines.append(f"{len(keys)} hook{'s' if len(keys) != 1 else ''} {title}:")
        rows = []
        # Collapsed per kind of hook, because one layer may carry several; listed in layer order.
        for kind in sorted({k[1:] for k in keys}):
            when, action, placements, to_stage = kind
            words = f"{when} {action}" + (f" -> {' '.join(placements)}" if placements else "")
            words += f" -> stage {to_stage}" if action == "stage_handoff" else ""
            sites = {k[0]: 0 for k in keys if k[1:] == kind}
            rows += [
                (natural_key(row.members[0]), when != "pre", f"  {row.pattern}  {words}")
                for row in collapse(sites, universe=layers)
            ]
        lines += [line for *_, line in sorted(rows)]
    return lines


def _recompute(old: Plan, new: Plan) -> Lines:
    lines: Lines = []
    for title, layers in (
        ("now recomputed", set(new.recompute) - set(old.recompute)),
        ("no longer recomputed", set(old.recompute) - set(new.recompute)),
    ):
        if layers:
            lines.append(f"{len(layers)} layer{'s' if len(layers) != 1 else ''} {title}:")
            lines += [f"  {row.pattern}" for row in collapse(dict.fromkeys(sorted(layers, key=natural_key), 0))]
    return lines


def _data(old: Plan, new: Plan) -> Lines:
    axes = lambda d: ", ".join(d.shard_axes) or "nothing"  # noqa: E731
    lines = (
        [f"data: split over {axes(old.data)} → {axes(new.data)}"] if old.data.shard_axes != new.data.shard_axes else []
    )
    return lines + _changes("data", old.data, new.data, ["input_stage", "label_stage"])


def _implicit_comm(old: Plan, new: Plan) -> Lines:
    total = lambda p: sum(c.bytes_per_step for c in p.implicit_comm)  # noqa: E731
    return [
        f"implicit communication: {len(old.implicit_comm)} sites, {human_bytes(total(old))} per step → "
        f"{len(new.implicit_comm)} sites, {human_bytes(total(new))} per step"
    ]


def _relative(a: float, b: float) -> str:
    return f" ({(b - a) / a:+.0%})" if a else ""


def _estimate(old: Plan, new: Plan) -> Lines:
    a, b = old.estimate, new.estimate
    lines = []
    if a.step_time_s != b.step_time_s:
        lines.append(
            f"estimate: step time {human_seconds(a.step_time_s)} → {human_seconds(b.step_time_s)}"
            f"{_relative(a.step_time_s, b.step_time_s)}"
        )
    if a.tokens_per_s != b.tokens_per_s:
        lines.append(f"estimate: {human_count(a.tokens_per_s)} → {human_count(b.tokens_per_s)} tokens/s")
    if a.mfu != b.mfu:
        lines.append(f"estimate: MFU {a.mfu:.1%} → {b.mfu:.1%}")
    for kind in ("total", "params", "grads", "optimizer", "activations"):
        x, y = getattr(a.memory, kind), getattr(b.memory, kind)
        if x != y:
            lines.append(f"estimate: memory per rank ({kind}) {human_bytes(x)} → {human_bytes(y)}{_relative(x, y)}")
    for kind in ("mp", "dp", "pp", "implicit"):
        x, y = getattr(a.comm_bytes, kind), getattr(b.comm_bytes, kind)
        if x != y:
            lines.append(f"estimate: {kind} communication per step {human_bytes(x)} → {human_bytes(y)}")
    return lines


def _alternatives(old: Plan, new: Plan) -> Lines:
    a, b = old.alternatives, new.alternatives
    return [
        f"alternatives: {len(a.accepted)} accepted, {len(a.rejected)} rejected → "
        f"{len(b.accepted)} accepted, {len(b.rejected)} rejected"
        + ("" if (len(a.accepted), len(a.rejected)) != (len(b.accepted), len(b.rejected)) else " (contents differ)")
    ]


def _blocks(old: Plan, new: Plan) -> Lines:
    view = lambda plan: {b.layer: f"{b.kind} on stage {b.stage}" for b in plan.blocks}  # noqa: E731
    a, b = view(old), view(new)
    universe = set(a) | set(b)
    lines = _listing(f"{len(set(b) - set(a))} blocks added:", {k: b[k] for k in set(b) - set(a)}, str, universe)
    lines += _listing(f"{len(set(a) - set(b))} blocks removed:", {k: a[k] for k in set(a) - set(b)}, str, universe)
    moved = {k: (a[k], b[k]) for k in set(a) & set(b) if a[k] != b[k]}
    return lines + _listing(f"{len(moved)} blocks changed:", moved, lambda v: f"{v[0]} → {v[1]}", universe)


def _notes(old: Plan, new: Plan) -> Lines:
    a, b = set(old.notes), set(new.notes)
    return [f"note added: {n}" for n in new.notes if n not in a] + [
        f"note removed: {n}" for n in old.notes if n not in b
    ]


def _provenance(old: Plan, new: Plan) -> Lines:
    a, b = old.provenance, new.provenance
    lines = _changes("provenance", a, b, ["autodist_version", "paddle_version"])
    for key in sorted(set(a.arguments) | set(b.arguments)):
        x, y = a.arguments.get(key, "(unset)"), b.arguments.get(key, "(unset)")
        if x != y:
            lines.append(f"planner argument {key}: {x} → {y}")
    return lines


#: Top-level plan field -> how its change is put in words, in the order a reviewer wants them.
_DESCRIBERS: dict[str, Callable[[Plan, Plan], Lines]] = {
    "format": lambda old, new: [],
    "version": _format_version,
    "model": _model,
    "cluster": _cluster,
    "mesh": _mesh,
    "strategy": _strategy,
    "params": _params,
    "blocks": _blocks,
    "hooks": _hooks,
    "recompute": _recompute,
    "data": _data,
    "implicit_comm": _implicit_comm,
    "estimate": _estimate,
    "alternatives": _alternatives,
    "notes": _notes,
    "provenance": _provenance,
}
