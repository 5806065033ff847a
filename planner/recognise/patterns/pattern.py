"""A :class:`Pattern` is a named graph for the matcher, built on demand from parts.

Example::

    >>> from autodist.planner.recognise.patterns.norm import LAYER_NORM
    >>> part_pattern(LAYER_NORM).histogram
    Counter({'layer_norm': 1})
"""

from __future__ import annotations

import functools
from collections import Counter
from dataclasses import dataclass
from typing import Callable

import networkx as nx

from autodist.planner.recognise.patterns.parts import PARAM, PORT, Part, PatternBuilder


@dataclass(frozen=True)
class Pattern:
    """A pattern for the matcher: ``build`` adds its parts to a :class:`PatternBuilder`.
    ``histogram`` counts its compute ops (everything but ports and parameters), the cheap
    necessary condition checked before any search; ``graph`` is built only when needed."""

    kind: str
    description: str
    build: Callable[[PatternBuilder], object]

    @functools.cached_property
    def histogram(self) -> Counter:
        dry_run = PatternBuilder(graph=None)
        self.build(dry_run)
        return dry_run.histogram

    @functools.cached_property
    def graph(self) -> nx.DiGraph:
        builder = PatternBuilder()
        self.build(builder)
        return builder.graph


def compute_histogram(graph: nx.DiGraph) -> Counter:
    """``Counter`` of op names over the compute nodes of a pattern or view graph."""
    return Counter(d["op"] for _, d in graph.nodes(data=True) if d["op"] not in (PORT, PARAM, "input"))


def part_pattern(part: Part) -> Pattern:
    """A single part alone (a norm layer, ...), its inputs as ports."""
    return Pattern(part.name, part.name, lambda b: b.add(part, part.name, **{n: b.port(n) for n in part.inputs}))
