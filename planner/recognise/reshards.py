"""What Paddle's SPMD rules say for a whole model: the reshards in each block, the collectives
Paddle inserts on its own (priced by the cost model, listed in the plan's ``implicit_comm``) and the
plan's reshard hooks that gather a column-split fused projection instead. Each block is replayed
with :class:`~.spmd.Replay` (its weights placed by role), each distinct block structure once.

Example::

    >>> comms = implicit_comm(analysis, mp=2)    # doctest: +SKIP
    >>> [(c.layer, c.op, c.collective) for c in comms][:1]                 # doctest: +SKIP
    [('model.layers.0.self_attn', 'slice', 'all_gather')]
"""

from __future__ import annotations

from dataclasses import replace
import os
from typing import Literal, Sequence

import networkx as nx
import paddle

from autodist import schemas
from autodist.schemas import LocalWeight
from autodist.schemas.local_view import kv_segments_whole
from autodist.schemas.vocabulary import DTYPE_BYTES

from autodist.planner.recognise.analysis import BlockInfo, LinearUse, ModelAnalysis
from autodist.planner.graph import operand_sources
from autodist.planner.ops import LAYOUT_OPS, short_op
from autodist.planner.recognise.match import constant_nodes
from autodist.planner.recognise.roles import Projection, SubLayer
from autodist.planner.recognise.spmd import Dist, Replay, Reshard, is_planned


def weight_dists(block: BlockInfo, params: dict[str, tuple[list[int], str]]) -> dict[str, Dist]:
    """Each block parameter's layout for its role (norms and row biases replicated)."""
    dists = {}
    for lin in block.linears:
        shape = params[lin.weight][0]
        dims = [-1] * len(shape)
        if lin.split_dim is not None:
            dims[lin.split_dim] = 0
        dists[lin.weight] = Dist(tuple(shape), tuple(dims))
        if lin.bias:
            bias_shape = tuple(params[lin.bias][0])
            dists[lin.bias] = Dist(bias_shape, (0,) if lin.role == "column" else (-1,))
    return dists


def block_reshards(
    analysis: ModelAnalysis, block: BlockInfo, mp: int, gathered_layers: frozenset[str] = frozenset()
) -> list[Reshard]:
    """Every reshard Paddle's rules ask for in ``block`` with its weights placed by role, the
    outputs of ``gathered_layers`` resharded to Replicate by post-hooks."""
    mesh = paddle.distributed.ProcessMesh(list(range(mp)), dim_names=["mp"])
    graph = analysis.graph
    weights = weight_dists(block, analysis.params)
    return Replay(graph, block.nodes, weights, mesh, constant_nodes(graph), gathered_layers).run()


def _signature(graph: nx.DiGraph, block: BlockInfo, gathered_layers: frozenset[str]) -> tuple:
    """Equal for blocks whose replays are equal up to node ids (same ops, shapes, dataflow by
    position, weight roles, hooked positions)."""
    order = sorted(block.nodes)
    position = {n: i for i, n in enumerate(order)}
    return tuple(
        (
            graph.nodes[n]["op"],
            str(graph.nodes[n]["shapes"]),
            graph.nodes[n]["layer"] in gathered_layers,
            tuple(sorted((position.get(p, -1), operand) for operand, (p, _) in operand_sources(graph, n).items())),
        )
        for n in order
    ) + tuple((lin.name, lin.role, lin.split_dim) for lin in block.linears)


def _all_block_reshards(analysis: ModelAnalysis, mp: int, gathered: frozenset[str]):
    """``(block, reshards)`` for every block, replaying each distinct block structure once and
    moving its result onto the blocks that share it by node position."""
    replayed: dict[tuple, tuple[list[int], list[Reshard]]] = {}
    for block in analysis.blocks:
        order = sorted(block.nodes)
        key = _signature(analysis.graph, block, gathered)
        if key not in replayed:
            replayed[key] = (order, block_reshards(analysis, block, mp, gathered))
        first_order, reshards = replayed[key]
        moved = dict(zip(first_order, order))
        yield (
            block,
            [
                replace(
                    r,
                    node=moved[r.node],
                    before=replace(
                        r.before,
                        partial_source=None if r.before.partial_source is None else moved.get(r.before.partial_source),
                    ),
                )
                for r in reshards
            ],
        )


