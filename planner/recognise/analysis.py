"""What the planner knows about a model after matching: its blocks, the tensor-parallel role of
every linear, the embedding, final norm and LM head, tied weights and what nothing matched.

Roles come from the pattern a block matched (:mod:`.patterns` marks each linear column or row);
split dims from how each weight reaches its matmul (a transposed use swaps them); sizes (heads,
KV heads, head dim, hidden, intermediate) from the traced shapes, never from config attributes.

Example::

    >>> traced = trace_model(model, specs)                      # doctest: +SKIP
    >>> analysis = analyze(traced, build_graph(traced), model)  # doctest: +SKIP
    >>> [(l.layer, l.role, l.split_dim) for l in analysis.blocks[0].linears][:2]   # doctest: +SKIP
    [('model.layers.0.self_attn.q_proj', 'column', 1), ('model.layers.0.self_attn.k_proj', 'column', 1)]
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import networkx as nx
import paddle

from autodist import schemas

from autodist.planner.graph import graph_fingerprint
from autodist.planner.recognise.match import BlockMatch, Match, Matcher, block_nodes, compute_view, constant_nodes, short_op
from autodist.planner.recognise.patterns import PARAM, layer_patterns
from autodist.planner.trace import TracedProgram

Role = Literal["column", "row", "replicate"]


@dataclass
class LinearUse:
    layer: str  # FQN of the owning layer, e.g. "llama.layers.0.self_attn.q_proj"
    weight: str  # parameter FQN
    bias: str | None
    role: Role
    split_dim: int | None  # weight dim split over mp for this role; None for replicate
    fused: int = 1  # fused segments: 3 for q|k|v, 2 for gate|up
    name: str = ""  # the pattern's name for it: q, k, v, qkv, o, gate, up, gate_up, down, fc_in, fc_out, lm_head


@dataclass
class BlockInfo:
    layer: str
    kind: str
    nodes: frozenset[int]
    linears: list[LinearUse]
    norms: list[str]
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    intermediate_size: int
    description: str = ""  # the matched pattern's parts, e.g. "rms_norm+attn(q|k|v,rope)+mlp(swiglu_op)"


@dataclass
class ModelAnalysis:
    class_name: str
    graph: nx.DiGraph
    traced_layer: str
    input_specs: list[schemas.InputSpec]
    params: dict[str, tuple[list[int], str]]
    tied: dict[str, list[str]]
    blocks: list[BlockInfo]
    embedding: str | None
    lm_head: LinearUse | None
    final_norm: list[str]
    vocab_size: int | None
    batch_size: int
    seq_len: int
    unmatched: list[str]
    notes: list[str]
    param_fingerprint: str
    graph_fingerprint: str
    block_matches: list[BlockMatch] = field(default_factory=list, repr=False)
    #: The model is a ``paddle.nn.Sequential``: a chain of stage modules Paddle's 1F1B / VPP run.
    sequential: bool = False


def analyze(traced: TracedProgram, graph: nx.DiGraph, model: paddle.nn.Layer, matcher: Matcher | None = None) -> ModelAnalysis:
    """Match ``model``'s blocks in ``graph`` and describe every parameter's role.

    Unmatched layers are listed (``unmatched`` and a note), never an error: a CNN gives zero
    blocks and a data-parallel-only plan.
    """
    matcher = matcher or Matcher()
    params = schemas.parameter_table(model.named_parameters())
    notes: list[str] = []
    block_matches = matcher.match_blocks(graph, [b for b in repeated_layers(model) if block_nodes(graph, b)])
    blocks = [_block_info(graph, m) for m in block_matches if m.match is not None]
    notes += [f"{m.layer}: no block pattern covers all its ops; its parameters stay replicated"
              for m in block_matches if m.match is None]
    in_blocks = frozenset().union(*(m.nodes for m in block_matches))
    outer = _outer_layers(graph, in_blocks)
    embedding, other_embeddings = _embeddings(graph, outer)
    vocab = params[embedding][0][0] if embedding else None
    notes += [f"{fqn}: embedding other than the token embedding, kept replicated" for fqn in other_embeddings]
    final_norm = [graph.nodes[g]["param"] for m in outer.values() for _, g in m.nodes_where(op=PARAM, norm=True)]
    lm_head = _lm_head(graph, outer, vocab, in_blocks) or _untraced_lm_head(model, traced, vocab)
    covered = {p for b in blocks for lin in b.linears for p in (lin.weight, lin.bias) if p}
    covered |= {p for b in blocks for p in b.norms} | set(final_norm) | set(other_embeddings)
    covered |= {embedding} if embedding else set()
    covered |= {p for p in (lm_head.weight, lm_head.bias) if p} if lm_head else set()
    unmatched = sorted({fqn.rpartition(".")[0] for fqn in params if fqn not in covered})
    specs = _input_specs(graph)
    shape = specs[0].shape if specs else [1, 1]
    return ModelAnalysis(
        class_name=type(model).__name__,
        graph=graph,
        traced_layer=traced.traced_layer,
        input_specs=specs,
        params=params,
        tied=tied_parameters(model),
        blocks=blocks,
        embedding=embedding,
        lm_head=lm_head,
        final_norm=final_norm,
        vocab_size=vocab,
        batch_size=shape[0],
        seq_len=shape[1] if len(shape) > 1 else 1,
        unmatched=unmatched,
        notes=notes,
        param_fingerprint=schemas.parameter_fingerprint(params),
        graph_fingerprint=graph_fingerprint(graph),
        block_matches=block_matches,
        sequential=isinstance(model, paddle.nn.Sequential),
    )


def repeated_layers(model: paddle.nn.Layer) -> list[str]:
    """FQNs of the children of every ``LayerList`` (the candidates for repeated blocks).

    >>> repeated_layers(paddle.nn.Sequential(paddle.nn.LayerList([paddle.nn.Linear(2, 2)])))
    ['0.0']
    """
    return [f"{fqn}.{name}" for fqn, layer in model.named_sublayers()
            if isinstance(layer, paddle.nn.LayerList) for name, _ in layer.named_children()]


def tied_parameters(model: paddle.nn.Layer) -> dict[str, list[str]]:
    """``{fqn: other FQNs of the same Parameter object}``, for every parameter reachable under
    two or more names (``named_parameters`` reports only the first)."""
    names: dict[int, list[str]] = {}
    for prefix, layer in model.named_sublayers(include_self=True):
        for name, param in layer._parameters.items():
            if param is not None:
                fqns = names.setdefault(id(param), [])
                fqn = f"{prefix}.{name}" if prefix else name
                if fqn not in fqns:
                    fqns.append(fqn)
    return {fqn: sorted(set(group) - {fqn}) for group in names.values() if len(group) > 1 for fqn in group}


# -- blocks ------------------------------------------------------------------------------------------


def weight_use(graph: nx.DiGraph, weight: int, matmul: int) -> tuple[int, bool]:
    """``(operand, transposed)``: which matmul operand the weight feeds and whether it arrives
    transposed (``transpose_x/y`` and 2-D ``transpose`` ops on the way combined)."""
    path = nx.shortest_path(graph, weight, matmul)
    flips = sum(1 for n in path[1:-1] if short_op(graph.nodes[n]["op"]) == "transpose"
                and graph.nodes[n]["attrs"].get("perm") == [1, 0])
    operand = graph.edges[path[-2], matmul]["operand"]
    attrs = graph.nodes[matmul]["attrs"]
    flips += bool(attrs.get("transpose_y" if operand == 1 else "transpose_x"))
    return operand, bool(flips % 2)


def split_dim(role: Role, operand: int, transposed: bool) -> int | None:
    """The weight dim to split for ``role``. A weight used as ``x @ W`` (operand 1) is
    ``[in, out]``: column splits ``out`` (dim 1), row splits ``in`` (dim 0); used transposed the
    dims swap; a weight on the left (operand 0) is ``[out, in]`` for the same product.

    >>> split_dim("column", 1, False), split_dim("column", 1, True), split_dim("row", 1, False)
    (1, 0, 0)
    """
    if role == "replicate":
        return None
    out_dim = 1 if (operand == 1) != transposed else 0
    return out_dim if role == "column" else 1 - out_dim


def _linear_uses(graph: nx.DiGraph, m: BlockMatch) -> list[tuple[LinearUse, int]]:
    """The block's linears in program order, each with its number of output features."""
    pattern, mapping = m.match.pattern.graph, m.match.mapping
    found = []
    for pnode, gnode in m.match.nodes_where(op=PARAM):
        spec = pattern.nodes[pnode]
        if "linear" not in spec:
            continue
        prefix = pnode.rpartition(".")[0]
        matmul = mapping[f"{prefix}.matmul"]
        operand, transposed = weight_use(graph, gnode, matmul)
        bias = mapping.get(f"{prefix}.bias")
        weight = graph.nodes[gnode]["param"]
        dim = split_dim(spec["role"], operand, transposed)
        use = LinearUse(layer=weight.rpartition(".")[0], weight=weight,
                        bias=graph.nodes[bias]["param"] if bias is not None else None, role=spec["role"],
                        split_dim=dim, fused=spec["fused"], name=spec["linear"])
        out_dim = dim if spec["role"] == "column" else 1 - dim
        found.append((matmul, use, graph.nodes[gnode]["shapes"][0][out_dim]))
    return [(use, out) for _, use, out in sorted(found, key=lambda item: item[0])]


