"""A plan as a reviewer reads it: mesh grid, stages, placements collapsed into patterns, estimates.

A plan for a 32-layer model has hundreds of parameters, but only a handful of distinct layouts:
``llama.layers.*.self_attn.q_proj.weight  R S(1)`` stands for all 32 layers at once (the
collapsing is in ``format``, shared with the other review commands).

Example::

    >>> from autodist.schemas import load_plan
    >>> print(show_text(load_plan("plan.json")))        # doctest: +SKIP
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any

import msgspec

from autodist.planner.review.format import (
    MAX_NAME_WIDTH,
    Collapsed,
    abridged,
    clip,
    collapse,
    dtype_text,
    human_bytes,
    human_count,
    human_seconds,
    index_ranges,
    mesh_grid,
    mesh_text,
    natural_key,
    printable,
    stage_summary,
)
from autodist.schemas.describe import strategy_text
from autodist.schemas import Plan
from autodist.schemas.experts import ep_index, held_experts

#: How many accepted alternatives ``show`` lists by default.
TOP_ALTERNATIVES = 5


def placement_rows(plan: Plan) -> list[Collapsed]:
    """The plan's parameters collapsed by (placements, style); ``value`` is that pair."""
    return collapse({fqn: (tuple(p.placements), p.style) for fqn, p in plan.params.items()})


# -- the summary ---------------------------------------------------------------------------------------


#: A 1-D mesh wider than this wraps, a wider row shows its first and last columns; a grid taller
#: than MAX_ROWS shows its first and last rows.
MAX_COLUMNS = 16
MAX_ROWS = 8


def mesh_lines(plan: Plan) -> list[str]:
    """The mesh drawn as a grid of rank ids labelled with axis names (large meshes abridged)."""
    names, grids = plan.mesh.axes, mesh_grid(plan)
    width = max(len(str(i)) for i in plan.mesh.process_ids)
    col_name = names[-1]
    if len(names) == 1 and len(grids[0][0]) > MAX_COLUMNS:  # a long 1-D mesh: wrapped rows
        ids = grids[0][0]
        chunks = [ids[i : i + MAX_COLUMNS] for i in range(0, len(ids), MAX_COLUMNS)]
        heads = [f"{col_name}={i * MAX_COLUMNS}-{i * MAX_COLUMNS + len(c) - 1}" for i, c in enumerate(chunks)]
        label = max(map(len, heads))
        return [
            f"{head:<{label}}" + ("  …" if chunk is None else "".join(f"  {r:>{width}}" for r in chunk))
            for head, chunk in abridged(list(zip(heads, chunks)), MAX_ROWS)
        ]
    row_name = names[-2] if len(names) >= 2 else None
    cell = max(width, len(f"{col_name}={plan.mesh.shape[-1] - 1}"))
    label = max((len(f"{row_name}={len(grids[0]) - 1}") if row_name else 0), 1)
    lines = []
    for g, grid in abridged(list(enumerate(grids)), MAX_ROWS):
        if grid is None:
            lines.append("…")
            continue
        if len(grids) > 1:
            lines.append(f"{names[0]}={g}")
        heads = [f"{col_name}={c}" for c in range(len(grid[0]))]
        lines.append(" " * label + _cells(heads, cell))
        for r, row in abridged(list(enumerate(grid)), MAX_ROWS):
            head = f"{row_name}={r}" if row_name and row is not None else ""
            lines.append(f"{head:<{label}}" + ("  …" if row is None else _cells(row, cell)))
    return lines


def _cells(values: list, width: int) -> str:
    """One row of a mesh grid, right-aligned to ``width``; a row wider than MAX_COLUMNS keeps its
    first and last cells, with ``…`` between."""
    shown = abridged(list(enumerate(values)), MAX_COLUMNS)
    return "".join(f"  {'…' if value is None else value:>{width}}" for _, value in shown)


def show_data(plan: Plan, top: int = TOP_ALTERNATIVES) -> dict[str, Any]:
    """The summary as plain data (what ``show --json`` prints)."""
    to = msgspec.to_builtins
    return {
        "model": to(plan.model),
        "cluster": to(plan.cluster),
        "mesh": {"axes": list(plan.mesh.axes), "shape": list(plan.mesh.shape), "grid": mesh_grid(plan)},
        "strategy": to(plan.strategy),
        "dtype": dtype_text(plan),
        "stages": stage_summary(plan),
        "placements": [
            {"pattern": row.pattern, "placements": list(row.value[0]), "style": row.value[1], "count": len(row.members)}
            for row in placement_rows(plan)
        ],
        "hooks": [
            {
                "pattern": row.pattern,
                "when": row.value[0],
                "action": row.value[1],
                "placements": list(row.value[2]),
                "to_stage": row.value[3],
                "count": len(row.members),
            }
            for row in hook_rows(plan)
        ],
        "experts": expert_holding(plan),
        "local_view": to(plan.local_view),
        "vocab_lookup": to(plan.vocab_lookup),
        "recompute": [row.pattern for row in collapse(dict.fromkeys(plan.recompute, 0))],
        "data": to(plan.data),
        "implicit_comm": to(plan.implicit_comm),
        "estimate": to(plan.estimate),
        "alternatives": {
            "accepted": to(plan.alternatives.accepted[:top]),
            "num_accepted": len(plan.alternatives.accepted),
            "num_rejected": len(plan.alternatives.rejected),
            "rejected_reasons": rejected_reasons(plan),
        },
        "notes": list(plan.notes),
    }


