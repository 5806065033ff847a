"""The traced PIR program as a ``networkx.MultiDiGraph`` the matcher and cost model read.

One node per non-constant op, id = the op's index in the program's global block, with the
attributes listed in docs/internals.md (``op``, ``layer``, ``shapes``, ``dtypes``, ``attrs``,
``param``, ``consts``); one edge per operand, keyed by the operand's index, with ``operand`` and
``result`` indices: ``matmul(q, k, transpose_y=True)`` with q and k two results of one
``unbind`` is two edges between the same two nodes (:func:`operand_sources` reads them). Constant
producers (``pd_op.full``, ``pd_op.full_int_array``, ...) are not nodes: their value is folded
into the consumer's ``consts`` so the matcher sees only real dataflow.

Example::

    >>> graph = build_graph(trace_model(model, specs))           # doctest: +SKIP
    >>> [graph.nodes[n]["op"] for n in graph.successors(q_weight_node)]  # doctest: +SKIP
    ['pd_op.matmul']
    >>> operand_sources(graph, scores_matmul)  # q and k: results 0 and 1 of one split  # doctest: +SKIP
    {0: (54, 0), 1: (54, 1)}
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import networkx as nx

from autodist.schemas import dtype_name

from autodist.planner.ops import CONSTANT_OPS, GLUE
from autodist.planner.trace import TracedProgram, result_index

#: Attributes that identify *where* code was (call stacks, struct names with per-process
#: instance counters, generated parameter names), not *what* it computes.
UNSTABLE_ATTRS = frozenset({"op_callstack", "struct_name", "parameter_name", "stop_gradient", "place"})


def build_graph(traced: TracedProgram) -> nx.MultiDiGraph:
    """The dataflow graph of ``traced`` (see the module docstring for node/edge attributes)."""
    ops = traced.ops
    index = {op: i for i, op in enumerate(ops)}
    graph = nx.MultiDiGraph()
    for i, op in enumerate(ops):
        name = op.name()
        if name in CONSTANT_OPS or traced.bridges.get(i) is not None:
            continue
        if i in traced.bridges:  # traced block by block: a unit's input the glue between units computed
            name = GLUE
        attrs = op.attrs()
        results = op.results()
        graph.add_node(
            i,
            op=name,
            layer=traced.op_layers[i],
            shapes=[list(r.shape) if r.is_dense_tensor_type() else None for r in results],
            dtypes=[dtype_name(r.dtype) if r.is_dense_tensor_type() else None for r in results],
            attrs={k: _plain(v) for k, v in sorted(attrs.items()) if k not in UNSTABLE_ATTRS},
            param=traced.param_fqns.get(attrs.get("parameter_name")) if name == "builtin.parameter" else None,
            consts={},
            kernel=traced.kernel_ops.get(i, ""),
        )
    for i, op in enumerate(ops):
        if i not in graph:
            continue
        for operand, value in enumerate(op.operands_source()):
            producer = value.get_defining_op()
            j = index.get(producer) if producer is not None else None
            if j is None:
                continue
            j, result = traced.bridges.get(j) or (j, result_index(producer, value))
            if j in graph:
                graph.add_edge(j, i, key=operand, operand=operand, result=result)
            else:
                graph.nodes[i]["consts"][operand] = _constant_value(producer)
    graph.graph["selected_kernels"] = dict(traced.selected_kernels)
    return graph


def operand_sources(graph: nx.DiGraph, node: int) -> dict[int, tuple[int, int]]:
    """Operand index -> ``(producer node, result index)`` of every operand of ``node`` that an
    op computes (a folded constant is in ``consts`` instead), in the order of its predecessors.
    Reads a hand-built ``DiGraph`` of the same edge attributes alike.

    >>> g = nx.MultiDiGraph()
    >>> g.add_edge(0, 1, key=0, operand=0, result=0)
    0
    >>> g.add_edge(0, 1, key=1, operand=1, result=1)
    1
    >>> operand_sources(g, 1)
    {0: (0, 0), 1: (0, 1)}
    """
    return {d["operand"]: (u, d["result"]) for u, _, d in graph.in_edges(node, data=True)}


def _edges(graph: nx.DiGraph) -> list[tuple[int, int, dict]]:
    """Every edge with its attributes, sorted by producer, consumer and operand."""
    return sorted(graph.edges(data=True), key=lambda e: (e[0], e[1], e[2]["operand"]))


def graph_fingerprint(graph: nx.DiGraph) -> str:
    """sha256 over the graph's structure: every node's op, layer, parameter, result shapes and
    dtypes, attributes and folded constants, and every edge. The same model and input specs give
    the same hex digest in any process.

    >>> graph_fingerprint(nx.DiGraph()) == hashlib.sha256().hexdigest()
    True
    """
    digest = hashlib.sha256()
    for node in sorted(graph.nodes):
        data = graph.nodes[node]
        record = [
            node,
            data["op"],
            data["layer"],
            data["param"],
            data["shapes"],
            data["dtypes"],
            data["attrs"],
            sorted(data["consts"].items()),
        ]
        digest.update(_canonical(record))
    for u, v, d in _edges(graph):
        digest.update(_canonical([u, v, d["operand"], d["result"]]))
    return digest.hexdigest()


def graph_to_json(graph: nx.DiGraph) -> dict[str, Any]:
    """A JSON-able dump (``autodist-plan graph --format json``): nodes and edges, sorted."""
    return {
        "nodes": [{"id": n, **graph.nodes[n]} for n in sorted(graph.nodes)],
        "edges": [{"source": u, "target": v, **d} for u, v, d in _edges(graph)],
    }


def graph_to_dot(graph: nx.DiGraph) -> str:
    """Graphviz text (``autodist-plan graph --format dot``): one box per op, clustered labels
    showing op, layer and first result shape."""
    lines = ["digraph autodist {", "  node [shape=box, fontname=monospace, fontsize=10];"]
    for n in sorted(graph.nodes):
        data = graph.nodes[n]
        shape = data["shapes"][0] if data["shapes"] else None
        label = "\\n".join(str(part) for part in (f"{n}: {data['op']}", data["param"] or data["layer"], shape) if part)
        lines.append(f'  n{n} [label="{_dot_escape(label)}"];')
    for u, v, d in _edges(graph):
        lines.append(f'  n{u} -> n{v} [label="{d["operand"]}"];')
    lines.append("}")
    return "\n".join(lines) + "\n"


# -- internals ---------------------------------------------------------------------------------------


def _constant_value(op) -> Any:
    attrs = op.attrs()
    return _plain(attrs.get("value", attrs.get("values")))


def _plain(value: Any) -> Any:
    """Paddle attribute values as JSON-able Python: DataType / Place become their names."""
    if isinstance(value, (bool, int, str)) or value is None:
        return value
    if isinstance(value, float):
        return value if value == value and abs(value) != float("inf") else repr(value)
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if type(value).__name__ == "DataType":  # DataType.FLOAT32 -> "float32"
        return str(value).rpartition(".")[2].lower()
    return str(value)


def _canonical(record: Any) -> bytes:
    return json.dumps(record, sort_keys=True, separators=(",", ":")).encode() + b"\n"


def _dot_escape(text: str) -> str:
    return text.replace('"', '\\"')