def _block_info(graph: nx.DiGraph, m: BlockMatch) -> BlockInfo:
    mapping = m.match.mapping
    uses = _linear_uses(graph, m)
    out = {use.name: features for use, features in uses}
    # Head sizes from the attention core's shapes: q reaches the scores matmul as
    # [batch, heads, seq, head_dim] after its projection's reshape/transpose.
    scores = mapping["attn.core.scores"]
    q_in = next(p for p in graph.predecessors(scores) if graph.edges[p, scores]["operand"] == 0)
    head_dim = graph.nodes[q_in]["shapes"][0][-1]
    if "qkv" in out:
        num_heads = graph.nodes[scores]["shapes"][0][-3]
        num_kv_heads = (out["qkv"] - num_heads * head_dim) // (2 * head_dim)
    else:
        num_heads, num_kv_heads = out["q"] // head_dim, out["k"] // head_dim
    intermediate = out["gate_up"] // 2 if "gate_up" in out else out.get("up", out.get("fc_in", 0))
    hidden = graph.nodes[mapping["hidden"]]["shapes"][0][-1]
    # in program order: by the first op using each norm weight
    norm_weights = sorted((g for _, g in m.match.nodes_where(op=PARAM, norm=True)), key=lambda g: min(graph.successors(g)))
    norms = [graph.nodes[g]["param"] for g in norm_weights]
    return BlockInfo(m.layer, m.match.pattern.kind, m.nodes, [use for use, _ in uses], norms, num_heads,
                     num_kv_heads, head_dim, hidden, intermediate, m.match.pattern.description)