def _comm_bytes(dist: Dist, mp: int, itemsize: int) -> int:
    """Bytes one rank sends for a ring collective over a value of ``dist.shape``, forward plus
    backward (an all-gather's gradient is a reduce-scatter of the same size, an all-reduce's is
    an all-reduce or nothing; counted once each way)."""
    numel = 1
    for d in dist.shape:
        numel *= max(d, 1)
    per_pass = numel * itemsize * (mp - 1) // mp
    return 2 * per_pass


def implicit_comm(
    analysis: ModelAnalysis, mp: int, dtype_bytes: int | None = None, hooks: Sequence[schemas.Hook] = ()
) -> list[schemas.ImplicitComm]:
    """Every place the blocks' placements make Paddle communicate on its own at tensor-parallel
    degree ``mp``, with bytes per rank per training step for the traced input shape (scale by
    tokens per micro-batch / traced tokens). ``dtype_bytes`` overrides the traced dtype's size
    (e.g. 2 when training in bf16 a model traced in fp32). ``hooks``: the plan's reshard
    post-hooks (:func:`reshard_hooks`); the gathers they ask for are planned, not implicit, and
    the ops after them see whole tensors.

    Sequence parallelism adds collectives the plan asks for at the block boundaries (gather
    before the column linears, reduce-scatter after the row linears); the interior between them,
    which this checks, is the same, so the result does not depend on it.
    """
    if mp <= 1:
        return []
    graph = analysis.graph
    gathered = frozenset(h.layer for h in hooks if h.action == "reshard" and h.when == "post")
    found = []
    for _, reshards in _all_block_reshards(analysis, mp, gathered):
        for r in reshards:
            if r.collective is None or is_planned(graph, r):
                continue
            node = graph.nodes[r.node]
            op = short_op(node["op"])
            producer = graph.nodes[operand_sources(graph, r.node)[r.operand][0]]
            itemsize = dtype_bytes or DTYPE_BYTES.get((producer["dtypes"] or [None])[0], 4)
            found.append(
                schemas.ImplicitComm(
                    layer=node["layer"],
                    op=op,
                    collective=r.collective,
                    bytes_per_step=_comm_bytes(r.before, mp, itemsize),
                    reason=(
                        f"{op} needs its operand {r.operand} (from {producer['layer']}, {list(r.before.shape)}) "
                        f"{r.after.placement()} over mp, the placements make it {r.before.placement()}"
                    ),
                )
            )
    return found


def reshard_hooks(
    analysis: ModelAnalysis, mp: int, mesh_axes: Sequence[str] = ("mp",), local: frozenset[str] = frozenset()
) -> list[schemas.Hook]:
    """Post-hooks that reshard each column-split *fused* projection's output to Replicate over mp.

    Why: with ``q|k|v`` or ``gate|up`` split by columns, the forward works (Paddle all-gathers
    before the split, see :func:`implicit_comm`), but the backward of the matmul then fails
    Paddle's SPMD verification (``matmul grad infer spmd ... verify error``, measured with Gemma3
    and Phi3 on CPU, docs/paddle-notes.md, "SPMD rules"). Gathering the output explicitly right after the
    projection trains to the same losses as one device, keeps the projection's weight and FLOPs
    split, and replaces the several gathers the segment split would trigger with one.
    ``mesh_axes`` are the plan's mesh axes (``pp``, ``dp``, ``mp``): the batch stays split on
    ``dp``, everything else is whole. ``local``: the sub-layers that run as local views, whose
    fused projections are not gathered (:func:`gathered_linears`).
    """
    if mp <= 1:
        return []
    return [
        gather_hook(lin.layer, f"{lin.name} ({lin.fused} segments)", mesh_axes)
        for block in analysis.blocks
        for lin in gathered_linears(block, local)
    ]


