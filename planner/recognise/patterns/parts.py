"""Building blocks of the pattern library: a :class:`Part` is a small graph of ops written as
data, and a :class:`PatternBuilder` glues parts into one pattern graph by binding each part's
input ports to nodes already built.

Pattern graphs use the same vocabulary as the matcher's *compute view* of a block
(:func:`autodist.planner.recognise.match.compute_view`): a node's ``op`` is a short Paddle op name
(``"matmul"``, ``"softmax"``), :data:`PARAM` for a trainable parameter, or :data:`PORT` for a
value that comes from outside the pattern (a block input, a mask, a RoPE table). Layout ops
(reshape, transpose, split, cast, scale, ...) never appear: the view contracts them.

Example::

    >>> b = PatternBuilder()
    >>> x = b.port("x")
    >>> out = b.add(linear("fc", "column"), "mlp.fc", x=x)
    >>> sorted(b.graph.nodes[n]["op"] for n in b.graph)
    ['matmul', 'param', 'port']
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Mapping

import networkx as nx

from autodist.planner.ops import PARAM  # a pattern node for a trainable parameter (the view's, with an FQN)

#: Pattern node op for a value produced outside the pattern.
PORT = "port"


@dataclass(frozen=True)
class Part:
    """A small op graph: ``nodes`` maps a local name to its op (or to a dict of node attributes
    with at least ``op``); ``edges`` are ``(source, target)`` or ``(source, target, operand)``
    tuples, a source may be one of ``inputs`` (ports bound at composition), and ``operand`` pins
    which operand of the target the value feeds (``x`` vs ``weight`` of a matmul, ``q`` vs ``k``
    of the scores); ``output`` names the node whose value the part produces."""

    name: str
    nodes: Mapping[str, str | Mapping[str, object]]
    edges: tuple[tuple, ...]
    inputs: tuple[str, ...]
    output: str


@dataclass
class PatternBuilder:
    """Accumulates parts into one ``networkx.DiGraph``; node ids are ``"<prefix>.<local>"``.
    ``histogram`` counts the compute ops added; with ``graph=None`` only that is kept, a cheap
    dry run the matcher uses to rule patterns out before building them."""

    graph: nx.DiGraph | None = field(default_factory=nx.DiGraph)
    histogram: Counter = field(default_factory=Counter)

    def port(self, name: str) -> str:
        """A value from outside the pattern (matches a block input or a non-trainable tensor)."""
        if self.graph is not None:
            self.graph.add_node(name, op=PORT)
        return name

    def add(self, part: Part, prefix: str, **bindings: str) -> str:
        """Add ``part`` with its input ports bound to existing nodes; returns its output's id."""
        missing = set(part.inputs) - set(bindings)
        if missing:
            raise ValueError(f"part {part.name!r} at {prefix!r}: unbound inputs {sorted(missing)}")
        for local, spec in part.nodes.items():
            attrs = {"op": spec} if isinstance(spec, str) else dict(spec)
            if attrs["op"] not in (PARAM, PORT):
                self.histogram[attrs["op"]] += 1
            if self.graph is not None:
                self.graph.add_node(f"{prefix}.{local}", part=part.name, **attrs)

        def resolve(name: str) -> str:
            return bindings[name] if name in part.inputs else f"{prefix}.{name}"

        graph = self.graph
        if graph is not None:
            for source, target, *operand in part.edges:
                attrs = {"operand": operand[0]} if operand else {}
                graph.add_edge(resolve(source), resolve(target), **attrs)
        return resolve(part.output)


def linear(name: str, role: str, bias: bool = False, fused: int = 1) -> Part:
    """``x @ W (+ b)``; the weight node carries the linear's ``name``, its tensor-parallel
    ``role`` (``column`` / ``row``) and how many projections are ``fused`` into it."""
    weight = {"op": PARAM, "linear": name, "role": role, "fused": fused}
    nodes: dict[str, str | Mapping[str, object]] = {"matmul": {"op": "matmul", "linear": name}, "weight": weight}
    edges: list[tuple] = [("x", "matmul", 0), ("weight", "matmul", 1)]
    output = "matmul"
    if bias:
        nodes.update(bias={"op": PARAM, "bias_of": name}, add="add")
        edges += [("matmul", "add"), ("bias", "add")]
        output = "add"
    return Part(f"linear_{name}", nodes, tuple(edges), ("x",), output)
