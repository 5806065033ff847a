"""The experts of an MoE block: the layers expert parallelism spreads over data-parallel ranks.

A block holds experts when two or more of its recognised MLPs (:mod:`.roles`) are the numbered
children of one container (an MoE's ``LayerList``: ``experts.0``, ``experts.1``, ...) and its
MoE layer (the container's parent) routes tokens to them. How many experts there are comes from
the parameters (every numbered child, recognised or not); to how many each token goes
(``top_k``), from the MoE layer's *selections over the expert axis*, however the router spells
them: each ``topk`` over an axis as long as the expert count picks k experts (Mixtral, Qwen3-MoE),
each ``argmax`` over it picks one (GShard's and Switch's gates: ``argmax`` for the first expert,
``argmax`` again with it masked out for the second). A selection over another axis is not
routing (DeepSpeed's random token selection takes ``topk`` over the token axis to fill each
expert's capacity).

Example::

    >>> from autodist.planner.recognise.roles import Projection
    >>> rows = [f"layers.0.moe.experts.{i}.w2" for i in range(2)]
    >>> mlps = [SubLayer("mlp", (), Projection(row, f"{row}.weight", None, "row", 0)) for row in rows]
    >>> params = {f"layers.0.moe.experts.{i}.w2.weight": ([8, 4], "float32") for i in range(4)}
    >>> experts_of("layers.0", mlps, params, top_k=2)
    Experts(layer='layers.0.moe.experts', count=4, top_k=2)
"""

from __future__ import annotations

from dataclasses import dataclass, replace

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
    found = experts_of(layer, sublayers, params, top_k=0)
    if found is None:
        return None
    top_k = experts_per_token(graph, nodes, found.layer.rpartition(".")[0], found.count)
    return replace(found, top_k=top_k) if top_k > 0 else None


def experts_per_token(graph: nx.DiGraph, nodes: frozenset[int], moe_layer: str, count: int) -> int:
    """How many of ``count`` experts each token is routed to: the selections over an axis of
    ``count`` entries made by the ops of ``moe_layer`` (k for a ``topk``, 1 for an ``argmax``).

    >>> g = nx.DiGraph()
    >>> g.add_node(0, op="pd_op.softmax", layer="moe.gate", shapes=[[16, 4]], attrs={}, consts={})
    >>> g.add_node(1, op="pd_op.argmax", layer="moe.gate", shapes=[[16]], attrs={}, consts={1: 1.0})
    >>> g.add_node(2, op="pd_op.argmax", layer="moe.gate", shapes=[[16]], attrs={}, consts={1: 1.0})
    >>> g.add_edges_from([(0, 1), (0, 2)], operand=0, result=0)
    >>> experts_per_token(g, frozenset(g), "moe", 4)
    2
    >>> g.add_node(3, op="pd_op.topk", layer="moe", shapes=[[2, 4], [2, 4]], attrs={"axis": 0}, consts={1: 2.0})
    >>> g.add_edge(0, 3, operand=0, result=0)  # the capacity's 2 tokens of each expert: not routing
    >>> experts_per_token(g, frozenset(g), "moe", 4)
    2
    """
    picked = 0
    for node in sorted(nodes):
        data = graph.nodes[node]
        op = short_op(data["op"])
        if op not in ("topk", "argmax") or not (data["layer"] + ".").startswith(moe_layer + "."):
            continue
        source = next(
            (graph.nodes[u]["shapes"][e["result"]] for u, _, e in graph.in_edges(node, data=True) if e["operand"] == 0),
            None,
        )
        axis = int(data["attrs"]["axis"]) if op == "topk" else int(data["consts"].get(1, -1))
        if op == "argmax" and data["attrs"].get("flatten"):
            continue
        if not source or not -len(source) <= axis < len(source) or source[axis] != count:
            continue
        picked += data["shapes"][0][axis] if op == "topk" else 1
    return picked


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
