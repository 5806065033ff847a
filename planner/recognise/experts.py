"""The experts of an MoE block: the layers expert parallelism spreads over data-parallel ranks.

A block holds experts when two or more of its recognised MLPs (:mod:`.roles`) are the numbered
children of one container (an MoE's ``LayerList``: ``experts.0``, ``experts.1``, ...) and a
``topk`` op routes its tokens. How many experts there are comes from the parameters (every
numbered child, recognised or not); to how many each token goes, from the ``topk`` output's shape.

Example::

    >>> from autodist.planner.recognise.roles import Projection
    >>> rows = [f"layers.0.moe.experts.{i}.w2" for i in range(2)]
    >>> mlps = [SubLayer("mlp", (), Projection(row, f"{row}.weight", None, "row", 0)) for row in rows]
    >>> params = {f"layers.0.moe.experts.{i}.w2.weight": ([8, 4], "float32") for i in range(4)}
    >>> experts_of("layers.0", mlps, params, top_k=2)
    Experts(layer='layers.0.moe.experts', count=4, top_k=2)
"""

from __future__ import annotations

from dataclasses import dataclass

import networkx as nx

from autodist.planner.recognise.match import short_op
from autodist.planner.recognise.roles import SubLayer


@dataclass(frozen=True)
class Experts:
    """The container of a block's experts (``layers.0.block_sparse_moe.experts``), how many
    experts it holds and to how many of them the router sends each token."""

    layer: str
    count: int
    top_k: int


def find_experts(
    graph: nx.DiGraph,
    nodes: frozenset[int],
    layer: str,
    sublayers: list[SubLayer],
    params: dict[str, tuple[list[int], str]],
) -> Experts | None:
    """The experts of block ``layer`` (module docstring), or None."""
    routes = [graph.nodes[n] for n in sorted(nodes) if short_op(graph.nodes[n]["op"]) == "topk"]
    if not routes:
        return None
    data = routes[0]
    shape = data["shapes"][0] or []
    axis = int(data["attrs"].get("axis", -1))
    top_k = shape[axis] if shape and -len(shape) <= axis < len(shape) else 0
    return experts_of(layer, sublayers, params, top_k) if top_k > 0 else None


def experts_of(
    layer: str, sublayers: list[SubLayer], params: dict[str, tuple[list[int], str]], top_k: int
) -> Experts | None:
    """The container under ``layer`` with two or more numbered children that are recognised MLPs."""
    by_container: dict[str, set[str]] = {}
    for sub in sublayers:
        if sub.kind != "mlp":
            continue
        container, index = _numbered_owner(sub.row.layer, layer)
        if container:
            by_container.setdefault(container, set()).add(index)
    found = sorted((c for c, indices in by_container.items() if len(indices) > 1), key=len)
    if not found:
        return None
    container = found[0]
    indices = {fqn[len(container) + 1 :].split(".")[0] for fqn in params if fqn.startswith(container + ".")}
    return Experts(container, sum(1 for i in indices if i.isdigit()), top_k)


def _numbered_owner(fqn: str, layer: str) -> tuple[str, str]:
    """``("layers.0.moe.experts", "3")`` for ``layers.0.moe.experts.3.w2`` inside ``layers.0``:
    the innermost numbered component below the block; ``("", "")`` if there is none."""
    parts = fqn[len(layer) + 1 :].split(".") if fqn.startswith(layer + ".") else []
    for i in range(len(parts) - 1, -1, -1):
        if parts[i].isdigit():
            return ".".join([layer, *parts[:i]]), parts[i]
    return "", ""