def gather_hook(layer: str, fused: str, mesh_axes: Sequence[str]) -> schemas.Reshard:
    """The post-hook gathering column-split fused projection ``layer``'s output over mp (``fused``
    says what it fuses, for the reason): the batch stays split on ``dp``, everything else whole.
    :func:`reshard_hooks` puts one on each such projection; ``export --paddle-only`` on those of
    the plan's local views, which it runs in the global view instead.

    >>> gather_hook("h.0.attn.c_attn", "qkv (3 segments)", ["dp", "mp"]).placements
    ['S(0)', 'R']
    """
    fill = {"pp": "R", "dp": "S(0)", "mp": "R"}
    return schemas.Reshard(
        layer=layer,
        when="post",
        placements=[fill[d] for d in mesh_axes],
        reason=f"column-split fused {fused}: gather its output over mp so the segment split and the backward "
        "see whole tensors",
    )


def gathered_linears(block: BlockInfo, local: frozenset[str] = frozenset()) -> list[LinearUse]:
    """The projections of ``block`` whose outputs :func:`reshard_hooks` gathers: the
    column-split fused ones (their outputs are whole again for the ops after them), but for those
    under a sub-layer in ``local``, which runs as a local view (:func:`local_view_candidates`)."""
    return [
        lin
        for lin in block.linears
        if lin.role == "column" and lin.fused > 1 and not any(lin.layer.startswith(view + ".") for view in local)
    ]


def local_view_candidates(block: BlockInfo) -> list[tuple[str, SubLayer]]:
    """``(layer, sub-layer)`` for each sub-layer of ``block`` (attention or MLP) that may run as a
    local view (Megatron's way, on local tensors; planner/local_view_proof.py proves it for a plan): one
    with a column-split fused projection (``q|k|v``, ``gate|up``: else gathered) or whose split
    only ops with no SPMD rule or layout ops stop (``block.stopped``: else replicated), every column
    split, the row projection contracting them, all the projections of one layer (``layer``), or
    all the columns of one layer with the row projection outside it (BERT's ``attention.self``
    beside ``attention.output``: ``SubLayer.joined``, its output each rank's heads)."""
    found = []
    for sub in [s for s in block.sublayers if any(c.fused > 1 for c in s.columns)] + block.stopped:
        if any(c.role != "column" or c.split_dim is None for c in sub.columns) or sub.row.role != "row":
            continue
        if sub.view_layer is not None:
            found.append((sub.view_layer, sub))
    return found


def multi_query_weights(block: BlockInfo, params: dict, local: frozenset[str]) -> list[LocalWeight]:
    """The fused multi-query ``q|k|v`` weights (and biases) of ``block``'s sub-layers in ``local``
    (their ``LocalWeight.sizes`` unequal, whatever mp), as at mp 1: at an mp their KV heads do not
    divide (:func:`~autodist.schemas.local_view.kv_replicated`) their K and V segments are
    replicated and each is held whole on every mp rank (emit), its gradient summed over mp; the
    cost model prices them so (graph_cost: ``BlockCost.multi_query_params``, their ``sizes``)."""
    return [
        w
        for layer, sub in local_view_candidates(block)
        if layer in local
        for w in local_weights(sub, params, 1)
        if w.sizes
    ]


def local_weights(sub: SubLayer, params: dict, mp: int) -> tuple[LocalWeight, ...]:
    """A candidate sub-layer's weights' views at ``mp``: its columns (fused as :func:`_fused`
    says, biases alike), its row projection (in the groups of a grouped column, :func:`_grouped`),
    its row bias summed; not the row of a ``joined`` one, which runs in the global view."""
    weights = []
    row_segments = 1
    for column in sub.columns:
        assert column.split_dim is not None  # local_view_candidates: every column split
        width = params[column.weight][0][column.split_dim]
        if _grouped(sub, column, width, mp):
            fused: dict = {"segments": column.groups * column.fused}
            row_segments = column.groups
        else:
            fused = _fused(sub, column, width, mp)
        weights.append(LocalWeight(param=column.weight, dim=column.split_dim, **fused))
        if column.bias:
            weights.append(LocalWeight(param=column.bias, dim=0, **fused))
    if sub.joined:
        return tuple(weights)
    weights.append(LocalWeight(param=sub.row.weight, dim=sub.row.split_dim, segments=row_segments))
    if sub.row.bias:
        weights.append(LocalWeight(param=sub.row.bias, summed=True))
    return tuple(weights)


