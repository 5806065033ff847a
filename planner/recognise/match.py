"""Find which pattern each repeated block of the traced graph is, with full coverage only.

A block (``model.layers.3``) is the set of graph nodes whose layer is that FQN or inside it. The
matcher does not compare that raw node set with patterns: it first builds the block's *compute
view* (:func:`compute_view`):

- constant subgraphs (ops fed by nothing but folded constants: ``arange``, ``tril``, ``empty``,
  or by a ``full_like`` that only takes its input's shape) are dropped;
- *layout* ops (reshape, transpose, split, concat, cast, scale, gather, ...) and elementwise ops
  with a constant second operand (``x + eps``) are contracted: their consumers are wired straight
  to their producers. This is what lets one attention pattern serve MHA and GQA (head repetition
  is unsqueeze/expand/reshape), KV-cache concatenation, partial rotary and fused-qkv splits;
- values from outside the block become ``input`` nodes, parameters ``param`` nodes.

A pattern matches a block only if its compute ops are in one-to-one correspondence with *all*
of the view's compute ops (same op histogram, then a ``DiGraphMatcher`` monomorphism); a pattern
that covers part of a block is no match. Blocks whose views have the same Weisfeiler-Lehman
hash reuse the first block's match through a canonical node order, so the number of
isomorphism searches grows with the number of distinct block kinds, not with depth
(:attr:`Matcher.calls` counts them).

Example::

    >>> matcher = Matcher()
    >>> matches = matcher.match_blocks(graph, ["model.layers.0", "model.layers.1"])  # doctest: +SKIP
    >>> matches[0].pattern.kind, matcher.calls                                       # doctest: +SKIP
    ('llama_decoder', 1)
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Iterable, Sequence

import networkx as nx
from networkx.algorithms.isomorphism import DiGraphMatcher

from autodist.planner.recognise.patterns import PARAM, PORT, Pattern, block_patterns, compute_histogram

#: Ops that move, reshape, pick or re-type data without computing on it.
LAYOUT_OPS = frozenset({
    "reshape", "transpose", "unsqueeze", "squeeze", "expand", "expand_as", "broadcast_to", "tile",
    "flatten", "cast", "scale", "assign", "contiguous", "full_like", "slice", "strided_slice", "concat",
    "stack", "split", "split_with_num", "unbind", "gather", "gather_nd", "index_select", "combine",
    "builtin.combine", "builtin.split", "builtin.slice",
})
#: Elementwise ops that are layout-like when all operands but one are constants (``x + eps``).
ELEMENTWISE_OPS = frozenset({"add", "subtract", "multiply", "divide", "maximum", "minimum"})
INPUT_OPS = frozenset({"data"})
#: Ops whose result depends on their input's shape only, never its values: constants for a
#: traced program with static shapes (``triu(full_like(scores))`` is a fixed causal mask).
SHAPE_ONLY_OPS = frozenset({"full_like", "zeros_like", "ones_like", "empty_like", "shape", "shape64"})


def short_op(op: str) -> str:
    """``pd_op.matmul`` -> ``matmul``; in-place ``add_`` -> ``add``; builtins keep their prefix,
    except ``builtin.parameter`` -> ``param``."""
    if op == "builtin.parameter":
        return PARAM
    if op.startswith("pd_op."):
        op = op[len("pd_op."):]
    return op.rstrip("_")


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
    return frozenset(n for name, nodes in _BY_LAYER[graph].items()
                     if name == layer or name.startswith(prefix) for n in nodes)


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
        for pred in graph.predecessors(node):
            operand = graph.edges[pred, node]["operand"]
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


def _canonical_order(view: nx.DiGraph) -> list[int]:
    """Nodes in an order two structurally equal blocks agree on: compute and parameter nodes by
    program position, inputs by (first consumer, operand) since their producers lie elsewhere."""
    def key(node: int) -> tuple:
        if view.nodes[node]["op"] != "input":
            return (0, node, 0)
        consumer = min(view.successors(node))
        return (1, consumer, min(view.edges[node, consumer]["operands"]))
    return sorted(view, key=key)


def _label(view: nx.DiGraph, node: int) -> str:
    data = view.nodes[node]
    return f"{data['op']}{data['shape']}"


@dataclass(frozen=True)
class Match:
    """A pattern and the injection of its nodes into a view (pattern node -> graph node id)."""

    pattern: Pattern
    mapping: dict[str, int]

    def nodes_where(self, **attrs) -> list[tuple[str, int]]:
        """``(pattern node, graph node)`` pairs whose pattern attributes include ``attrs``."""
        graph = self.pattern.graph
        return [(p, g) for p, g in sorted(self.mapping.items())
                if all(graph.nodes[p].get(k) == v for k, v in attrs.items())]


@dataclass(frozen=True)
class BlockMatch:
    """One block: its FQN, its graph nodes, its compute view and the match (None if none)."""

    layer: str
    nodes: frozenset[int]
    view: nx.DiGraph
    match: Match | None


@dataclass
class Matcher:
    """Runs full-coverage matches; ``calls`` counts isomorphism searches actually started."""

    patterns: Sequence[Pattern] = field(default_factory=block_patterns)
    calls: int = 0
    _by_hash: dict[str, tuple[nx.DiGraph, Match | None]] = field(default_factory=dict)

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

    def match_blocks(self, graph: nx.DiGraph, layers: Sequence[str]) -> list[BlockMatch]:
        """Match every block layer; structurally equal blocks are matched once."""
        constants = constant_nodes(graph)
        results = []
        for layer in layers:
            nodes = block_nodes(graph, layer)
            view = compute_view(graph, nodes, constants)
            results.append(BlockMatch(layer, nodes, view, self._match_cached(view)))
        return results

    def _match_cached(self, view: nx.DiGraph) -> Match | None:
        for node in view:
            view.nodes[node]["label"] = _label(view, node)
        key = nx.weisfeiler_lehman_graph_hash(view, node_attr="label", iterations=3)
        if key in self._by_hash:
            first_view, first = self._by_hash[key]
            moved = _transfer(first_view, view, first)
            if moved is not None or first is None:
                return moved
        found = self.match_view(view)
        self._by_hash.setdefault(key, (view, found))
        return found


def _transfer(source: nx.DiGraph, target: nx.DiGraph, found: Match | None) -> Match | None:
    """``found`` (a match in ``source``) moved onto the structurally equal ``target``; None if
    the canonical orders disagree (then the caller matches afresh)."""
    if found is None:
        return None
    order_s, order_t = _canonical_order(source), _canonical_order(target)
    if len(order_s) != len(order_t):
        return None
    node_map = dict(zip(order_s, order_t))
    if any(source.nodes[s]["label"] != target.nodes[t]["label"] for s, t in node_map.items()):
        return None
    if any(not target.has_edge(node_map[u], node_map[v]) for u, v in source.edges):
        return None
    return Match(found.pattern, {p: node_map[v] for p, v in found.mapping.items()})
