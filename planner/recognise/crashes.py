"""Ops in the traced graph that crash Paddle 3.3.1 when they run on distributed tensors.

apply_plan makes a model's inputs and parameters distributed tensors, so every op downstream of
them runs on DistTensors, replicated or split alike, unless its sub-layer runs as a local view
(on plain tensors, :mod:`autodist.planner.local_view_proof`). Values computed from constants and
buffers alone stay plain (:func:`~autodist.planner.recognise.match.plain_nodes`).

- A zero-width ``slice`` (``q[..., rotary_dim:]`` at ``rotary_dim == head_dim``, Phi-3's and
  Persimmon's partial rotary at factor 1): its backward segfaults in ``slice_grad`` on every
  rank (docs/paddle-notes.md, "The backward of a zero-width slice of a DistTensor segfaults").

Example::

    >>> import networkx as nx
    >>> g = nx.DiGraph()
    >>> g.add_node(0, op="pd_op.data", param=None, layer="", shapes=[[2, 8]])
    >>> g.add_node(1, op="pd_op.slice", param=None, layer="attn", shapes=[[2, 0]])
    >>> g.add_edge(0, 1)
    >>> [c.layer for c in distributed_crashes(g)]
    ['attn']
"""

from __future__ import annotations

from dataclasses import dataclass

import networkx as nx

from autodist.planner.recognise.match import plain_nodes, short_op


@dataclass(frozen=True)
class Crash:
    """An op of ``layer`` (graph node ``node``) that Paddle cannot run on distributed tensors."""

    node: int
    layer: str
    #: What the op does, in the model's words, and how to write it so that it runs.
    idiom: str
    rewrite: str


def distributed_crashes(graph: nx.DiGraph) -> list[Crash]:
    """Every op of ``graph`` that would crash on distributed tensors, in program order."""
    plain = plain_nodes(graph)
    found = []
    for node in sorted(graph.nodes):
        data = graph.nodes[node]
        if node in plain or short_op(data["op"]) != "slice":
            continue
        shape = (data["shapes"] or [None])[0]
        if shape and 0 in shape:
            found.append(
                Crash(
                    node,
                    data["layer"],
                    f"a zero-width slice ({list(shape)}), whose backward segfaults in Paddle 3.3.1's slice_grad "
                    "on distributed tensors",
                    "leave the empty part out (at partial_rotary_factor 1, rotate q and k whole instead of "
                    "concatenating q[..., rotary_dim:] back)",
                )
            )
    return found