def hook_rows(plan: Plan) -> list[Collapsed]:
    """Hooks collapsed by what they do; ``value`` is ``(when, action, placements, to_stage)``.

    Collapsed per kind of hook, because one layer may carry a pre and a post hook."""
    rows: list[Collapsed] = []
    for kind in sorted({(h.when, h.action) for h in plan.hooks}):
        sites = {
            h.layer: (h.when, h.action, tuple(getattr(h, "placements", ())), getattr(h, "to_stage", 0))
            for h in plan.hooks
            if (h.when, h.action) == kind
        }
        rows += collapse(sites)
    return sorted(rows, key=lambda row: natural_key(row.members[0]))


def implicit_rows(plan: Plan) -> list[tuple[Collapsed, int]]:
    """Implicit collectives collapsed by (collective, op, reason), each with its total bytes."""
    rows: list[tuple[Collapsed, int]] = []
    for kind in sorted({(c.collective, c.op, c.reason) for c in plan.implicit_comm}):
        sites: dict[str, tuple] = {}
        bytes_at: dict[str, int] = defaultdict(int)
        for c in plan.implicit_comm:
            if (c.collective, c.op, c.reason) == kind:
                sites[c.layer] = kind
                bytes_at[c.layer] += c.bytes_per_step
        rows += [(row, sum(bytes_at[m] for m in row.members)) for row in collapse(sites)]
    return sorted(rows, key=lambda pair: natural_key(pair[0].members[0]))


def rejected_reasons(plan: Plan) -> dict[str, int]:
    """How many rejected candidates share each reason, word for word (its numbers are what a
    reviewer acts on: ``mp=3 does not divide the 4 heads of blocks.0-11``), most common first."""
    counts: dict[str, int] = {}
    for rejected in plan.alternatives.rejected:
        counts[rejected.reason] = counts.get(rejected.reason, 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))


def batch_lines(plan: Plan) -> list[str]:
    """The global batch the plan is for (``--global-batch-size``, else the traced input's batch)
    and how it is divided: what the loader must yield, which is not the traced shape's batch when
    the plan was made with ``--global-batch-size``."""
    total = plan.data.global_batch_size
    if not total:
        return []
    s = plan.strategy
    per_rank = total // s.dp if "dp" in plan.data.shard_axes else total
    split = f"{per_rank} per dp rank" if "dp" in plan.data.shard_axes and s.dp > 1 else f"{per_rank} on every rank"
    if s.micro_batches > 1:
        split += f", {s.micro_batches} micro-batches of {per_rank // s.micro_batches}"
    return [f"          global batch {total} samples per optimizer step (what the loader yields): {split}"]


