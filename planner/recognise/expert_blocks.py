"""The experts of an MoE block: the layers expert parallelism spreads over data-parallel ranks.

A block holds experts when two or more of its recognised MLPs (:mod:`.roles`) are the numbered
children of one container (an MoE's ``LayerList``: ``experts.0``, ``experts.1``, ...; or a
``LayerDict``'s ``experts.expert_0``, ...) and its
MoE layer (the container's parent) routes tokens to them. How many experts there are comes from
the parameters (every numbered child, recognised or not); to how many each token goes
(``top_k``), from the MoE layer's *selections over the expert axis*, however the router spells
them: each ``topk`` over an axis as long as the expert count picks k experts (Mixtral, Qwen3-MoE),
each ``argmax`` over it picks one (GShard's and Switch's gates: ``argmax`` for the first expert,
``argmax`` again with it masked out for the second). A selection over another axis is not
routing (DeepSpeed's random token selection takes ``topk`` over the token axis to fill each
expert's capacity), and neither is a selection that only re-reads an earlier one (Switch
Transformers takes the ``argmax`` of its one-hot router mask again: no path from the scores
reaches it but through the first ``argmax``), nor a ``topk`` whose indices nothing reads
(DeepSeek-V3 sums each expert group's top-2 scores to pick groups; with one group that ``topk``
runs over every expert).

A recognised MLP under the MoE layer but outside the container is a *shared expert* (Qwen2-MoE's
``shared_expert``, DeepSeek's ``shared_experts``): every token goes through it, beside the
routed ones, and its output is added to theirs.

Example::

    >>> from autodist.planner.recognise.roles import Projection
    >>> rows = [f"layers.0.moe.experts.{i}.w2" for i in range(2)]
    >>> mlps = [SubLayer("mlp", (), Projection(row, f"{row}.weight", None, "row", 0)) for row in rows]
    >>> params = {f"layers.0.moe.experts.{i}.w2.weight": ([8, 4], "float32") for i in range(4)}
    >>> shared = Projection("layers.0.moe.shared_expert.down", "layers.0.moe.shared_expert.down.weight", None, "row", 0)
    >>> experts_of("layers.0", [*mlps, SubLayer("mlp", (), shared)], params, top_k=2)
    Experts(layer='layers.0.moe.experts', count=4, top_k=2, shared=('layers.0.moe.shared_expert',), batched=False)
"""

from __future__ import annotations

import os
from collections.abc import Collection
from dataclasses import dataclass, replace

import networkx as nx

from autodist.schemas.vocabulary import expert_number

from autodist.planner.ops import SELECTION_OPS, short_op
from autodist.planner.recognise.roles import SubLayer


@dataclass(frozen=True)
class Experts:
    """The container of a block's experts (``layers.0.block_sparse_moe.experts``), how many
    experts it holds, to how many of them the router sends each token, and the shared experts
    beside them (the layers of MLPs under the same MoE layer, outside the container)."""

    layer: str
    count: int
    top_k: int
    shared: tuple[str, ...] = ()
    #: The experts are one layer's batched weights (:func:`batched_experts`), not numbered layers:
    #: their MoE layer runs on local tensors, whole on every rank; no rank can drop some of them,
    #: so expert parallelism does not spread them.
    batched: bool = False

    @property
    def moe_layer(self) -> str:
        """The MoE layer: the container's parent, which routes the tokens to the experts
        (``layers.0.block_sparse_moe`` for ``layers.0.block_sparse_moe.experts``)."""
        return self.layer.rpartition(".")[0]

    def routes(self, fqn: str) -> bool:
        """Whether ``fqn`` belongs to the MoE layer's routing: under the MoE layer (the experts'
        parent), outside the experts and the shared experts (the router, Qwen2-MoE's shared-expert
        gate, DeepSeek's score-correction bias). Whole on every rank by design: each token's
        top-k needs all its scores.

        >>> moe = Experts("layers.0.moe.experts", 4, 2, shared=("layers.0.moe.shared",))
        >>> [moe.routes(f) for f in ("layers.0.moe.gate.weight", "layers.0.moe.experts.1.w1.weight",
        ...                          "layers.0.moe.shared.up.weight", "layers.0.attn.q.weight")]
        [True, False, False, False]
        """
        inside = (self.layer, *self.shared)
        return fqn.startswith(self.moe_layer + ".") and not any(fqn.startswith(f"{layer}.") for layer in inside)