# -- layers outside blocks ---------------------------------------------------------------------------------


def _outer_layers(graph: nx.DiGraph, in_blocks: frozenset[int]) -> dict[str, Match]:
    """Layers outside the blocks whose own ops are exactly one layer pattern (embedding, norm,
    linear), by layer FQN in program order."""
    matcher = Matcher(patterns=layer_patterns())
    constants = constant_nodes(graph)
    own: dict[str, set[int]] = {}
    for node in sorted(set(graph) - in_blocks):
        if graph.nodes[node]["op"] != "builtin.parameter":
            own.setdefault(graph.nodes[node]["layer"], set()).add(node)
    found = {}
    for layer, nodes in own.items():
        match = matcher.match_view(compute_view(graph, nodes, constants))
        if match is not None:
            found[layer] = match
    return found


def _embeddings(graph: nx.DiGraph, outer: dict[str, Match]) -> tuple[str | None, list[str]]:
    """The token embedding (the one looking up a model input) and any other ones."""
    token, others = None, []
    for match in outer.values():
        if not match.pattern.kind.startswith("embedding"):
            continue
        fqn = graph.nodes[match.mapping[f"{match.pattern.kind}.weight"]]["param"]
        ids = match.mapping.get("ids")
        if token is None and ids is not None and short_op(graph.nodes[ids]["op"]) == "data":
            token = fqn
        else:
            others.append(fqn)
    return token, others


