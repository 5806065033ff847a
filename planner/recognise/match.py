"""The compute view of a layer, and subgraph-isomorphism matching of small patterns in it.

A layer's nodes (``model.layers.3`` and everything inside it) are not compared raw: the matcher
and the dataflow roles (:mod:`.roles`) work on the *compute view* (:func:`compute_view`):

- constant subgraphs (ops fed by nothing but folded constants: ``arange``, ``tril``, ``empty``,
  or by a ``full_like`` that only takes its input's shape) are dropped;
- *layout* ops (:data:`.ops.LAYOUT_OPS`: reshape, transpose, split, concat, cast, dropout,
  gather, ...) and elementwise ops whose other operands are constants or buffers (``x + eps``,
  ``where(causal_mask, scores, fill)``) are contracted: their consumers are wired straight to
  their producers. This is what lets one view serve MHA and GQA (head repetition is layout),
  KV-cache concatenation, partial rotary and fused-qkv splits;
- values from outside the layer become ``input`` nodes, parameters ``param`` nodes.

A :class:`Matcher` finds the layer patterns (:func:`.patterns.layer_patterns`: embedding, norm,
linear) in views: :meth:`Matcher.match_view` only when a pattern's compute ops are in one-to-one
correspondence with *all* of the view's (same op histogram, then a ``DiGraphMatcher``
monomorphism), :meth:`Matcher.find` anywhere inside a larger view.

Example::

    >>> matcher = Matcher()
    >>> match = matcher.match_view(compute_view(graph, block_nodes(graph, "model.norm")))  # doctest: +SKIP
    >>> match.pattern.kind                                                                 # doctest: +SKIP
    'rms_norm'
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Iterable, Sequence

import networkx as nx
from networkx.algorithms.isomorphism import DiGraphMatcher

from autodist.planner.graph import operand_sources
from autodist.planner.ops import ELEMENTWISE_OPS, INPUT_OPS, LAYOUT_OPS, PARAM, SHAPE_ONLY_OPS, SHAPE_OPS, short_op
from autodist.planner.recognise.patterns import PORT, Pattern, compute_histogram, layer_patterns


def constant_nodes(graph: nx.DiGraph) -> frozenset[int]:
    """Nodes computed from folded constants alone (no data, no parameter upstream); computed
    once per graph."""
    if graph not in _CONSTANTS:
        _CONSTANTS[graph] = _find_constants(graph)
    return _CONSTANTS[graph]


_CONSTANTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_BY_LAYER: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _find_constants(graph: nx.DiGraph) -> frozenset[int]:
    constants: set[int] = set()
    for node in nx.topological_sort(graph):
        op = short_op(graph.nodes[node]["op"])
        if op == PARAM or op in INPUT_OPS:
            continue
        if op in SHAPE_ONLY_OPS or all(p in constants for p in graph.predecessors(node)):
            constants.add(node)
    return frozenset(constants)


def plain_nodes(graph: nx.DiGraph) -> frozenset[int]:
    """Nodes computed from constants and buffers alone: no model input and no trainable parameter
    upstream (but through its shape, which is a Python int when the model runs). apply_plan
    makes the inputs and parameters distributed tensors and leaves buffers alone, so these
    values stay plain tensors on every rank (a rotary table from ``arange`` and an ``inv_freq``
    buffer), whatever op computes them.

    >>> g = nx.DiGraph()
    >>> g.add_nodes_from([(0, dict(op="builtin.parameter", param=None)), (1, dict(op="pd_op.arange", param=None)),
    ...                   (2, dict(op="pd_op.einsum", param=None)), (3, dict(op="pd_op.data", param=None)),
    ...                   (4, dict(op="pd_op.einsum", param=None))])
    >>> g.add_edges_from([(0, 2), (1, 2), (3, 4), (0, 4)])
    >>> sorted(plain_nodes(g))
    [0, 1, 2]
    """
    plain: set[int] = set()
    for node in nx.topological_sort(graph):
        data = graph.nodes[node]
        op = short_op(data["op"])
        if op in INPUT_OPS or (op == PARAM and data["param"] is not None):
            continue
        if op in SHAPE_OPS or all(p in plain for p in graph.predecessors(node)):
            plain.add(node)
    return frozenset(plain)


def block_nodes(graph: nx.DiGraph, layer: str) -> frozenset[int]:
    """Graph nodes run by ``layer`` or one of its sub-layers (parameters excluded: they live at
    the program's top whoever uses them)."""
    if graph not in _BY_LAYER:
        by_layer: dict[str, list[int]] = {}
        for n, d in graph.nodes(data=True):
            if d["op"] != "builtin.parameter":
                by_layer.setdefault(d["layer"], []).append(n)
        _BY_LAYER[graph] = by_layer
    prefix = layer + "." if layer else ""
    return frozenset(
        n for name, nodes in _BY_LAYER[graph].items() if name == layer or name.startswith(prefix) for n in nodes
    )


def _is_buffer(graph: nx.DiGraph, node: int) -> bool:
    data = graph.nodes[node]
    return data["op"] == "builtin.parameter" and data["param"] is None


def _is_transparent(graph: nx.DiGraph, node: int, constants: frozenset[int]) -> bool:
    data = graph.nodes[node]
    op = short_op(data["op"])
    if op in LAYOUT_OPS or data["op"] in LAYOUT_OPS:
        return True
    if op in ELEMENTWISE_OPS:
        # buffers (non-trainable tensors such as an embedding scale) count as constants here
        live = [p for p in graph.predecessors(node) if p not in constants and not _is_buffer(graph, p)]
        has_constant = bool(data["consts"]) or len(live) < graph.in_degree(node)
        return len(live) == 1 and has_constant
    return False


def compute_view(graph: nx.DiGraph, nodes: Iterable[int], constants: frozenset[int] | None = None) -> nx.DiGraph:
    """The block's compute view (module docstring). Node ids are the graph's; node attributes
    ``op`` (short name, ``param`` or ``input``), ``shape`` (first result) and ``param`` (FQN or
    None); edge attribute ``operands``: the set of operand slots of the target the value reaches."""
    constants = constant_nodes(graph) if constants is None else constants
    members = frozenset(nodes) - constants
    view = nx.DiGraph()
    sources_cache: dict[int, frozenset[int]] = {}

    def sources(node: int) -> frozenset[int]:
        """The view nodes whose value flows into ``node``'s result through layout ops only."""
        if node in constants:
            return frozenset()
        if node not in members or not _is_transparent(graph, node, constants):
            return frozenset({node})
        if node not in sources_cache:
            sources_cache[node] = frozenset().union(*(sources(p) for p in graph.predecessors(node)))
        return sources_cache[node]

    def add_node(node: int) -> None:
        if node in view:
            return
        data = graph.nodes[node]
        op = short_op(data["op"])
        if (node not in members and op != PARAM) or op in INPUT_OPS:
            op = "input"
        shapes = data["shapes"] or [None]
        view.add_node(node, op=op, shape=shapes[0], param=data["param"])

    for node in sorted(members):
        if _is_transparent(graph, node, constants):
            continue
        add_node(node)
        for operand, (pred, _) in operand_sources(graph, node).items():
            for source in sources(pred):
                add_node(source)
                if view.has_edge(source, node):
                    view.edges[source, node]["operands"].add(operand)
                else:
                    view.add_edge(source, node, operands={operand})
    return view


def _node_match(view_attrs: dict, pattern_attrs: dict) -> bool:
    op = pattern_attrs["op"]
    if op == PORT:
        return view_attrs["op"] in ("input", PARAM)
    if op == PARAM:
        return view_attrs["op"] == PARAM and view_attrs["param"] is not None
    return view_attrs["op"] == op


def _edge_match(view_attrs: dict, pattern_attrs: dict) -> bool:
    return "operand" not in pattern_attrs or pattern_attrs["operand"] in view_attrs["operands"]


@dataclass(frozen=True)
class Match:
    """A pattern and the injection of its nodes into a view (pattern node -> graph node id)."""

    pattern: Pattern
    mapping: dict[str, int]

    def nodes_where(self, **attrs) -> list[tuple[str, int]]:
        """``(pattern node, graph node)`` pairs whose pattern attributes include ``attrs``."""
        graph = self.pattern.graph
        return [
            (p, g) for p, g in sorted(self.mapping.items()) if all(graph.nodes[p].get(k) == v for k, v in attrs.items())
        ]


@dataclass
class Matcher:
    """Runs full-coverage matches; ``calls`` counts isomorphism searches actually started."""

    patterns: Sequence[Pattern] = field(default_factory=layer_patterns)
    calls: int = 0

    def match_view(self, view: nx.DiGraph, patterns: Sequence[Pattern] | None = None) -> Match | None:
        """The first pattern covering every compute node of ``view``, or None."""
        histogram = compute_histogram(view)
        for pattern in self.patterns if patterns is None else patterns:
            if pattern.histogram != histogram:
                continue
            self.calls += 1
            matcher = DiGraphMatcher(view, pattern.graph, node_match=_node_match, edge_match=_edge_match)
            for mapping in matcher.subgraph_monomorphisms_iter():
                return Match(pattern, {p: v for v, p in mapping.items()})
        return None

    def find(self, view: nx.DiGraph, pattern: Pattern) -> list[Match]:
        """Every place ``pattern`` occurs in ``view``, *without* full coverage: for locating one
        projection inside a layer that does more (a model's top level computing its logits)."""
        self.calls += 1
        matcher = DiGraphMatcher(view, pattern.graph, node_match=_node_match, edge_match=_edge_match)
        return [Match(pattern, {p: v for v, p in m.items()}) for m in matcher.subgraph_monomorphisms_iter()]