def _grouped(sub: SubLayer, column: Projection, width: int, mp: int) -> bool:
    """A fused attention column cut group by group (:func:`~.roles.fused_groups`: HF CodeGen's
    ``qkv_proj``, 4 groups of ``q|v|k``, each of 2 of its 8 heads) whose pieces each split over
    ``mp`` into whole heads: rank ``r`` takes the ``r``-th slice of every piece of every group, so
    its local output reshaped into the same groups holds ``q|v|k`` of its heads of each group, as
    the model's own cut expects; its heads' outputs then reach the row projection group by
    group, so the row is split in the same groups. The proof decides whether the model lays it
    out so. GPT-NeoX's groups are single heads, which do not split: not grouped."""
    if sub.kind != "attention" or column.groups == 1 or column.fused == 1 or not sub.head_dim:
        return False
    piece, rest = divmod(width, column.groups * column.fused)
    return rest == 0 and piece % (sub.head_dim * mp) == 0


def _fused(sub: SubLayer, column: Projection, width: int, mp: int) -> dict:
    """How a column's segments lie (``LocalWeight`` fields): ``column.fused`` equal ones, or, for
    an attention's ``q|k|v`` of ``width`` with fewer KV heads than query heads (multi-query,
    grouped), q of all the heads then k and v of the KV heads, those two replicated when the KV
    heads do not split over ``mp`` (:func:`~autodist.schemas.local_view.kv_segments_whole`;
    Megatron's way: each rank's query heads against the whole K and V). The proof decides
    whether the model lays it out so."""
    kv, heads, head_dim = sub.num_kv_heads, sub.num_heads, sub.head_dim
    if sub.kind != "attention" or column.fused != 3 or not 0 < kv < heads or width != (heads + 2 * kv) * head_dim:
        return {"segments": column.fused}
    return {
        "segments": 3,
        "sizes": [heads * head_dim, kv * head_dim, kv * head_dim],
        "replicated": kv_segments_whole(kv, mp),
    }


def local_view_layers(analysis: ModelAnalysis) -> frozenset[str]:
    """Every sub-layer of the model that may run as a local view (:func:`local_view_candidates`)."""
    return frozenset(layer for block in analysis.blocks for layer, _ in local_view_candidates(block))


#: How a sub-layer runs under tensor parallelism (:func:`sublayer_modes`).
SubLayerMode = Literal["local view", "gathered", "split", "replicated"]


def sublayer_modes(block: BlockInfo, local: frozenset[str]) -> list[tuple[str, SubLayer, SubLayerMode]]:
    """``(layer, sub-layer, mode)`` for each sub-layer of ``block`` at mp > 1, ``local`` the
    sub-layers run as local views: ``local view`` (each rank runs it at 1/mp width on plain
    tensors, its output summed by one all-reduce), ``gathered`` (a fused projection's output
    gathered by the plan's hook, :func:`gathered_linears`: what follows runs whole on every
    rank), ``split`` (global view, Megatron's placements: the core on 1/mp of the heads or
    features) or ``replicated`` (no projection split: whole on every rank). What ``--explain``
    says; the cost model prices the same rule through :func:`gathered_linears` (a core is whole
    when what it reads is whole).

    >>> from autodist.planner.recognise.roles import Projection, SubLayer
    >>> qkv = Projection("h.0.attn.c_attn", "h.0.attn.c_attn.weight", None, "column", 1, fused=3, name="qkv")
    >>> out = Projection("h.0.attn.c_proj", "h.0.attn.c_proj.weight", None, "row", 0, name="o")
    >>> block = BlockInfo("h.0", "gpt_block", frozenset(), [qkv, out], [], 2, 2, 4, 8, 0,
    ...                   sublayers=[SubLayer("attention", (qkv,), out, 2, 2, 4)])
    >>> [mode for _, _, mode in sublayer_modes(block, frozenset())], sublayer_modes(block, frozenset({"h.0.attn"}))[0][2]
    (['gathered'], 'local view')
    """
    gathered = {lin.layer for lin in gathered_linears(block, local)}
    split = {lin.layer for lin in block.linears if lin.role != "replicate" and lin.split_dim is not None}
    found: list[tuple[str, SubLayer, SubLayerMode]] = []
    for sub in block.sublayers:
        name = ".".join(os.path.commonprefix([p.layer.split(".")[:-1] for p in sub.projections]))
        layers = {p.layer for p in sub.projections}
        if sub.view_layer in local:
            name = sub.view_layer
        mode: SubLayerMode = (
            "local view"
            if name in local
            else "gathered"
            if layers & gathered
            else "split"
            if layers & split
            else "replicated"
        )
        found.append((name, sub, mode))
    return found