def _head_use(graph: nx.DiGraph, match: Match) -> LinearUse:
    weight, matmul = match.mapping["linear_proj.weight"], match.mapping["linear_proj.matmul"]
    operand, transposed = weight_use(graph, weight, matmul)
    fqn = graph.nodes[weight]["param"]
    bias = match.mapping.get("linear_proj.bias")
    return LinearUse(fqn.rpartition(".")[0], fqn, graph.nodes[bias]["param"] if bias is not None else None,
                     "column", split_dim("column", operand, transposed), name="lm_head")


def _lm_head(graph: nx.DiGraph, outer: dict[str, Match], vocab: int | None, in_blocks) -> LinearUse | None:
    """The traced projection producing vocabulary-sized logits: a linear layer of its own, or a
    linear pattern found inside a layer that does more (a parameter used by the model's top)."""
    if vocab is None:
        return None
    heads = [m for m in outer.values() if m.pattern.kind.startswith("linear")]
    if not heads:
        matcher, constants = Matcher(), constant_nodes(graph)
        layers = sorted({graph.nodes[n]["layer"] for n in set(graph) - in_blocks})
        views = (compute_view(graph, {n for n in block_nodes(graph, layer) if graph.nodes[n]["layer"] == layer} - in_blocks,
                              constants) for layer in layers)
        heads = [m for view in views for pattern in layer_patterns() if pattern.kind.startswith("linear")
                 for m in matcher.find(view, pattern)]
    for match in heads:
        if graph.nodes[match.mapping["linear_proj.matmul"]]["shapes"][0][-1] == vocab:
            return _head_use(graph, match)
    return None


def _untraced_lm_head(model: paddle.nn.Layer, traced: TracedProgram, vocab: int | None) -> LinearUse | None:
    """The LM head placed from the untraced top-level layers' parameter shapes."""
    if vocab is None:
        return None
    for layer_fqn in traced.untraced_layers:
        layer = model
        for part in layer_fqn.split("."):
            layer = getattr(layer, part)
        for name, param in layer.named_parameters():
            shape = list(param.shape)
            if len(shape) == 2 and vocab in shape:
                # Not traced, so its use is unknown: a [vocab, hidden] weight can only be used
                # transposed (logits = x @ W^T, as PaddleFormers' LMHead does); [hidden, vocab] as is.
                transposed = shape[0] == vocab and shape[1] != vocab
                fqn = _canonical_fqn(model, param, f"{layer_fqn}.{name}")
                return LinearUse(layer_fqn, fqn, None, "column", split_dim("column", 1, transposed), name="lm_head")
    return None


def _canonical_fqn(model: paddle.nn.Layer, param, fallback: str) -> str:
    """The FQN ``named_parameters`` reports for ``param`` (a tied weight's first name)."""
    return next((fqn for fqn, p in model.named_parameters() if p is param), fallback)


def _input_specs(graph: nx.DiGraph) -> list[schemas.InputSpec]:
    specs = []
    for node in sorted(graph):
        data = graph.nodes[node]
        if short_op(data["op"]) == "data":
            specs.append(schemas.InputSpec(name=data["attrs"].get("name", f"input_{node}"),
                                           dtype=data["dtypes"][0], shape=list(data["shapes"][0])))
    return specs
