"""The traced PIR program as a ``networkx.DiGraph`` the matcher and cost model read.

One node per non-constant op, id = the op's index in the program's global block, with the
attributes listed in docs/internals.md (``op``, ``layer``, ``shapes``, ``dtypes``, ``attrs``,
``param``, ``consts``); one edge per def-use with ``operand`` and ``result`` indices. Constant
producers (``pd_op.full``, ``pd_op.full_int_array``, ...) are not nodes: their value is folded
into the consumer's ``consts`` so the matcher sees only real dataflow.

Example::

    >>> graph = build_graph(trace_model(model, specs))           # doctest: +SKIP
    >>> [graph.nodes[n]["op"] for n in graph.successors(q_weight_node)]  # doctest: +SKIP
    ['pd_op.matmul']
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import networkx as nx

from autodist.schemas import dtype_name

from autodist.planner.ops import CONSTANT_OPS
from autodist.planner.trace import TracedProgram

#: Attributes that identify *where* code was (call stacks, struct names with per-process
#: instance counters, generated parameter names), not *what* it computes.
UNSTABLE_ATTRS = frozenset({"op_callstack", "struct_name", "parameter_name", "stop_gradient", "place"})


def build_graph(traced: TracedProgram) -> nx.DiGraph:
    """The dataflow graph of ``traced`` (see the module docstring for node/edge attributes)."""
    ops = traced.ops
    index = {op: i for i, op in enumerate(ops)}
    graph = nx.DiGraph()
    for i, op in enumerate(ops):
        name = op.name()
        if name in CONSTANT_OPS:
            continue
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
            if j in graph:
                graph.add_edge(j, i, operand=operand, result=_result_index(producer, value))
            else:
                graph.nodes[i]["consts"][operand] = _constant_value(producer)
    graph.graph["selected_kernels"] = dict(traced.selected_kernels)
    return graph


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
    for u, v in sorted(graph.edges):
        digest.update(_canonical([u, v, graph.edges[u, v]["operand"], graph.edges[u, v]["result"]]))
    return digest.hexdigest()


def graph_to_json(graph: nx.DiGraph) -> dict[str, Any]:
    """A JSON-able dump (``autodist-plan graph --format json``): nodes and edges, sorted."""
    return {
        "nodes": [{"id": n, **graph.nodes[n]} for n in sorted(graph.nodes)],
        "edges": [{"source": u, "target": v, **graph.edges[u, v]} for u, v in sorted(graph.edges)],
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
    for u, v in sorted(graph.edges):
        lines.append(f'  n{u} -> n{v} [label="{graph.edges[u, v]["operand"]}"];')
    lines.append("}")
    return "\n".join(lines) + "\n"


# -- internals ---------------------------------------------------------------------------------------


def _result_index(op, value) -> int:
    for k, result in enumerate(op.results()):
        if result.is_same(value):
            return k
    return 0


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
