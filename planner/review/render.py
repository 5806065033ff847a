"""A plan as a picture (plain SVG, no dependency): the mesh, the pipeline stages with their blocks,
and a bar per rank of estimated memory by kind, scaled to the largest rank (the device's memory an
outline where a rank reaches it).

The plan's memory estimate is for the most loaded rank. Each rank's bar scales the parameter,
gradient and optimizer parts by that rank's share of the planned parameter elements (computed
from the plan's shapes, placements and stages) and keeps the activation estimate as it is; the
legend says so. Ranks whose bars are identical share one bar, labelled with their rank ids.

Example::

    >>> from autodist.schemas import load_plan
    >>> svg = render_svg(load_plan("plan.json"))          # doctest: +SKIP
    >>> svg.startswith("<svg")                             # doctest: +SKIP
    True
"""

from __future__ import annotations

import math
from xml.sax.saxutils import escape

from autodist.schemas import Plan, shard_dim

from autodist.planner.review.format import (
    abridged,
    dtype_text,
    human_bytes,
    index_ranges,
    mesh_grid,
    mesh_text,
    printable,
    stage_summary,
)
from autodist.schemas.describe import strategy_text

WIDTH = 900
MARGIN = 20
STAGE_COLORS = ["#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948", "#b07aa1", "#ff9da7"]
MEMORY_KINDS = [("params", "#4e79a7"), ("grads", "#f28e2b"), ("optimizer", "#59a14f"), ("activations", "#b07aa1")]
BAR_HEIGHT = 16
LABEL_WIDTH = 150
#: Ranks per row of a drawn 1-D mesh (and the most cells a drawn row has), the most grids and rows
#: drawn (more are abridged as ``show`` abridges them: every rank of a 4,096-rank mesh is drawn, a
#: larger mesh's first and last), and the most height the mesh drawing takes.
WRAP_1D = 32
MAX_GRIDS = 8
MAX_ROWS = 128
MESH_HEIGHT = 400