def vocab_parallel_problems(analysis: ModelAnalysis, split: dict[str, int], mp: int) -> dict[str, list[str]]:
    """Why each weight of ``split`` (``{parameter FQN: the dim split over mp}``) would not be
    vocabulary-parallel under Paddle's SPMD rules, ``{FQN: problems}`` (empty: it is). The ops
    reading the weight (through layout ops: ``weight.T``) are replayed with the weight so split;
    each must split the vocabulary (an op whose rule gathers the weight is passed over, below): a product's output
    split on its vocabulary-sized dim (the logits), or a partial sum over the vocabulary (a
    lookup: each rank looks up its own rows, its output has no vocabulary dim). For the weights
    outside the blocks, the token embedding's table and the LM head's weight, one Parameter when
    they are tied: one placement has to serve every use, however it is spelled (``wte(ids)`` and
    ``x @ wte.weight.T``, ``F.embedding(ids, lm_head.weight.T)`` and ``lm_head(x)``).

    >>> vocab_parallel_problems(analysis, {"lm_head.weight": 0}, 2)   # doctest: +SKIP
    {'lm_head.weight': ['embedding in "": its output is S(2) over mp, not ...', ...]}
    """
    graph, vocab = analysis.graph, analysis.vocab_size
    mesh = paddle.distributed.ProcessMesh(list(range(mp)), dim_names=["mp"])
    found: dict[str, list[str]] = {}
    for fqn, dim in split.items():
        shape = tuple(analysis.params[fqn][0])
        weight = Dist(shape, tuple(0 if i == dim else -1 for i in range(len(shape))))
        carriers = {n for n, d in graph.nodes(data=True) if d["param"] == fqn}
        frontier, nodes, readers = list(carriers), set(), []
        while frontier:  # the layout ops carrying the weight, and the ops reading it
            for user in sorted(graph.successors(frontier.pop())):
                if user in nodes:
                    continue
                nodes.add(user)
                if short_op(graph.nodes[user]["op"]) in LAYOUT_OPS:
                    carriers.add(user)
                    frontier.append(user)
                else:
                    readers.append(user)
        replay = Replay(graph, frozenset(nodes), {fqn: weight}, mesh, constant_nodes(graph))
        reshards = replay.run()
        problems = []
        for node in sorted(readers):
            data = graph.nodes[node]
            where = f"{short_op(data['op'])} in {data['layer']!r}"
            gathers = [
                r
                for r in reshards
                if r.node == node
                and not r.before.is_replicated
                and operand_sources(graph, node).get(r.operand, (None, 0))[0] in carriers
            ]
            if gathers:
                # Not refused: Paddle 3.3.1's embedding rule asks for a row-split table whole (at
                # run time with or without padding_idx; docs/paddle-notes.md, "SPMD rules"), and the
                # cost model prices those gathers (comm.vocab_lookup_collective). Any other reader
                # that gathers the weight passes here too, unpriced: not seen in a model yet.
                continue
            out = replay.values[node, 0]
            if not isinstance(out, Dist):
                problems.append(f"{where}: no SPMD rule says what its output is")
            elif not (
                any(d == 0 and n == vocab for d, n in zip(out.dims, out.shape))
                or (out.partial and vocab not in out.shape)  # the vocabulary summed over: a lookup
            ):
                problems.append(f"{where}: its output is {out.placement()} over mp, not split over the vocabulary")
        found[fqn] = problems
    return found
