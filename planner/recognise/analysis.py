"""What the planner knows about a model after recognition: its blocks, the tensor-parallel role
of every linear, the embedding, final norm and LM head, tied weights and what was not recognised.

Roles come from each block's dataflow, checked by Paddle's SPMD rules (:mod:`.roles`; no
whole-block pattern is matched); the layers around the blocks (embeddings, norms, the LM head)
are matched against small patterns (:mod:`.patterns`); split dims from how each weight reaches
its matmul (a transposed use swaps them); sizes (heads, KV heads, head dim, hidden,
intermediate) from the traced shapes, never from config attributes.

Example::

    >>> traced = trace_model(model, specs)                      # doctest: +SKIP
    >>> analysis = analyze(traced, build_graph(traced), model)  # doctest: +SKIP
    >>> [(l.layer, l.role, l.split_dim) for l in analysis.blocks[0].linears][:2]   # doctest: +SKIP
    [('model.layers.0.self_attn.q_proj', 'column', 1), ('model.layers.0.self_attn.k_proj', 'column', 1)]
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Iterable, Literal, TypeAlias

import networkx as nx
import paddle

from autodist import schemas

from autodist.planner.graph import build_graph, graph_fingerprint, operand_sources
from autodist.planner.recognise.crashes import local_only_layers, local_only_ops
from autodist.planner.recognise.expert_blocks import Experts, find_experts
from autodist.planner.ops import LAYOUT_OPS, RESHAPE_OPS, short_op
from autodist.planner.recognise.match import Match, Matcher, block_nodes, compute_view, constant_nodes
from autodist.planner.recognise.patterns import PARAM, layer_patterns
from autodist.planner.recognise.chaining import unchained_cuts
from autodist.planner.recognise.spmd import UNHOOKABLE
from autodist.planner.recognise.roles import (
    REPLAY_MP,
    BlockRecogniser,
    Projection,
    RecognisedBlock,
    SubLayer,
    projection_weights,
    split_dim,
    token_mixing_projection,
    weight_use,
)
from autodist.planner.trace import TracedProgram

Role = Literal["column", "row", "replicate"]


#: A projection and its tensor-parallel role (blocks' projections and the LM head alike).
LinearUse: TypeAlias = Projection


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
    description: str = ""  # its sub-layers, e.g. "attention(q|k|v)+mlp(gate|up)"
    sublayers: list[SubLayer] = field(default_factory=list)
    token_mixing: str | None = None  # a projection over the token axis (MLP-Mixer): no sequence parallelism
    experts: Experts | None = None  # an MoE's experts: what expert parallelism spreads over dp
    #: Sub-layers whose split only ops with no SPMD rule stop (``SubLayer.stopped_by``): not in
    #: ``sublayers``/``linears`` (replicated) unless run as local views (:func:`with_local_views`).
    stopped: list[SubLayer] = field(default_factory=list)


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
    recognised: list[RecognisedBlock] = field(default_factory=list, repr=False)
    #: What stopped a split, one line per layer kind and op (:func:`not_recognised`; also in ``notes``),
    #: each with the layer the op was first seen in, the op, and whether a local view may split it
    #: (the op has no SPMD rule).
    refusals: dict[str, tuple[str, str, bool]] = field(default_factory=dict)
    #: Ties by function call (:func:`read_by`): ``{parameter FQN: the other layers reading it}``.
    read_by: dict[str, list[str]] = field(default_factory=dict)
    #: The token embedding table's vocabulary dim: 0 for a ``[vocab, hidden]`` table, 1 for one the
    #: lookup reads transposed (``F.embedding(ids, self.lm_head.weight.T)``: a ``[hidden, vocab]``
    #: head weight). The dim a vocabulary-parallel plan splits (:func:`_embeddings`).
    vocab_dim: int = 0
    #: The layer whose own ops are the token lookup, when it is a layer of its own (``wte``); None
    #: when the lookup is one op of a layer doing more (the model's forward). Sequence parallelism
    #: starts after it.
    embedding_layer: str | None = None
    #: The layer whose calls can run the token lookup on local tensors when its table is split over
    #: the vocabulary (``plan.vocab_lookup``, Megatron's way), or None; and, when None, why not
    #: (:func:`local_lookup`).
    local_lookup: str | None = None
    local_lookup_refusal: str = ""
    #: The cuts a pipeline cannot make: ``{k: why}`` for a cut before ``blocks[k]`` whose dataflow
    #: is not what a stage gets (:func:`.chaining.unchained_cuts`: an encoder-decoder's decoder
    #: reading the encoder's output, say). The search prices no pipeline cutting there.
    unchained: dict[int, str] = field(default_factory=dict)
    #: The forward traced in train mode, where the model's code reads a layer's ``training`` flag
    #: (:attr:`TracedProgram.training`): a branch only training runs is checked there for ops
    #: Paddle cannot run on distributed tensors (:meth:`local_only`, the driver's crash check).
    training_graph: nx.DiGraph | None = None

    @property
    def moe_layers(self) -> list[str]:
        """The MoE layers (each the parent of a block's experts container), in block order."""
        return [block.experts.moe_layer for block in self.blocks if block.experts]

    @cached_property
    def moe_local_only(self) -> str:
        """The first op of the MoE layers that Paddle 3.3 cannot run on distributed tensors, in
        words (``"x[mask] (gather_nd of a boolean mask's positions) in layers.0.mlp"``), or ''.
        Such MoE layers run on local tensors wherever apply_plan can run them so
        (``schemas.parallel_dims.runs_moe_locally``'s ``local_only``)."""
        return self.local_only().get("local_only_in_moe", "")

    @property
    def graphs(self) -> tuple[nx.DiGraph, ...]:
        """The traced graph, and the train-mode one where training runs code the traced forward
        did not (``training_graph``): every op a plan trains with is in one of them."""
        return (self.graph,) if self.training_graph is None else (self.graph, self.training_graph)

    def local_only(self, local: Iterable[str] = ()) -> dict[str, str]:
        """:func:`~.crashes.local_only_ops` of the model as it trains (the cost model's
        ``local_only`` fields): the traced graph's, else the train-mode graph's, whose finding
        says it runs only in training."""
        local = tuple(local)
        found = local_only_ops(self.graph, self.moe_layers, local)
        if self.training_graph is not None:
            trained = local_only_ops(self.training_graph, self.moe_layers, local)
            for field_name in ("local_only", "local_only_in_moe"):
                if field_name in trained and field_name not in found:
                    found[field_name] = f"{trained[field_name]}, in code only training runs (self.training)"
                    if field_name == "local_only":
                        found["local_only_rewrite"] = trained["local_only_rewrite"]
                        found["local_only_layer"] = trained["local_only_layer"]
        return found


def analyze(
    traced: TracedProgram, graph: nx.DiGraph, model: paddle.nn.Layer, recogniser: BlockRecogniser | None = None
) -> ModelAnalysis:
    """Match ``model``'s blocks in ``graph`` and describe every parameter's role.

    Unmatched layers are listed (``unmatched`` and a note), never an error: a CNN gives zero
    blocks and a data-parallel-only plan.
    """
    recogniser = recogniser or BlockRecogniser()
    params = schemas.parameter_table(model.named_parameters())
    recognised = recogniser.recognise(graph, [b for b in repeated_layers(model) if block_nodes(graph, b)], params)
    # a repeated layer in which nothing was found (two Linears of one shape side by side) is no block
    found = [r for r in recognised if r.roles.sublayers or r.roles.stopped or r.roles.refusals]
    lone, notes = lone_blocks(graph, model, [r.layer for r in found], recogniser, params)
    inside_lone = tuple(f"{r.layer}." for r in lone)
    recognised = [r for r in recognised if not r.layer.startswith(inside_lone)] + lone
    recognised.sort(key=lambda r: min(r.nodes))
    first_use = _first_uses(graph)
    training_graph = build_graph(traced.training) if traced.training else None
    local_only = set().union(*(local_only_layers(g) for g in (graph, training_graph) if g is not None))
    blocks = [
        _block_info(graph, r, params, first_use, local_only) for r in recognised if r.roles.sublayers or r.roles.stopped
    ]
    routing = frozenset(fqn for b in blocks if b.experts for fqn in params if b.experts.routes(fqn))
    refusals = not_recognised(recognised, routing)
    notes += list(refusals)
    in_blocks = frozenset().union(*(r.nodes for r in recognised))
    outer = _outer_layers(graph, in_blocks)
    lookup, other_embeddings = _embeddings(graph, outer, in_blocks)
    embedding = lookup.table if lookup else None
    vocab = params[lookup.table][0][lookup.vocab_dim] if lookup else None
    notes += [f"{fqn}: embedding other than the token embedding, kept replicated" for fqn in other_embeddings]
    final_norm = [graph.nodes[g]["param"] for m in outer.values() for _, g in m.nodes_where(op=PARAM, norm=True)]
    lm_head = _lm_head(graph, outer, vocab, in_blocks) or _untraced_lm_head(model, traced, vocab)
    covered = {p for b in blocks for lin in b.linears for p in (lin.weight, lin.bias) if p}
    covered |= {p for b in blocks for s in b.stopped for lin in s.projections for p in (lin.weight, lin.bias) if p}
    covered |= {p for b in blocks for p in b.norms} | set(final_norm) | set(other_embeddings)
    covered |= routing | ({embedding} if embedding else set())
    covered |= {p for p in (lm_head.weight, lm_head.bias) if p} if lm_head else set()
    unmatched = sorted({fqn.rpartition(".")[0] for fqn in params if fqn not in covered})
    specs = _input_specs(graph)
    shape = specs[0].shape if specs else [1, 1]
    served, refusal = local_lookup(graph, lookup)
    analysis = ModelAnalysis(
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
        recognised=recognised,
        refusals=refusals,
        read_by=read_by(graph, model),
        vocab_dim=lookup.vocab_dim if lookup else 0,
        embedding_layer=lookup.layer if lookup else None,
        local_lookup=served,
        local_lookup_refusal=refusal,
        training_graph=training_graph,
    )
    if traced.training_untraced:
        notes.append(
            f"code only training runs ({', '.join(r or 'the model' for r in traced.training_readers)} read "
            "self.training) was not checked: "
            f"the forward does not trace in train mode ({traced.training_untraced})"
        )
    # What a later stage skips: the layers holding what runs before the blocks (not a table the
    # last stage reads too), as applier/modes/pipeline.py stubs them.
    skipped = params_before_blocks(analysis) - params_read_on_both_sides(analysis)
    analysis.unchained = unchained_cuts(
        graph,
        [(b.layer, b.nodes) for b in blocks],
        traced.first_tensors,
        frozenset(fqn.rpartition(".")[0] for fqn in skipped),
        model,
    )
    return analysis


def experts_whole(analysis: ModelAnalysis) -> ModelAnalysis:
    """``analysis`` as expert parallelism runs it: each MoE layer (the parent of a block's experts
    container, with its router and shared experts) runs whole on every mp rank, on its ep group's
    gathered tokens, so none of its projections has a tensor-parallel role (no mp placement, no
    reshard hook, no all-reduce); the rest of the block keeps its roles. The one owner of that
    rule for the plan (emit) and its price (the cost model).

    >>> from autodist.planner.recognise.roles import Projection
    >>> attention = Projection("layers.0.attn.q_proj", "layers.0.attn.q_proj.weight", None, "column", 0, name="q")
    >>> expert = Projection("layers.0.moe.experts.0.w1", "layers.0.moe.experts.0.w1.weight", None, "column", 0, name="w1")
    >>> block = BlockInfo("layers.0", "transformer", frozenset(), [attention, expert], [], 2, 2, 4, 8, 16,
    ...                   experts=Experts("layers.0.moe.experts", 2, 1))
    >>> bare = ModelAnalysis("M", nx.DiGraph(), "", [], {}, {}, [block], None, None, [], None, 1, 1, [], [], "", "")
    >>> [lin.name for lin in experts_whole(bare).blocks[0].linears]
    ['q']
    """
    blocks = []
    for block in analysis.blocks:
        if block.experts is not None:
            moe = block.experts.layer.rpartition(".")[0] + "."
            block = replace(block, linears=[lin for lin in block.linears if not lin.layer.startswith(moe)])
        blocks.append(block)
    return replace(analysis, blocks=blocks)


def params_before_blocks(analysis: ModelAnalysis) -> frozenset[str]:
    """The parameters outside the blocks that run before them: the token embedding and every
    parameter first used before the first block's first op. All other parameters outside the
    blocks (final norm, head, a pooler, untraced layers) run after them.

    The one rule for both the plan (``emit``: stage 0 or the last stage) and the cost model
    (``cost.graph_cost``: the ``first`` or ``last`` edge), so what is priced on a stage is what is
    placed there.
    """
    first_block_op = min((min(b.nodes) for b in analysis.blocks if b.nodes), default=None)
    before = {analysis.embedding} if analysis.embedding else set()
    if first_block_op is None:
        return frozenset(before)
    graph = analysis.graph
    for node, data in graph.nodes(data=True):
        consumers = list(graph.successors(node)) if data["param"] is not None else []
        if consumers and min(consumers) < first_block_op:
            before.add(data["param"])
    return frozenset(before)


def params_read_on_both_sides(analysis: ModelAnalysis) -> frozenset[str]:
    """The parameters outside the blocks read both before the first block and after the last:
    a table tied by a function call (``paddle.matmul(h, self.wte.weight, transpose_y=True)``
    after the blocks, or ``F.embedding(ids, self.lm_head.weight.T)`` before them). A pipeline
    needs them on its first and its last stage (emit: ``tied_stages``). An embedding whose table
    the head holds under its own name (``analysis.tied``) is not one: the trace reads it by the
    embedding's name on both sides, and emit copies it to the last stage under the head's name."""
    nodes = [n for b in analysis.blocks for n in b.nodes]
    if not nodes:
        return frozenset()
    first, last, graph = min(nodes), max(nodes), analysis.graph
    tied_by_name = {analysis.embedding} if analysis.embedding in analysis.tied else set()
    both = set()
    for node, data in graph.nodes(data=True):
        consumers = list(graph.successors(node)) if data["param"] is not None else []
        if data["param"] in tied_by_name:
            continue
        if consumers and min(consumers) < first and max(consumers) > last:
            both.add(data["param"])
    return frozenset(both)


def repeated_layers(model: paddle.nn.Layer) -> list[str]:
    """FQNs of the repeated layers, the candidates for blocks: the children of every
    ``LayerList``, and the children of any other container that holds two or more structurally
    identical layers (same class, same parameter shapes: a ``Sequential`` of blocks); only the
    outermost, so an MoE's experts inside a block are not blocks of their own.

    >>> repeated_layers(paddle.nn.Sequential(paddle.nn.LayerList([paddle.nn.Linear(2, 2)])))
    ['0.0']
    >>> repeated_layers(paddle.nn.Sequential(paddle.nn.Linear(2, 2), paddle.nn.ReLU(), paddle.nn.Linear(2, 2)))
    ['0', '2']
    """
    found = []
    for fqn, layer in model.named_sublayers(include_self=True):
        prefix = f"{fqn}." if fqn else ""
        children = list(layer.named_children())
        if isinstance(layer, paddle.nn.LayerList):
            found += [f"{prefix}{name}" for name, _ in children]
            continue
        shapes: dict[tuple, list[str]] = {}
        for name, child in children:
            key = (type(child), tuple(tuple(p.shape) for p in child.parameters()))
            shapes.setdefault(key, []).append(f"{prefix}{name}")
        found += [name for (_, params), names in shapes.items() if len(names) > 1 and params for name in names]
    outermost = [f for f in found if not any(f.startswith(other + ".") for other in found)]
    return sorted(set(outermost), key=found.index)


def lone_blocks(
    graph: nx.DiGraph, model: paddle.nn.Layer, repeated: list[str], recogniser: BlockRecogniser, params
) -> tuple[list[RecognisedBlock], list[str]]:
    """The layers outside the ``repeated`` blocks (:func:`repeated_layers` in which something was
    found) that are blocks of their own: an attention written once (with the MLP beside it), as
    Perceiver IO's encoder cross-attention (its queries from the learned latents) and its
    decoder's (from learned output queries), or a pooling attention.

    From the top, each layer holding no repeated layer is recognised as a block is; it is one
    when it holds an attention and every projection in it falls into one of its recognised
    sub-layers (a lone MLP, DiT's timestep embedder, stays replicated as before), and then it is
    narrowed to the innermost layer holding them all (a decoder's ``decoding_cross_attention``,
    not the decoder with its query table). A layer with a projection left over (a classifier
    after the attention, which the recogniser would take for a row fed by the MLP's and the
    attention's outputs) is looked into child by child. The model itself is never one, nor a
    layer with fewer than two projections. An attention whose heads the replay's degree does not
    divide (HF Perceiver's classification decoder: one head) is no block either, since every block
    takes the plan's mp (``search.degree_problem``): it stays replicated, and one note of
    ``notes`` (the second item returned) says so.
    """
    found: list[RecognisedBlock] = []
    notes: list[str] = []

    def recognised(fqn: str) -> RecognisedBlock | None:
        nodes = block_nodes(graph, fqn)
        weights = projection_weights(graph, nodes, params) if nodes else frozenset()
        if len(weights) < 2:
            return None
        [block] = recogniser.recognise(graph, [fqn], params)
        subs = block.roles.sublayers + block.roles.stopped
        placed = {p.weight for sub in subs for p in sub.projections}
        attends = any(sub.kind == "attention" for sub in subs)
        return block if attends and placed == weights else None

    def visit(fqn: str, layer: paddle.nn.Layer) -> None:
        holds_repeated = fqn == "" or any(r.startswith(f"{fqn}.") for r in repeated)
        block = None if holds_repeated or fqn in repeated else recognised(fqn)
        if block is not None:
            subs = block.roles.sublayers + block.roles.stopped
            narrowest = _common_layer([p.layer for sub in subs for p in sub.projections])
            block = block if narrowest == fqn else recognised(narrowest) or block
            heads = sorted({sub.num_heads for sub in subs if sub.kind == "attention" and sub.num_heads % REPLAY_MP})
            if heads:
                notes.append(
                    f"{block.layer}: an attention written once, with {heads[0]} head(s), which mp={REPLAY_MP} "
                    "does not divide: kept replicated (a head count mp divides would split it by heads)"
                )
            else:
                found.append(block)
            return
        if fqn not in repeated:
            for name, child in layer.named_children():
                visit(f"{fqn}.{name}" if fqn else name, child)

    visit("", model)
    return found, notes


def _common_layer(layers: list[str]) -> str:
    """The innermost layer holding every one of ``layers`` (FQNs).

    >>> _common_layer(["dec.xattn.attention.self.query", "dec.xattn.mlp.dense1"])
    'dec.xattn'
    """
    parts = [layer.split(".") for layer in layers]
    common = []
    for names in zip(*parts):
        if len(set(names)) > 1:
            break
        common.append(names[0])
    return ".".join(common)


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


def read_by(graph: nx.DiGraph, model: paddle.nn.Layer) -> dict[str, list[str]]:
    """Weights tied by a function call: ``{parameter FQN: the layers other than its own whose
    ops read it}``, from the trace (the parameter op feeding ops in two layers). A head written
    ``paddle.matmul(h, self.wte.weight, transpose_y=True)`` in the model's forward reads the
    embedding's table from the root layer ``""``; ``F.embedding(ids, self.lm_head.weight.T)``
    reads the head's weight. One Parameter, one name: unlike :func:`tied_parameters` there is no
    second name to find it by. A layer inside the owner, or holding the parameter under
    another name (a shared ``Parameter``), is not counted.
    """
    owners: dict[str, set[str]] = {}
    for fqn, aliases in tied_parameters(model).items():
        owners.setdefault(fqn, set()).update(alias.rpartition(".")[0] for alias in aliases)
    readers: dict[str, set[str]] = {}
    for node, data in graph.nodes(data=True):
        fqn = data["param"]
        if fqn is None:
            continue
        own = {fqn.rpartition(".")[0]} | owners.get(fqn, set())
        for user in graph.successors(node):
            layer = graph.nodes[user]["layer"]
            if not any(layer == o or (o and layer.startswith(o + ".")) or o == "" for o in own):
                readers.setdefault(fqn, set()).add(layer)
    return {fqn: sorted(layers) for fqn, layers in sorted(readers.items())}


# -- blocks ------------------------------------------------------------------------------------------


def _block_info(
    graph: nx.DiGraph, found: RecognisedBlock, params, first_use: dict[str, int], local_only: set[str]
) -> BlockInfo:
    subs = found.roles.sublayers
    biases = {p.bias for s in subs + found.roles.stopped for p in s.projections}
    prefix = found.layer + "."
    norms = sorted(
        (
            fqn
            for fqn, (shape, _) in params.items()
            if fqn.startswith(prefix) and len(shape) == 1 and fqn not in biases and fqn in first_use
        ),
        key=lambda f: first_use[f],
    )
    outputs = [
        graph.nodes[u]["shapes"][d["result"]]
        for u, v, d in graph.out_edges(found.nodes, data=True)
        if v not in found.nodes and graph.nodes[u]["shapes"][d["result"]]
    ]
    hidden = outputs[-1][-1] if outputs else 0
    block = BlockInfo(found.layer, "", found.nodes, [], norms, 0, 0, 0, hidden, 0, stopped=list(found.roles.stopped))
    block = _with_sublayers(block, list(subs), first_use)
    block.token_mixing = token_mixing_projection(graph, found.nodes, [p.weight for p in block.linears])
    block.experts = find_experts(graph, found.nodes, found.layer, list(subs), params, local_only)
    return block


def _with_sublayers(block: BlockInfo, subs: list[SubLayer], first_use: dict[str, int]) -> BlockInfo:
    """``block`` with the sub-layers ``subs`` and what follows from them: its linears in program
    order, its kind, description, heads and MLP width."""
    attention = next((s for s in subs if s.kind == "attention"), None)
    mlp = next((s for s in subs if s.kind == "mlp"), None)
    return replace(
        block,
        kind=block_kind(subs),
        linears=sorted((p for s in subs for p in s.projections), key=lambda p: first_use.get(p.weight, -1)),
        num_heads=attention.num_heads if attention else 0,
        num_kv_heads=attention.num_kv_heads if attention else 0,
        head_dim=attention.head_dim if attention else 0,
        intermediate_size=mlp.intermediate_size if mlp else 0,
        description="+".join(s.description for s in subs),
        sublayers=subs,
    )


def with_local_views(analysis: ModelAnalysis, local: frozenset[str]) -> ModelAnalysis:
    """``analysis`` as a plan runs it with the sub-layers ``local`` as local views: each block's
    stopped sub-layers among them (``BlockInfo.stopped``) join its sub-layers, their projections
    split as Megatron splits them (the proof ran them so); the other stopped ones stay
    replicated. The cost model prices and emit places this one analysis."""
    if not any(sub.view_layer in local for block in analysis.blocks for sub in block.stopped):
        return analysis
    first_use = _first_uses(analysis.graph)
    blocks = []
    for block in analysis.blocks:
        running = [sub for sub in block.stopped if sub.view_layer in local]
        if running:
            order = {p.weight: first_use.get(p.weight, -1) for s in block.sublayers + running for p in s.projections}
            subs = sorted(block.sublayers + running, key=lambda s: min(order[p.weight] for p in s.projections))
            block = _with_sublayers(block, subs, first_use)
        blocks.append(block)
    return replace(analysis, blocks=blocks)


#: The pattern names of attention projections (:attr:`LinearUse.name`).
ATTENTION_PROJECTIONS = frozenset({"q", "k", "v", "qkv", "o"})


def attention_layer(block: BlockInfo) -> str | None:
    """The sub-layer holding ``block``'s attention projections: what selective recompute runs
    again (the plan's ``recompute`` lists it, emit.recompute_layers; the cost model prices its
    forward again, cost/graph_cost.py). None for a block that computes attention inline (its
    projections' common owner is the block itself) or has none.

    >>> use = lambda layer, name: LinearUse(layer, layer + ".weight", None, "column", 1, name=name)
    >>> block = BlockInfo("h.0", "gpt", frozenset(), [use("h.0.attn.c_attn", "qkv"), use("h.0.attn.c_proj", "o")],
    ...                   [], 4, 4, 8, 32, 128)
    >>> attention_layer(block), attention_layer(replace(block, linears=block.linears[:1]))
    ('h.0.attn', 'h.0.attn')
    """
    owners = [use.layer.split(".") for use in block.linears if use.name in ATTENTION_PROJECTIONS]
    common = os.path.commonprefix(owners) if owners else []  # element-wise on lists of names
    attention = ".".join(common[:-1] if common in owners else common)  # one projection: its parent
    return attention if attention.startswith(block.layer + ".") else None


def block_kind(subs: list[SubLayer]) -> str:
    """A family name for reports, from what a reader would call a block with these sub-layers.

    >>> block_kind([])
    'transformer_block'
    """
    names = [{c.name for c in s.columns} for s in subs]
    has = lambda kind, cols: any(s.kind == kind and n == cols for s, n in zip(subs, names))  # noqa: E731
    if has("attention", {"qkv"}) and has("mlp", {"fc_in"}):
        return "gpt_block"
    if has("attention", {"q", "k", "v"}) and has("mlp", {"gate", "up"}):
        return "llama_decoder"
    if has("attention", {"qkv"}) and has("mlp", {"gate_up"}):
        return "phi3_decoder"
    return "transformer_block"


def _first_uses(graph: nx.DiGraph) -> dict[str, int]:
    """``{parameter FQN: the first op using it}``, for program order."""
    uses: dict[str, int] = {}
    for node, data in graph.nodes(data=True):
        if data["param"] is not None and graph.out_degree(node):
            first = min(graph.successors(node))
            uses[data["param"]] = min(first, uses.get(data["param"], first))
    return uses


def not_recognised(
    recognised: list[RecognisedBlock], routing: frozenset[str] = frozenset()
) -> dict[str, tuple[str, str, bool]]:
    """One note per distinct layer kind and op that stopped a split (the block index as ``*``),
    naming the layer it was first seen in, e.g. ``layers.*.mlp.down_proj: op layer_norm (first
    seen in layers.0.mlp.norm) stops the split before this projection; ...``, with that layer, the
    op and whether a local view may split it. Not for an MoE layer's routing (``routing``: its parameters), whole by design."""
    seen: dict[tuple[str, str], tuple[str, bool]] = {}
    for found in recognised:
        glob = found.layer.rpartition(".")[0] + ".*" if "." in found.layer else "*"
        for refusal in found.roles.refusals:
            if any(fqn.startswith(refusal.row + ".") for fqn in routing):
                continue
            seen.setdefault((glob + refusal.row[len(found.layer) :], refusal.op), (refusal.layer, refusal.local_view))
    return {
        f"{kind}: op {op} (first seen in {first}) stops the tensor-parallel split before this projection; "
        + (
            f"{stopped_reason(op)}: the sub-layer runs as a local view where the planner proves one, "
            "else it and the projections feeding it stay replicated"
            if local_view
            else "it and the projections feeding it stay replicated"
        ): (first, op, local_view)
        for (kind, op), (first, local_view) in seen.items()
    }


def stopped_reason(op: str) -> str:
    """Why ``op`` stops a split a local view may make: it has no SPMD rule, it is a layout op
    whose result's split no placement names (heads folded into the batch), or it is a fused
    projection no hook can gather (:data:`~.spmd.UNHOOKABLE`)."""
    if op == UNHOOKABLE:
        return "no hook can gather its fused projection's output, since the forward reads the projection's weight"
    if op in LAYOUT_OPS:
        return f"Paddle's global view has no placement for the split after {op}"
    return f"Paddle has no SPMD rule for {op}"


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


@dataclass(frozen=True)
class TokenLookup:
    """The token embedding: its ``table`` (a parameter FQN), the table's ``vocab_dim`` (1 when
    the lookup reads it transposed), the ``layer`` whose own ops are the lookup (None when it
    is one op of a layer doing more) and the lookup op itself (``node``, in the graph)."""

    table: str
    vocab_dim: int
    layer: str | None
    node: int


def local_lookup(graph: nx.MultiDiGraph, lookup: TokenLookup | None) -> tuple[str | None, str]:
    """The layer whose calls can run the token lookup on local tensors, ``(layer, "")``, or why
    none can, ``(None, why)``, read from the dataflow: what the lookup reads and who else reads its
    table. The lookup (Paddle's ``embedding`` op) must read the table parameter itself (not
    through another op: ``F.embedding(idx, self.lm_head.weight.T)``'s ``transpose``), in a layer of
    the model (the innermost layer running it, not the model's own forward), where every op
    reading the table is such a lookup, dense (``sparse`` off): T5's ``shared`` looks up encoder
    and decoder ids. The applier answers those ops by Megatron's lookup in that layer's calls
    (applier/modes/vocab_lookup.py) and runs the rest of its forward as written on the answers,
    which hold the values the global lookup's would, so what reads them does not matter: HF's
    scaled word embeddings multiply the answer by ``embed_scale`` in an ``nn.Embedding`` subclass
    (MiniCPM) or in their caller, a layer holding its own table calls ``F.embedding``; whatever
    the class."""
    if lookup is None:
        return None, "no token lookup"
    layer = graph.nodes[lookup.node]["layer"]
    source, _ = operand_sources(graph, lookup.node)[1]
    readers = sorted(set(graph.successors(source)) & block_nodes(graph, layer)) if layer else []
    other = [n for n in readers if short_op(graph.nodes[n]["op"]) != "embedding"]
    if graph.nodes[source]["param"] != lookup.table:
        why = f"the lookup reads {lookup.table} through {short_op(graph.nodes[source]['op'])}"
    elif not layer:
        why = "the lookup is an op of the model's own forward"
    elif other:
        why = f"{layer} reads {lookup.table} in {short_op(graph.nodes[other[0]]['op'])} too"
    elif any(graph.nodes[n]["attrs"].get("sparse") for n in readers):
        why = f"{layer} looks {lookup.table} up sparse"
    else:
        return layer, ""
    return None, why


def _embeddings(
    graph: nx.DiGraph, outer: dict[str, Match], in_blocks: frozenset[int]
) -> tuple[TokenLookup | None, list[str]]:
    """The token embedding (the lookup of a model input, as given or laid out anew by
    :data:`RESHAPE_OPS`) and any other embedding layers' tables.

    Whose table it reads does not matter: a layer of its own (``nn.Embedding``), or an
    ``F.embedding(ids, table)`` inside a layer that does more, with a table another layer owns,
    read as is or transposed (``F.embedding(idx, self.lm_head.weight.T)``: the ``[hidden, vocab]``
    head weight is the table, its vocabulary on dim 1); as the LM head is found (:func:`_lm_head`),
    a layer of its own first, then a lookup inside the layers outside the blocks."""
    token, others = None, []
    for layer, match in outer.items():
        if not match.pattern.kind.startswith("embedding"):
            continue
        lookup = _token_lookup(graph, match, layer)
        if token is None and lookup is not None:
            token = lookup
        else:
            others.append(graph.nodes[match.mapping[f"{match.pattern.kind}.weight"]]["param"])
    if token is None:
        token = next(
            (
                lookup
                for match in _found_inside(graph, in_blocks, lambda kind: kind == "embedding")
                if (lookup := _token_lookup(graph, match, None)) is not None
            ),
            None,
        )
    return token, others


def _token_lookup(graph: nx.DiGraph, match: Match, layer: str | None) -> TokenLookup | None:
    """``match`` (an embedding pattern) as the token lookup, when the ids it reads are a model input."""
    kind = match.pattern.kind
    ids = match.mapping.get("ids")
    if ids is None or not _model_input(graph, ids):
        return None
    weight = match.mapping[f"{kind}.weight"]
    _, transposed = weight_use(graph, weight, match.mapping[f"{kind}.lookup"])
    return TokenLookup(graph.nodes[weight]["param"], int(transposed), layer, match.mapping[f"{kind}.lookup"])


def _found_inside(graph: nx.DiGraph, in_blocks: frozenset[int], kinds) -> list[Match]:
    """Every match of the layer patterns whose kind ``kinds`` accepts inside the own ops of each
    layer outside the blocks (in layer order): one op of a layer that does more, such as the
    model's forward computing its logits or looking its tokens up."""
    matcher, constants = Matcher(), constant_nodes(graph)
    layers = sorted({graph.nodes[n]["layer"] for n in set(graph) - in_blocks})
    views = (
        compute_view(
            graph, {n for n in block_nodes(graph, layer) if graph.nodes[n]["layer"] == layer} - in_blocks, constants
        )
        for layer in layers
    )
    return [
        m for view in views for pattern in layer_patterns() if kinds(pattern.kind) for m in matcher.find(view, pattern)
    ]


def _model_input(graph: nx.DiGraph, node: int) -> bool:
    """``node`` is a model input, or one through :data:`RESHAPE_OPS` only."""
    while short_op(graph.nodes[node]["op"]) in RESHAPE_OPS:
        source = operand_sources(graph, node).get(0)
        if source is None:
            return False
        node = source[0]
    return short_op(graph.nodes[node]["op"]) == "data"


def _head_use(graph: nx.DiGraph, match: Match) -> LinearUse:
    weight, matmul = match.mapping["linear_proj.weight"], match.mapping["linear_proj.matmul"]
    operand, transposed = weight_use(graph, weight, matmul)
    fqn = graph.nodes[weight]["param"]
    bias = match.mapping.get("linear_proj.bias")
    return LinearUse(
        fqn.rpartition(".")[0],
        fqn,
        graph.nodes[bias]["param"] if bias is not None else None,
        "column",
        split_dim("column", operand, transposed),
        name="lm_head",
    )


def _lm_head(graph: nx.DiGraph, outer: dict[str, Match], vocab: int | None, in_blocks) -> LinearUse | None:
    """The traced projection producing vocabulary-sized logits: a linear layer of its own, or a
    linear pattern found inside a layer that does more (a parameter used by the model's top)."""
    if vocab is None:
        return None
    heads = [m for m in outer.values() if m.pattern.kind.startswith("linear")]
    if not heads:
        heads = _found_inside(graph, in_blocks, lambda kind: kind.startswith("linear"))
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
            specs.append(
                schemas.InputSpec(
                    name=data["attrs"].get("name", f"input_{node}"),
                    dtype=data["dtypes"][0],
                    shape=list(data["shapes"][0]),
                )
            )
    return specs