def expert_holding(plan: Plan) -> list[dict[str, Any]]:
    """Under expert parallelism, which experts each rank holds, per (collapsed) expert container:
    ``[{"experts": pattern, "count": n, "held": [{"experts": [...], "ranks": [...]}, ...]}]``.

    Expert parameters' placements read ``R`` (each expert is whole where it is held), but a rank
    holds only ``1/ep`` of them: the ranks at index ``i`` of their ep group (:func:`ep_index`) hold
    the ``i``-th run of experts (:func:`held_experts`, both in :mod:`autodist.schemas.experts`)."""
    ep = plan.strategy.ep
    containers = {b.experts: b.num_experts for b in plan.blocks if b.experts and b.num_experts}
    if ep == 1 or not containers or "dp" not in plan.mesh.axes:
        return []
    axis = plan.mesh.axes.index("dp")
    inner = math.prod(plan.mesh.shape[axis + 1 :])
    index = [
        ep_index((position // inner) % plan.mesh.shape[axis], ep) for position in range(len(plan.mesh.process_ids))
    ]
    ranks = [[r for r, i in zip(plan.mesh.process_ids, index) if i == k] for k in range(ep)]
    return [
        {
            "experts": row.pattern,
            "count": row.value,
            "held": [{"experts": list(held_experts(row.value, ep, k)), "ranks": ranks[k]} for k in range(ep)],
        }
        for row in collapse(containers)
    ]


def expert_lines(plan: Plan) -> list[str]:
    """:func:`expert_holding` in words, under the placements."""
    holding = expert_holding(plan)
    if not holding:
        return []
    ep = plan.strategy.ep
    lines = [f"  experts: each rank holds 1/{ep} of each MoE layer's experts (ep{ep}, over dp)"]
    for container in holding:
        held = "; ".join(
            f"{index_ranges(h['experts'])} on rank{'s' if len(h['ranks']) > 1 else ''} {index_ranges(h['ranks'])}"
            for h in container["held"]
        )
        lines.append(
            f"    {clip(container['experts'])}.*  {container['count']} experts: {clip(held, 4 * MAX_NAME_WIDTH)}"
        )
    return lines


def show_text(plan: Plan, top: int = TOP_ALTERNATIVES) -> str:
    """The summary as text for a terminal or a pull-request comment. Plan text is escaped
    (:func:`printable`) and the name column is at most ``MAX_NAME_WIDTH`` wide (``show --json``
    has the whole names)."""
    out = (
        _header_lines(plan)
        + _stage_lines(plan)
        + _placement_lines(plan)
        + _hook_lines(plan)
        + _local_view_lines(plan)
        + _vocab_lookup_lines(plan)
        + _recompute_lines(plan)
        + [
            "",
            f"data      split over {', '.join(plan.data.shard_axes) or 'nothing (every rank reads the whole batch)'}",
        ]
        + batch_lines(plan)
        + _estimate_lines(plan)
        + _alternative_lines(plan, top)
        + (["", "notes"] + [f"  - {note}" for note in plan.notes] if plan.notes else [])
    )
    return "\n".join(printable(line) for line in out) + "\n"


def _header_lines(plan: Plan) -> list[str]:
    """The model, the cluster, the strategy and the mesh."""
    m, c = plan.model, plan.cluster
    world = c.nodes * c.devices_per_node
    out = [
        f"model     {m.class_name}  ({human_count(m.num_parameters)} parameters, {len(plan.params)} tensors)",
        f"          traced layer {m.traced_layer or '(whole model)'}; traced with "
        + ", ".join(f"{s.name} {s.dtype} {'x'.join(map(str, s.shape))}" for s in m.input_specs),
        f"          param fingerprint {m.param_fingerprint[:12]}…  graph fingerprint {m.graph_fingerprint[:12]}…",
        f"cluster   {c.nodes} node{'s' if c.nodes > 1 else ''} × {c.devices_per_node} {c.device.name} "
        f"= {world} devices, {human_bytes(c.device.memory_bytes)} each",
        f"strategy  {strategy_text(plan.strategy)}",
        f"dtype     {dtype_text(plan)}",
        f"mesh      {mesh_text(plan)}",
    ]
    return out + ["          " + line for line in mesh_lines(plan)]


def _stage_lines(plan: Plan) -> list[str]:
    out = ["", "stages"]
    for stage in stage_summary(plan):
        blocks = ", ".join(stage["blocks"]) or "no blocks"
        kinds = f" ({', '.join(stage['block_kinds'])})" if stage["block_kinds"] else ""
        out.append(
            f"  {stage['stage']}  {blocks}{kinds}; {stage['num_params']} tensors, "
            f"{human_count(stage['num_elements'])} elements"
        )
    return out


def _placement_lines(plan: Plan) -> list[str]:
    """Placements by pattern (none listed when all are replicated), the experts, ties."""
    out = ["", f"placements  ({' '.join(plan.mesh.axes)})"]
    rows = placement_rows(plan)
    replicated = [row for row in rows if set(row.value[0]) == {"R"} and row.value[1] != "ExpertParallel"]
    if len(replicated) == len(rows):  # data parallel only: nothing to list
        rows = []
        out.append(f"  all {len(plan.params)} parameters replicated (R on every mesh axis)")
    elif all(set(row.value[0]) == {"R"} for row in rows):  # data parallel, experts spread: list the experts
        rows = [row for row in rows if row not in replicated]
        others = sum(len(row.members) for row in replicated)
        out.append(f"  all {others} other parameters replicated (R on every mesh axis)")
    width = max((len(clip(r.pattern)) for r in rows), default=0)
    pwidth = max((len(" ".join(r.value[0])) for r in rows), default=0)
    for row in rows:
        count = f"  ×{len(row.members)}" if len(row.members) > 1 else ""
        out.append(f"  {clip(row.pattern):<{width}}  {' '.join(row.value[0]):<{pwidth}}  {row.value[1]}{count}")
    out += expert_lines(plan)
    for fqn, param in sorted(plan.params.items()):
        if param.tied_to:
            out.append(f"  tied: {fqn} is also {', '.join(param.tied_to)} (one parameter)")
        if fqn in param.tied_stages:
            out.append(
                f"  tied: {clip(fqn)} is read on stage {param.stage} and, by a function call, on stage "
                f"{param.tied_stages[fqn]} (which holds a copy)"
            )
    return out


def _hook_lines(plan: Plan) -> list[str]:
    if not plan.hooks:
        return []
    out = ["", "hooks"]
    for row in hook_rows(plan):
        when, action, placements, to_stage = row.value
        target = f" -> {' '.join(placements)}" if placements else ""
        target += f" -> stage {to_stage}" if action == "stage_handoff" else ""
        count = f"  ×{len(row.members)}" if len(row.members) > 1 else ""
        out.append(f"  {row.pattern}  {when} {action}{target}{count}")
    return out


def _local_view_lines(plan: Plan) -> list[str]:
    """Each local-view sub-layer: its fused weights' segments (their sizes when unequal, those
    computed whole on every rank), the attributes set for the call, names relative to the
    sub-layer (``c_attn.nf 96->48``), the buffers cut for it (``k_bias cut along dim 0``), and
    whether its output is joined, collapsed over the blocks."""
    if not plan.local_view:
        return []

    def relative(name: str, layer: str) -> str:
        return name.removeprefix(layer + ".") if name != layer else "self"

    sites = {
        view.layer: "; ".join(
            [
                f"{relative(w.param, view.layer)} {w.segments} segments"
                + (f" {w.sizes}" if w.sizes else "")
                + (f", {w.replicated} whole on every rank" if w.replicated else "")
                for w in view.weights
                if w.segments > 1 and not w.param.endswith(".bias")
            ]
            + [", ".join(f"{relative(a.layer, view.layer)}.{a.name} {a.whole}->{a.local}" for a in view.attributes)]
            + [f"{relative(b.name, view.layer)} cut along dim {b.dim}" for b in view.buffers]
            + (["output joined: each rank's heads to the row projection beside it"] if view.output == "joined" else [])
        )
        for view in plan.local_view
    }
    out = ["", "local view: these sub-layers run on local tensors (heads split, output summed over mp unless joined)"]
    for row in collapse(sites):
        count = f"  ×{len(row.members)}" if len(row.members) > 1 else ""
        out.append(f"  {row.pattern}  {row.value}{count}")
    return out


def _vocab_lookup_lines(plan: Plan) -> list[str]:
    """Each token lookup run on local tensors (``plan.vocab_lookup``)."""
    if not plan.vocab_lookup:
        return []
    out = ["", "vocab lookup: these lookups run on local tensors (own rows looked up, output summed over mp)"]
    return out + [f"  {lookup.layer}  {lookup.weight}" for lookup in plan.vocab_lookup]


def _recompute_lines(plan: Plan) -> list[str]:
    if not plan.recompute:
        return []
    out = ["", f"recompute ({plan.strategy.recompute}): forward run again in backward"]
    return out + [f"  {clip(row.pattern)}" for row in collapse(dict.fromkeys(plan.recompute, 0))]


def _estimate_lines(plan: Plan) -> list[str]:
    """Step time, memory and communication per rank, and where Paddle communicates on its own."""
    est, device = plan.estimate, plan.cluster.device
    mem, comm = est.memory, est.comm_bytes
    out = [
        "",
        f"estimate  {human_seconds(est.step_time_s)} per step, {human_count(est.tokens_per_s)} tokens/s, "
        f"MFU {est.mfu:.0%}",
        f"  memory per rank  {human_bytes(mem.total)} of {human_bytes(device.memory_bytes)}: params "
        f"{human_bytes(mem.params)}, grads {human_bytes(mem.grads)}, optimizer {human_bytes(mem.optimizer)}, "
        f"activations {human_bytes(mem.activations)}",
        f"  comm per step    mp {human_bytes(comm.mp)}, dp {human_bytes(comm.dp)}, pp {human_bytes(comm.pp)}, "
        f"implicit {human_bytes(comm.implicit)}",
    ]
    for row, total in implicit_rows(plan):
        collective, op, reason = row.value
        count = f" ×{len(row.members)}" if len(row.members) > 1 else ""
        out.append(f"  implicit {collective} at {row.pattern}{count} ({op}): {human_bytes(total)} — {reason}")
    return out


def _alternative_lines(plan: Plan, top: int) -> list[str]:
    alt = plan.alternatives
    if not (alt.accepted or alt.rejected):
        return []
    out = ["", f"alternatives  {len(alt.accepted)} accepted, {len(alt.rejected)} rejected"]
    for cand in alt.accepted[:top]:
        out.append(
            f"  {human_seconds(cand.estimate.step_time_s):>9}  {human_bytes(cand.estimate.memory.total):>10}  "
            f"{strategy_text(cand.strategy)}"
        )
    return out + [f"  rejected ×{times}: {reason}" for reason, times in list(rejected_reasons(plan).items())[:top]]