def find_experts(
    graph: nx.DiGraph,
    nodes: frozenset[int],
    layer: str,
    sublayers: list[SubLayer],
    params: dict[str, tuple[list[int], str]],
    local_only: Collection[str] = (),
) -> Experts | None:
    """The experts of block ``layer`` (module docstring), or None: numbered layers, else a layer's
    batched weights (:func:`batched_experts`; ``local_only``: the layers running an op Paddle
    cannot run on distributed tensors, in either traced mode)."""
    found = experts_of(layer, sublayers, params, top_k=0)
    if found is None:
        return batched_experts(graph, nodes, layer, sublayers, params, local_only)
    top_k = experts_per_token(graph, nodes, found.layer.rpartition(".")[0], found.count)
    return replace(found, top_k=top_k) if top_k > 0 else None


def batched_experts(
    graph: nx.DiGraph,
    nodes: frozenset[int],
    layer: str,
    sublayers: list[SubLayer],
    params: dict[str, tuple[list[int], str]],
    local_only: Collection[str],
) -> Experts | None:
    """The experts of block ``layer`` held as one layer's batched weights (HF's and PaddleFormers'
    GPT-OSS: ``gate_up_proj [E, H, 2I]``, ``down_proj [E, I, H]`` and their biases ``[E, ...]``,
    read by a loop over the experts that got tokens, ``self.gate_up_proj[expert_idx]``), found by
    dataflow: a layer under the block that runs an op Paddle cannot run on distributed tensors
    (``local_only``), none of whose parameters the plan splits (no projection of the block's
    sub-layers), every one of them of two or more dims with one leading dim, ``E``, the experts;
    and its parent routes each token to some of ``E`` (a selection over an axis of ``E`` entries,
    :func:`experts_per_token`). That parent is the MoE layer: apply_plan runs it on local tensors,
    whole on every rank, as it runs any MoE layer holding such an op (``runs_moe_locally``).

    >>> g = nx.DiGraph()
    >>> def op(n, name, shapes, inputs=(), **data):  # ops of the router, b.0.moe.gate
    ...     base = {"op": f"pd_op.{name}", "layer": "b.0.moe.gate", "param": None, "attrs": {}, "consts": {}}
    ...     g.add_node(n, **{**base, "shapes": shapes, **data})
    ...     g.add_edges_from([(i, n) for i in inputs], operand=0, result=0)
    >>> op(0, "parameter", [[8, 3]], param="b.0.moe.gate.weight")
    >>> op(1, "matmul", [[16, 3]], [0])  # the router's scores over 3 experts
    >>> op(2, "topk", [[16, 2], [16, 2]], [1], attrs={"axis": -1}, consts={1: 2.0})
    >>> op(3, "put_along_axis", [[16, 3]])
    >>> g.add_edge(2, 3, operand=1, result=1)  # its indices used
    >>> params = {"b.0.moe.gate.weight": ([8, 3], "float32"), "b.0.moe.experts.up": ([3, 8, 4], "float32"),
    ...           "b.0.moe.experts.up_bias": ([3, 4], "float32")}
    >>> batched_experts(g, frozenset(g), "b.0", [], params, {"b.0.moe.experts"})
    Experts(layer='b.0.moe.experts', count=3, top_k=2, shared=(), batched=True)
    """
    split = {p for sub in sublayers for lin in sub.projections for p in (lin.weight, lin.bias) if p}
    for candidate in sorted(local_only):
        if not candidate.startswith(layer + "."):
            continue
        own = [(fqn, shape) for fqn, (shape, _) in params.items() if fqn.startswith(candidate + ".")]
        experts = {shape[0] if len(shape) > 1 else 0 for _, shape in own}
        if not own or split & {fqn for fqn, _ in own} or len(experts) != 1 or experts == {0}:
            continue
        count = experts.pop()
        moe_layer = candidate.rpartition(".")[0]
        top_k = experts_per_token(graph, nodes, moe_layer, count) if moe_layer.startswith(layer + ".") else 0
        if top_k:
            return Experts(candidate, count, top_k, batched=True)
    return None