def rank_param_elements(plan: Plan) -> list[int]:
    """Planned parameter elements held by each rank: its stage's parameters, divided by the mesh
    axes each one is sharded over."""
    names, shape, ids = plan.mesh.axes, plan.mesh.shape, plan.mesh.process_ids
    sizes = dict(zip(names, shape))
    per_stage = [0] * plan.strategy.pp
    for param in plan.params.values():
        numel = math.prod(param.shape)
        for axis, placement in zip(names, param.placements):
            if shard_dim(placement) is not None:
                numel //= sizes[axis]
        per_stage[param.stage] += numel
    stage_width = len(ids) // plan.strategy.pp
    return [per_stage[position // stage_width] for position in range(len(ids))]


def rank_memory(plan: Plan) -> list[dict[str, float]]:
    """Estimated bytes by kind per rank, in mesh order (see the module docstring)."""
    elements = rank_param_elements(plan)
    most = max(elements) or 1
    mem = plan.estimate.memory
    return [
        {
            "params": mem.params * n / most,
            "grads": mem.grads * n / most,
            "optimizer": mem.optimizer * n / most,
            "activations": float(mem.activations),
        }
        for n in elements
    ]


def _xml_text(text: str) -> str:
    """Plan text as XML character data: control characters escaped as visible text first (XML
    1.0 allows them in no form, not even as ``&#x1b;``), then ``& < >`` as entities."""
    return escape(printable(text))


class _Svg:
    """Collects SVG elements; every element gets a ``class`` naming what it shows."""

    def __init__(self) -> None:
        self.items: list[str] = []

    def rect(self, cls: str, x: float, y: float, w: float, h: float, fill: str, title: str = "", **extra) -> None:
        attrs = " ".join(f'{k.replace("_", "-")}="{v}"' for k, v in extra.items())
        tip = f"<title>{_xml_text(title)}</title>" if title else ""
        self.items.append(
            f'<rect class="{cls}" x="{x:.1f}" y="{y:.1f}" width="{max(w, 0):.1f}" height="{h:.1f}" '
            f'fill="{fill}" {attrs}>{tip}</rect>'
        )

    def text(self, cls: str, x: float, y: float, content: str, size: int = 12, anchor: str = "start", **extra) -> None:
        attrs = " ".join(f'{k.replace("_", "-")}="{v}"' for k, v in extra.items())
        self.items.append(
            f'<text class="{cls}" x="{x:.1f}" y="{y:.1f}" font-size="{size}" text-anchor="{anchor}" '
            f"{attrs}>{_xml_text(content)}</text>"
        )

    def document(self, height: float) -> str:
        body = "\n  ".join(self.items)
        return (
            f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height:.0f}" '
            f'viewBox="0 0 {WIDTH} {height:.0f}" font-family="DejaVu Sans, Helvetica, Arial, sans-serif">\n'
            f'  <rect class="background" x="0" y="0" width="{WIDTH}" height="{height:.0f}" fill="white"/>\n'
            f"  {body}\n</svg>\n"
        )


def render_svg(plan: Plan) -> str:
    """The picture of ``plan`` as an SVG document."""
    svg = _Svg()
    y: float = MARGIN + 14
    svg.text(
        "title",
        MARGIN,
        y,
        f"{plan.model.class_name} on {len(plan.mesh.process_ids)} × {plan.cluster.device.name}",
        size=16,
        font_weight="bold",
    )
    y += 20
    svg.text(
        "subtitle",
        MARGIN,
        y,
        f"{strategy_text(plan.strategy)}; dtype {dtype_text(plan)}; mesh {mesh_text(plan)}",
        size=12,
    )
    y = _mesh(svg, plan, y + 24)
    y = _stages(svg, plan, y + 24)
    y = _memory(svg, plan, y + 24)
    return svg.document(y + MARGIN)


def _abridged_rows(grid: list[list[int]]) -> list[tuple]:
    """One grid's rows as drawn: at most MAX_ROWS ``(row, cells)``, each at most WRAP_1D
    ``(column, rank)`` cells; a left-out row or cell is ``("…", None)`` (:func:`abridged`)."""
    return [
        (r, None if row is None else abridged(list(enumerate(row)), WRAP_1D))
        for r, row in abridged(list(enumerate(grid)), MAX_ROWS)
    ]


def _mesh(svg: _Svg, plan: Plan, y: float) -> float:
    """The mesh as cells of rank ids. A large mesh is drawn abridged as ``show`` prints it (first
    and last grids, rows and columns, ``…`` between), so the picture's size is bounded whatever the
    plan's rank count: at most MAX_GRIDS grids of MAX_ROWS rows of WRAP_1D cells."""
    svg.text("heading", MARGIN, y, "mesh (rank ids)", size=14, font_weight="bold")
    y += 10
    names, grids = plan.mesh.axes, mesh_grid(plan)
    if len(names) == 1 and len(grids[0][0]) > WRAP_1D:  # a long 1-D mesh wraps into rows
        ids = grids[0][0]
        grids = [[ids[i : i + WRAP_1D] for i in range(0, len(ids), WRAP_1D)]]
    shown = [
        (g, None if grid is None else _abridged_rows(grid)) for g, grid in abridged(list(enumerate(grids)), MAX_GRIDS)
    ]
    cols = max(len(row) for _, grid in shown if grid for _, row in grid if row)
    rows = max(len(grid) for _, grid in shown if grid)
    # Cells shrink to keep any mesh within the page's width and MESH_HEIGHT; ids only where they fit.
    cell = max(3.0, min(44.0, (WIDTH - 2 * MARGIN - 60) / (cols * len(shown) + len(shown)), MESH_HEIGHT / rows))
    show_ids, gap = cell >= 22, (2.0 if cell >= 10 else 0.5)
    x0 = MARGIN + 50
    for position, (g, grid) in enumerate(shown):
        gx = x0 + position * (cols + 1) * cell
        if grid is None:  # grids left out
            svg.text("ellipsis", gx, y + 18 + rows * cell / 2, "…", size=14)
            continue
        color = STAGE_COLORS[g % len(STAGE_COLORS)] if "pp" in names else STAGE_COLORS[0]
        if len(grids) > 1:
            svg.text("grid-label", gx, y + 12, f"{names[0]}={g}", size=11)
        for r, (_, row) in enumerate(grid):
            for c, (_, rank) in enumerate(row or [("…", None)]):
                cx, cy = gx + c * cell, y + 18 + r * cell
                if rank is None:  # rows or columns left out
                    svg.text("ellipsis", cx + cell / 2, cy + cell / 2 + 3, "…", size=11, anchor="middle")
                    continue
                svg.rect(
                    "rank",
                    cx,
                    cy,
                    cell - gap,
                    cell - gap,
                    color,
                    title=f"rank {rank}",
                    fill_opacity="0.85",
                    data_rank=rank,
                )
                if show_ids:
                    svg.text(
                        "rank-id",
                        cx + (cell - gap) / 2,
                        cy + cell / 2 + 3,
                        str(rank),
                        size=11,
                        anchor="middle",
                        fill="white",
                    )
    col_dim = names[-1]
    row_dim = names[-2] if len(names) >= 2 else None
    svg.text("dim-label", x0, y + 18 + rows * cell + 14, f"→ {col_dim} ({plan.mesh.shape[-1]})", size=11)
    if row_dim:
        svg.text("dim-label", MARGIN, y + 18 + rows * cell / 2, f"↓ {row_dim}", size=11)
    return y + 18 + rows * cell + 20


def _stages(svg: _Svg, plan: Plan, y: float) -> float:
    svg.text("heading", MARGIN, y, "pipeline stages", size=14, font_weight="bold")
    y += 10
    for stage in stage_summary(plan):
        s = stage["stage"]
        color = STAGE_COLORS[s % len(STAGE_COLORS)]
        blocks = ", ".join(stage["blocks"]) or "no blocks"
        kinds = f" ({', '.join(stage['block_kinds'])})" if stage["block_kinds"] else ""
        svg.rect(
            "stage",
            MARGIN,
            y,
            WIDTH - 2 * MARGIN,
            24,
            color,
            title=f"stage {s}",
            fill_opacity="0.2",
            stroke=color,
            data_stage=s,
        )
        svg.text(
            "stage-label",
            MARGIN + 8,
            y + 16,
            f"stage {s}: {blocks}{kinds} — {stage['num_params']} tensors, {stage['num_blocks']} blocks",
            size=12,
        )
        y += 30
    return y


def _memory(svg: _Svg, plan: Plan, y: float) -> float:
    """A bar per group of identical ranks, scaled to the largest rank (a small model's bars drawn
    against a large device's memory would have no width); the device's memory is an outline where
    a rank reaches it, else said in the heading."""
    device = plan.cluster.device.memory_bytes
    groups: dict[tuple, list[int]] = {}
    for rank, mem in zip(plan.mesh.process_ids, rank_memory(plan)):
        groups.setdefault(tuple(round(mem[k]) for k, _ in MEMORY_KINDS), []).append(rank)
    largest = max(sum(key) for key in groups) or 1
    svg.text(
        "heading",
        MARGIN,
        y,
        f"estimated memory per rank (device: {human_bytes(device)}"
        + (f"; bars to the largest rank's {human_bytes(largest)})" if largest < device else ")"),
        size=14,
        font_weight="bold",
    )
    y += 8
    legend_x = MARGIN
    for kind, color in MEMORY_KINDS:
        svg.rect("legend", legend_x, y + 4, 12, 12, color)
        svg.text("legend-label", legend_x + 16, y + 14, kind, size=11)
        legend_x += 110
    svg.text(
        "legend-note",
        MARGIN,
        y + 32,
        "params, grads and optimizer scaled by each rank's share of the planned parameters; activations as "
        "estimated for the most loaded rank; the outline is the device's memory, where a rank reaches it",
        size=10,
        fill="#555",
    )
    y += 44
    bar_width = WIDTH - 2 * MARGIN - LABEL_WIDTH - 70
    scale = bar_width / largest
    for key, ranks in sorted(groups.items(), key=lambda kv: min(kv[1])):
        label = f"rank{'s' if len(ranks) > 1 else ''} {index_ranges(ranks)}"
        svg.text("bar-label", MARGIN, y + 12, label, size=11)
        x = MARGIN + LABEL_WIDTH
        for (kind, color), value in zip(MEMORY_KINDS, key):
            svg.rect(
                "memory",
                x,
                y,
                value * scale,
                BAR_HEIGHT,
                color,
                title=f"{label}: {kind} {human_bytes(value)}",
                data_kind=kind,
                data_bytes=value,
            )
            x += value * scale
        total = sum(key)
        if largest >= device:
            svg.rect(
                "device-memory",
                MARGIN + LABEL_WIDTH,
                y - 1,
                device * scale,
                BAR_HEIGHT + 2,
                "none",
                title=f"device memory {human_bytes(device)}",
                stroke="#d62728" if total > device else "#333",
                stroke_width="1",
            )
        svg.text(
            "bar-total",
            MARGIN + LABEL_WIDTH + bar_width + 6,
            y + 12,
            f"{human_bytes(total)}{' (over!)' if total > device else ''}",
            size=11,
        )
        y += BAR_HEIGHT + 8
    return y
