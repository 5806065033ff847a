"""Ops in the traced graph that crash Paddle 3.3.1 when they run on distributed tensors.

apply_plan makes a model's inputs and parameters distributed tensors, so every op downstream of
them runs on DistTensors, replicated or split alike, unless its sub-layer runs as a local view
(on plain tensors, :mod:`autodist.planner.local_view_proof`). Values computed from constants and
buffers alone stay plain (:func:`~autodist.planner.recognise.match.plain_nodes`).

- A zero-width ``slice`` (``q[..., rotary_dim:]`` at ``rotary_dim == head_dim``, Phi-3's and
  Persimmon's partial rotary at factor 1): its backward segfaults in ``slice_grad`` on every
  rank (docs/paddle-notes.md, "The backward of a zero-width slice of a DistTensor segfaults");
  the driver refuses the model (:func:`distributed_crashes`).
- An op Paddle 3.3 does not run on DistTensors at all (:func:`autodist.planner.ops.local_only_use`:
  ``einsum``, a read through a boolean mask ``x[mask]``): a plan trains only where it runs on local
  tensors, inside a local view or an MoE layer the plan runs locally; the search refuses the
  other strategies (:func:`local_only_ops`, read through the cost model).

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
from typing import Iterable, Iterator

import networkx as nx

from autodist.schemas.einsum import einsum_permutation

from autodist.planner.graph import operand_sources
from autodist.planner.ops import local_only_use, op
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


def local_only_ops(graph: nx.DiGraph, moe_layers: Iterable[str], local: Iterable[str] = ()) -> dict[str, str]:
    """The first op Paddle cannot run on distributed tensors outside the ``moe_layers``, and the
    first inside one (the cost model's ``ModelCost.local_only`` and ``local_only_in_moe``), in the
    words of a refusal (``"einsum in layers.0.attn"``), the first with how to write it instead
    (``local_only_rewrite``: no plan runs it) and its layer (``local_only_layer``). One computing on constants and buffers
    alone (a rotary table, ``einsum("i,j->ij", arange(seq), self.inv_freq)``) never sees a
    distributed tensor: it is not counted, nor is one inside a sub-layer of ``local``, which runs
    on plain tensors (a local view), nor an einsum that only reorders its operand's dims (DiT's
    ``unpatchify``), which the applier runs on local values wherever it is (:mod:`autodist.schemas.einsum`).

    >>> g = nx.MultiDiGraph()
    >>> g.add_node(0, op="pd_op.data", param=None, layer="", attrs={})
    >>> g.add_node(1, op="pd_op.nonzero", param=None, layer="moe", attrs={})
    >>> g.add_node(2, op="pd_op.gather_nd", param=None, layer="moe", attrs={})
    >>> _ = [g.add_edge(0, 1, operand=0, result=0), g.add_edge(0, 2, operand=0, result=0), g.add_edge(1, 2, operand=1, result=0)]
    >>> local_only_ops(g, ["moe"])["local_only_in_moe"]
    "x[mask] (gather_nd of a boolean mask's positions) in moe"
    """
    moe_prefixes = tuple(layer + "." for layer in moe_layers)
    found: dict[str, str] = {}
    for layer, what, rewrite in _local_only_uses(graph, local):
        field_name = "local_only_in_moe" if (layer + ".").startswith(moe_prefixes) else "local_only"
        if field_name in found:
            continue
        where = layer or "the model's top level (its own forward)"  # the root layer's name is ''
        found[field_name] = f"{what} in {where}"
        if field_name == "local_only":  # no plan runs it: the refusal's advice, and where
            found["local_only_rewrite"] = rewrite
            found["local_only_layer"] = layer
    return found


def local_only_layers(graph: nx.DiGraph) -> set[str]:
    """The layers running an op of their own that Paddle cannot run on distributed tensors (those
    :func:`local_only_ops` counts): where a layer holding batched experts is found
    (:func:`~autodist.planner.recognise.expert_blocks.batched_experts`)."""
    return {layer for layer, _, _ in _local_only_uses(graph, ())}


def _local_only_uses(graph: nx.DiGraph, local: Iterable[str]) -> Iterator[tuple[str, str, str]]:
    """``(layer, what, rewrite)`` of each op of ``graph`` Paddle cannot run on distributed tensors,
    in program order, outside the sub-layers of ``local`` (:func:`local_only_ops` says which count)."""
    views = tuple(layer + "." for layer in local)
    plain = plain_nodes(graph)
    for node, data in sorted(graph.nodes(data=True)):
        if node in plain or (data["layer"] + ".").startswith(views) or _reorders(data):
            continue
        sources = operand_sources(graph, node)
        operands = {slot: graph.nodes[source]["op"] for slot, (source, _) in sources.items()}
        what, rewrite = local_only_use(data["op"], operands), op(data["op"]).rewrite
        if not what and _indexed_by_a_distributed_value(data, sources, plain):
            what, rewrite = "x[i] (a slice at a position computed from the model's data)", INDEX_REWRITE
        if what:
            yield data["layer"], what, rewrite


#: How to write a slice at a computed position (:func:`_indexed_by_a_distributed_value`) so that
#: the model trains: experts held as numbered layers, or as one layer's batched weights under the
#: layer routing to them (GPT-OSS's), form an MoE layer, which runs on local tensors.
INDEX_REWRITE = (
    "hold the experts as numbered layers (a LayerList of MLPs, as Mixtral's) or as batched weights in a "
    "layer of their own under a router layer, whose loop the planner runs on local tensors as an MoE layer"
)


def _indexed_by_a_distributed_value(data: dict, sources: dict, plain: frozenset[int]) -> bool:
    """The node is a ``slice`` whose start or end (operands 1 and 2; constants are folded, not
    operands) is computed from the model's inputs or parameters: an eager ``x[t]`` with ``t`` a
    tensor (GPT-OSS's ``expert_mask[expert_idx]``, ``expert_idx`` a row of ``nonzero``), which
    Paddle 3.3 refuses on distributed tensors (``Tensor in indexing only support DenseTensor``). A
    position read from a shape is plain (a Python int when the model runs)."""
    return short_op(data["op"]) == "slice" and any(
        slot in (1, 2) and source not in plain for slot, (source, _) in sources.items()
    )


def _reorders(data: dict) -> bool:
    """The node is an einsum that only reorders its operand's dims (run on local values)."""
    return short_op(data["op"]) == "einsum" and einsum_permutation(data["attrs"].get("equation", "")) is not None