def experts_per_token(graph: nx.DiGraph, nodes: frozenset[int], moe_layer: str, count: int) -> int:
    """How many of ``count`` experts each token is routed to: the selections over an axis of
    ``count`` entries made by the ops of ``moe_layer`` (k for a ``topk``, 1 for an ``argmax``).

    >>> g = nx.DiGraph()
    >>> def op(n, name, shapes, inputs=(), **data):
    ...     base = {"op": f"pd_op.{name}", "layer": "moe.gate", "param": None, "attrs": {}, "consts": {}}
    ...     g.add_node(n, **{**base, "shapes": shapes, **data})
    ...     g.add_edges_from([(i, n) for i in inputs], operand=0, result=0)
    >>> op(0, "parameter", [[8, 4]], param="moe.gate.weight")
    >>> op(1, "matmul", [[16, 4]], [0])  # the router's scores
    >>> op(2, "argmax", [[16]], [1], consts={1: 1.0})  # the first expert
    >>> op(3, "one_hot", [[16, 4]], [2])
    >>> op(4, "argmax", [[16]], [3], consts={1: 1.0})  # the same choice read back from its mask
    >>> experts_per_token(g, frozenset(g), "moe", 4)
    1
    >>> op(5, "where", [[16, 4]], [1, 3])  # the scores with the first expert masked out
    >>> op(6, "argmax", [[16]], [5], consts={1: 1.0})  # the second expert (GShard)
    >>> experts_per_token(g, frozenset(g), "moe", 4)
    2
    >>> op(7, "topk", [[2, 4], [2, 4]], [1], attrs={"axis": 0}, consts={1: 2.0})  # 2 tokens per expert
    >>> op(8, "put_along_axis", [[16, 4]])
    >>> g.add_edge(7, 8, operand=1, result=1)  # its indices used
    >>> experts_per_token(g, frozenset(g), "moe", 4)  # a capacity, not routing
    2
    >>> op(9, "topk", [[16, 2], [16, 2]], [1], attrs={"axis": -1}, consts={1: 2.0})
    >>> op(10, "sum", [[16]], [9])  # the top-2 scores summed: a group's score, no expert chosen
    >>> experts_per_token(g, frozenset(g), "moe", 4)
    2
    """
    # The MoE layer's ops, or its callers' when it is run as ``layer.forward(x)`` (Mistral's
    # reference code), which passes by the forward hooks the trace attributes ops with.
    selections = {
        n
        for n in nodes
        if short_op(graph.nodes[n]["op"]) in SELECTION_OPS and _inside_or_above(graph.nodes[n]["layer"], moe_layer)
    }
    picked = 0
    for node in sorted(selections):
        data = graph.nodes[node]
        op = short_op(data["op"])
        if not _reads_scores(graph, nodes, node, selections):
            continue  # it re-reads a choice made before (Switch's argmax of the one-hot router mask)
        if op == "topk" and not any(e["result"] == 1 for _, _, e in graph.out_edges(node, data=True)):
            continue  # only its values are used (DeepSeek-V3's top-2 scores summed per expert group)
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


def _inside_or_above(layer: str, moe_layer: str) -> bool:
    """Whether an op of ``layer`` may be the MoE layer's: ``layer`` is it, inside it, or one of its
    parents."""
    return (layer + ".").startswith(moe_layer + ".") or (moe_layer + ".").startswith(layer + ".")


def _reads_scores(graph: nx.DiGraph, nodes: frozenset[int], selection: int, selections: set[int]) -> bool:
    """Whether ``selection`` chooses among scores rather than re-reading an earlier choice: some
    path into it reaches a parameter or the block's input without passing another selection."""
    seen, todo = set(), [selection]
    while todo:
        for producer in graph.predecessors(todo.pop()):
            if producer in seen or producer in selections:
                continue
            if producer not in nodes or graph.nodes[producer]["param"] is not None:
                return True
            seen.add(producer)
            todo.append(producer)
    return False


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
    moe_layer = container.rpartition(".")[0]
    shared = {
        _mlp_layer(sub)
        for sub in sublayers
        if sub.kind == "mlp"
        and sub.row.layer.startswith(moe_layer + ".")
        and not sub.row.layer.startswith(container + ".")
    }
    return Experts(container, sum(1 for i in indices if expert_number(i) is not None), top_k, tuple(sorted(shared)))


def _mlp_layer(sub: SubLayer) -> str:
    """The layer holding an MLP: its projections' common parent (``...shared_expert`` for
    ``...shared_expert.gate_proj`` / ``.up_proj`` / ``.down_proj``)."""
    return ".".join(os.path.commonprefix([p.layer.rpartition(".")[0].split(".") for p in sub.projections]))


def _numbered_owner(fqn: str, layer: str) -> tuple[str, str]:
    """``("layers.0.moe.experts", "3")`` for ``layers.0.moe.experts.3.w2`` inside ``layers.0``:
    the innermost numbered component below the block, above the projection itself (``w2`` is
    no expert number); ``("", "")`` if there is none.

    >>> _numbered_owner("block.1.layer.1.mlp.experts.expert_2.wo", "block.1")
    ('block.1.layer.1.mlp.experts', 'expert_2')
    """
    parts = fqn[len(layer) + 1 :].split(".") if fqn.startswith(layer + ".") else []
    for i in range(len(parts) - 2, -1, -1):
        if expert_number(parts[i]) is not None:
            return ".".join([layer, *parts[:i]]), parts[i]
    return "", ""
