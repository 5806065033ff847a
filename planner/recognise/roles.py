"""Tensor-parallel roles from dataflow, checked by Paddle's SPMD rules.

A block (one repeated layer) is not matched against whole-block templates. Its sub-layers are
found from the dataflow of its compute view (:func:`~.match.compute_view`):

1. every projection (a ``matmul`` / ``addmm`` with a 2-D trainable weight) is a candidate
   *row* projection; walking back from its input through anything but another projection
   finds the projections that feed it, the candidate *columns*. Rows are tried from the last
   projection back, so a group nested in another's columns is not taken first;
2. the candidate is replayed through Paddle's SPMD rules (:mod:`.spmd`) with the columns split
   on their output features and the row split on its input features. It is accepted only if
   the split travels from the columns to the row without any communication Paddle would add
   on its own (the row's all-reduce is the one asked for; Paddle's own sum of a statistic over
   the split features, a whole-width q/k norm's mean of squares, is accepted and priced as
   Paddle's: :func:`.spmd.is_statistic`). A column whose output is cut into
   segments (a fused ``q|k|v`` or ``gate|up``) is accepted with a post-hook gathering its
   output, as the plan does for fused projections;
3. an accepted group is an *attention* when a softmax (or a fused attention op) lies between
   columns and row, else an *MLP*; heads (:func:`head_count`), KV heads and head size come from
   the traced shapes.
   Multi-query and grouped-query attention with KV heads that do not divide over the replay's
   two ranks (one KV head) keep their K/V projections whole on every rank, as Megatron and HF
   do: only Q is split by columns, and the replay checks that the attention core keeps Q's head
   split against the whole K/V (Paddle slices the replicated K/V locally, no communication).
   A column whose output another column of the group contracts (multi-head latent attention's
   ``kv_a_proj_with_mqa``, whose latent ``kv_b_proj`` projects up to the heads) stays whole the
   same way, as Megatron keeps it: split by columns, the up-projection would need its output
   gathered. The up-projection is split by heads, and its cut into each head's key and value
   gathers nothing: the replay decides (:func:`_latent_projections`);
4. a candidate refused *only* at ops Paddle has no SPMD rule for (``as_complex`` rotary,
   ``masked_fill``, ``tril``: :attr:`.spmd.Replay.ruleless`) or at layout ops, which move values
   and never combine them (:data:`~autodist.planner.ops.LAYOUT_OPS`: the ``reshape`` folding
   the heads into the batch, ``[batch * heads, seq, head_dim]``, whose split no placement of the
   global view names), is named as in 3 all the same, but kept apart (``stopped``, its
   projections replicated): nothing says such an op needs whole inputs, only that Paddle's
   global view gathers them. It may run as a *local view* (each rank the model's own forward on
   its heads, planner/local_view_proof.py), which the planner proves by running it before a plan
   splits it. Its refusal stays, marked ``local_view``, for the note. So is a group whose fused
   column no post-hook can gather, its layer's forward never running (timm BEiT's
   ``F.linear(x, weight=self.qkv.weight, bias=qkv_bias)``: :data:`.spmd.UNHOOKABLE`), where the
   replay with that output taken whole right after the product, as a hook would, splits the
   rest (or stops only at such ops): a local view needs no gather.

Whatever layout glues the sub-layers together (pre-norm, post-norm, parallel residual,
sandwich norms, cross-attention, an MoE's experts) needs no pattern: each sub-layer is accepted
on its own, so one that is not recognised never costs its neighbour its split.

Example::

    >>> found = recognise_block(graph, nodes, params)                      # doctest: +SKIP
    >>> [(s.kind, [c.name for c in s.columns], s.row.name) for s in found.sublayers]   # doctest: +SKIP
    [('attention', ['q', 'k', 'v'], 'o'), ('mlp', ['gate', 'up'], 'down')]
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass, field, replace
from typing import Literal, overload

import networkx as nx
import paddle

from autodist.planner.recognise.match import block_nodes, compute_view, constant_nodes
from autodist.planner.graph import operand_sources
from autodist.planner.ops import (
    CUT_OPS,
    FUSED_ATTENTION_OPS,
    LAYOUT_OPS,
    LINEAR_OPS,
    PARAM,
    PRODUCT_OPS,
    SEGMENT_OPS,
    WEIGHT_VIEW_OPS,
    Product,
    op,
    short_op,
)
from autodist.planner.recognise.spmd import UNHOOKABLE, Dist, Replay, is_planned, is_statistic

#: The tensor-parallel degree the SPMD replay checks a candidate group at.
REPLAY_MP = 2


@dataclass(frozen=True)
class Projection:
    """One projection of a sub-layer: its layer, weight and bias FQNs, ``role`` (``column`` /
    ``row``, or ``replicate`` for a multi-query attention's K/V or a latent kept whole), the weight dim split
    for it (None when whole), how many projections are ``fused`` into it, its ``name`` in the
    sub-layer (q, k, v, qkv, o, latent: a latent attention's down-projection / gate, up, gate_up,
    fc_in, down, fc_out), and the ``groups`` a fused output is reshaped into before it is cut into
    its projections (:func:`fused_groups`; 1: cut whole)."""

    layer: str
    weight: str
    bias: str | None
    role: Literal["column", "row", "replicate"]
    split_dim: int | None
    fused: int = 1
    name: str = ""
    groups: int = 1


@dataclass(frozen=True)
class SubLayer:
    """A recognised attention or MLP: column projections, the row projection contracting them,
    and the sizes the plan's constraints need (0 where not applicable)."""

    kind: Literal["attention", "mlp"]
    columns: tuple[Projection, ...]
    row: Projection
    num_heads: int = 0
    num_kv_heads: int = 0
    head_dim: int = 0
    intermediate_size: int = 0
    #: The op that stops its split in Paddle's global view, one with no SPMD rule (``as_complex``)
    #: or a layout op (``reshape``): the sub-layer is split only as a proven local view (module
    #: docstring, 4); "" for one split as is.
    stopped_by: str = ""

    @property
    def projections(self) -> tuple[Projection, ...]:
        return (*self.columns, self.row)

    @property
    def owner(self) -> str | None:
        """The layer holding all its projections (``layers.0.self_attn``), None when they are
        not the children of one layer."""
        parents = {p.layer.rpartition(".")[0] for p in self.projections}
        return parents.pop() if len(parents) == 1 else None

    @property
    def view_layer(self) -> str | None:
        """The layer a local view of it runs: its :attr:`owner`, or, when the row projection lies
        outside the layer holding all its columns (BERT's ``attention.output.dense`` beside
        ``attention.self``), that layer, whose output is then :attr:`joined`; None otherwise.

        >>> q = Projection("a.self.q", "a.self.q.weight", None, "column", 1, name="q")
        >>> o = Projection("a.output.dense", "a.output.dense.weight", None, "row", 0, name="o")
        >>> inner = replace(o, layer="a.self.out.dense", weight="a.self.out.dense.weight")
        >>> SubLayer("attention", (q,), o).view_layer, SubLayer("attention", (q,), inner).view_layer
        ('a.self', None)
        """
        if self.owner is not None:
            return self.owner
        parents = {c.layer.rpartition(".")[0] for c in self.columns}
        parent = parents.pop() if len(parents) == 1 else None
        return None if parent is None or self.row.layer.startswith(parent + ".") else parent

    @property
    def joined(self) -> bool:
        """Its local view holds the columns and the core but not the row projection: each rank's
        output is its heads, a slice of the last dim, not a partial sum (``LocalView.output``)."""
        return self.owner is None and self.view_layer is not None

    @property
    def description(self) -> str:
        """``attention(q|k|v)``, ``mlp(gate_up)``, ..."""
        return f"{self.kind}({'|'.join(c.name for c in self.columns)})"


@dataclass
class Refusal:
    """A projection group that the SPMD replay refused: the op that would communicate."""

    row: str  # the row candidate's layer
    op: str
    layer: str  # the layer of that op
    local_view: bool = False  # no SPMD rule, or a layout op: a local view may split it (BlockRoles.stopped)


@dataclass
class BlockRoles:
    sublayers: list[SubLayer] = field(default_factory=list)
    refusals: list[Refusal] = field(default_factory=list)
    replays: int = 0
    #: Sub-layers stopped only by ops with no SPMD rule or layout ops (``SubLayer.stopped_by``): replicated
    #: in the global view, split as local views where proven.
    stopped: list[SubLayer] = field(default_factory=list)


@dataclass(frozen=True)
class RecognisedBlock:
    """One repeated layer: its FQN, graph nodes and what :func:`recognise_block` found."""

    layer: str
    nodes: frozenset[int]
    roles: BlockRoles


@dataclass
class BlockRecogniser:
    """Recognises blocks, once per distinct structure: blocks whose compute views have the same
    Weisfeiler-Lehman hash and the same parameter names (relative to the block) reuse the first
    one's result with the FQNs moved over, so the work grows with the number of block kinds,
    not with depth. ``calls`` counts the blocks actually analysed."""

    calls: int = 0
    _by_key: dict[tuple, RecognisedBlock] = field(default_factory=dict)

    def recognise(self, graph: nx.DiGraph, layers: list[str], params) -> list[RecognisedBlock]:
        constants = constant_nodes(graph)
        found = []
        for layer in layers:
            nodes = block_nodes(graph, layer)
            view = compute_view(graph, nodes, constants)
            key = _structure_key(view, layer)
            first = self._by_key.get(key)
            moved = _moved(first, layer, nodes, params) if first is not None else None
            if moved is None:
                self.calls += 1
                moved = RecognisedBlock(layer, nodes, recognise_block(graph, nodes, params, constants, view))
                self._by_key.setdefault(key, moved)
            found.append(moved)
        return found


def _structure_key(view: nx.DiGraph, layer: str) -> tuple:
    for node in view:
        data = view.nodes[node]
        data["label"] = f"{data['op']}{data['shape']}"
    suffixes = tuple(sorted(str(d["param"])[len(layer) :] for _, d in view.nodes(data=True) if d["param"]))
    return nx.weisfeiler_lehman_graph_hash(view, node_attr="label", iterations=3), suffixes


def _moved(first: RecognisedBlock, layer: str, nodes: frozenset[int], params) -> RecognisedBlock | None:
    """``first``'s result for the structurally equal block ``layer`` (None if a name fails to move)."""

    def move(fqn: str) -> str:
        return layer + fqn[len(first.layer) :] if fqn.startswith(first.layer + ".") else fqn

    def move_projection(p: Projection) -> Projection:
        return replace(p, layer=move(p.layer), weight=move(p.weight), bias=None if p.bias is None else move(p.bias))

    def move_sublayers(found: list[SubLayer]) -> list[SubLayer]:
        return [
            replace(s, columns=tuple(move_projection(c) for c in s.columns), row=move_projection(s.row)) for s in found
        ]

    subs, stopped = move_sublayers(first.roles.sublayers), move_sublayers(first.roles.stopped)
    if any(
        p.weight not in params or (p.bias is not None and p.bias not in params)
        for s in subs + stopped
        for p in s.projections
    ):
        return None
    refusals = [replace(r, row=move(r.row), layer=move(r.layer)) for r in first.roles.refusals]
    return RecognisedBlock(layer, nodes, BlockRoles(subs, refusals, stopped=stopped))


@dataclass(frozen=True)
class _Linear:
    node: int  # the matmul/addmm graph node
    weight: int  # the weight's graph node
    fqn: str
    operand: int  # which operand the weight is
    transposed: bool
    bias: str | None


def recognise_block(
    graph: nx.DiGraph,
    nodes: frozenset[int],
    params: dict[str, tuple[list[int], str]],
    constants: frozenset[int],
    view: nx.DiGraph | None = None,
) -> BlockRoles:
    """The sub-layers of one block (module docstring)."""
    view = compute_view(graph, nodes, constants) if view is None else view
    linears = _linears(graph, view, params)
    by_node = {lin.node: lin for lin in linears}
    mesh = paddle.distributed.ProcessMesh(list(range(REPLAY_MP)), dim_names=["mp"])
    result = BlockRoles()
    placed: dict[str, Dist] = {}
    gathered: set[str] = set()
    baseline, _ = _implicit(graph, nodes, placed, mesh, constants, gathered)
    result.replays += 1
    assigned: set[int] = set()
    # Rows are tried last first: a group nested in the columns of another (multi-head latent
    # attention's kv_a_proj -> kv_a_layernorm -> kv_b_proj, inside the attention o_proj contracts)
    # must not take their projections before the group around it is tried.
    for row in reversed(linears):
        if row.node in assigned:
            continue
        feeding = _feeding_linears(view, row, by_node)
        if not feeding or assigned & {c.node for c in feeding}:
            continue
        columns = sorted(feeding, key=lambda c: c.node)
        sub = _sublayer(graph, view, nodes, columns, row, params)
        whole = {c.weight for c in sub.columns if c.role == "replicate"}
        group, columns = columns, [c for c in columns if c.fqn not in whole]  # columns: the ones split
        fused = {c.layer for c in sub.columns if c.fused > 1 and c.role == "column"}
        # A fused column whose own layer never runs its forward (``F.linear(x, self.qkv.weight)``):
        # no post-hook can gather its output, so the global view cannot split the group. Replayed
        # with its output taken whole right after the product, as a hook would, a group the rest of
        # which splits is a local-view candidate (a local view needs no gather), refused here.
        unhookable = [c for c in columns if _owner(c.fqn) in fused and not _hookable(graph, c)]
        hooked = fused - {_owner(c.fqn) for c in unhookable}
        trial = {**placed, **_dists(params, columns, row)}
        at = frozenset(c.node for c in unhookable)
        problems, ruleless = _implicit(graph, nodes, trial, mesh, constants, gathered | hooked, at)
        result.replays += 1
        if set(problems) - set(baseline) and not unhookable:
            extra, (problems, ruleless) = _try_gathers(
                graph, nodes, trial, mesh, constants, gathered | fused, columns, baseline, problems, ruleless, result
            )
            sub = _mark_fused(sub, extra)
            fused |= extra
        new = set(problems) - set(baseline)
        if new or unhookable:
            if unhookable:
                refusal = Refusal(_owner(row.fqn), UNHOOKABLE, _owner(unhookable[0].fqn))
            else:
                first = graph.nodes[min(new)[0]]
                refusal = Refusal(_owner(row.fqn), short_op(first["op"]), first["layer"])
            if {node for node, _ in new} <= ruleless | _layout_nodes(graph, new):  # a local view may split it
                result.stopped.append(replace(sub, stopped_by=refusal.op))
            result.refusals.append(refusal)
            continue
        placed, baseline = trial, problems
        gathered |= fused
        assigned |= {row.node} | {c.node for c in group}
        result.sublayers.append(sub)
    result.sublayers.reverse()  # program order
    result.stopped.reverse()
    # a projection refused as a row but split in another group needs no note
    split = {p.layer for s in result.sublayers for p in s.projections}
    result.refusals = [r for r in result.refusals if r.row not in split]
    # a stopped group sharing a projection with a split group or an earlier stopped one is no
    # local view: one placement per projection
    stopped, taken = [], set(split)
    for sub in result.stopped:
        if not taken & {p.layer for p in sub.projections}:
            stopped.append(sub)
            taken |= {p.layer for p in sub.projections}
    result.stopped = stopped
    local = {sub.row.layer for sub in stopped}
    result.refusals = [replace(r, local_view=r.row in local) for r in result.refusals]
    return result


# -- finding projections and their groups ------------------------------------------------------------


def _linears(graph: nx.DiGraph, view: nx.DiGraph, params) -> list[_Linear]:
    """Projections in program order: a matmul/addmm one of whose operands is a 2-D parameter."""
    found = []
    for node in sorted(view):
        if view.nodes[node]["op"] not in LINEAR_OPS:
            continue
        weights = [
            p
            for p in view.predecessors(node)
            if view.nodes[p]["op"] == PARAM and view.nodes[p]["param"] and len(params[view.nodes[p]["param"]][0]) == 2
        ]
        if len(weights) != 1:
            continue
        weight = weights[0]
        operand, transposed = weight_use(graph, weight, node)
        found.append(_Linear(node, weight, view.nodes[weight]["param"], operand, transposed, _bias(graph, view, node)))
    return found


def projection_weights(graph: nx.DiGraph, nodes: frozenset[int], params) -> frozenset[str]:
    """The weights (FQNs) of the projections among ``nodes``: what :func:`recognise_block` may
    give a role."""
    view = compute_view(graph, nodes, constant_nodes(graph))
    return frozenset(lin.fqn for lin in _linears(graph, view, params))


def weight_use(graph: nx.DiGraph, weight: int, matmul: int) -> tuple[int, bool]:
    """``(operand, transposed)``: which factor of the product the weight is (0 left, 1 right:
    ``addmm(bias, x, W)``'s ``W`` is 1), or which operand of another op (an embedding's lookup),
    and whether it arrives transposed (the product's transpose flags and 2-D ``transpose`` ops on
    the way combined)."""
    path = nx.shortest_path(graph, weight, matmul)
    flips = sum(
        1
        for n in path[1:-1]
        if short_op(graph.nodes[n]["op"]) == "transpose" and graph.nodes[n]["attrs"].get("perm") == [1, 0]
    )
    operand = min(o for o, (p, _) in operand_sources(graph, matmul).items() if p == path[-2])
    product = op(graph.nodes[matmul]["op"]).product
    if product is not None and product.factors is not None:
        operand = product.factors.index(operand)
        if product.transposes is not None:
            flips += bool(graph.nodes[matmul]["attrs"].get(product.transposes[operand]))
    return operand, bool(flips % 2)


@overload
def split_dim(role: Literal["column", "row"], operand: int, transposed: bool) -> int: ...
@overload
def split_dim(role: str, operand: int, transposed: bool) -> int | None: ...
def split_dim(role: str, operand: int, transposed: bool) -> int | None:
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


def projection_uses(graph: nx.DiGraph) -> dict[str, tuple[int, int]]:
    """``{weight FQN: (parameter node, first linear product it reaches through
    :data:`~autodist.planner.ops.WEIGHT_VIEW_OPS`)}``,
    computed once per graph."""
    if graph not in _USES:
        _USES[graph] = _projection_uses(graph)
    return _USES[graph]


_USES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _projection_uses(graph: nx.DiGraph) -> dict[str, tuple[int, int]]:
    uses = {}
    for node, data in graph.nodes(data=True):
        if data["param"] is None:
            continue
        frontier, seen = sorted(graph.successors(node)), set()
        while frontier:
            nxt = frontier.pop(0)
            if nxt in seen:
                continue
            seen.add(nxt)
            if short_op(graph.nodes[nxt]["op"]) in LINEAR_OPS:
                uses[data["param"]] = (node, nxt)
                break
            if short_op(graph.nodes[nxt]["op"]) in WEIGHT_VIEW_OPS:
                frontier = sorted(frontier + list(graph.successors(nxt)))
    return uses


def sliced_weights(graph: nx.DiGraph) -> list[str]:
    """The 2-D parameters (FQNs) a product multiplies by in slices (a cut op between the
    parameter and the product): ppdet's ``MultiHeadAttention`` projects q, k and v by
    ``F.linear(x, self.in_proj_weight[:, i * d:(i + 1) * d])``. Such a product is no projection
    (:func:`_linears` takes a parameter read whole), so the planner splits none of its slices.

    >>> g = nx.DiGraph()
    >>> g.add_node(0, op="builtin.parameter", param="attn.in_proj_weight", shapes=[[8, 24]])
    >>> g.add_node(1, op="pd_op.slice", param=None, shapes=[[8, 8]])
    >>> g.add_node(2, op="pd_op.matmul", param=None, shapes=[[2, 5, 8]])
    >>> g.add_edge(0, 1); g.add_edge(1, 2)
    >>> sliced_weights(g)
    ['attn.in_proj_weight']
    """
    found = []
    for node, data in graph.nodes(data=True):
        shapes = data["shapes"] or [None]
        if data["param"] is None or not shapes[0] or len(shapes[0]) != 2:
            continue
        cuts = [c for c in graph.successors(node) if short_op(graph.nodes[c]["op"]) in CUT_OPS]
        if any(short_op(graph.nodes[p]["op"]) in LINEAR_OPS for c in cuts for p in graph.successors(c)):
            found.append(data["param"])
    return found


def token_mixing_projection(graph: nx.DiGraph, nodes: frozenset[int], weights: list[str]) -> str | None:
    """The first of ``weights`` whose projection runs over another axis than the block's tokens
    (an MLP-Mixer's token-mixing MLP: its input rows are not the block input's rows), or None.
    Sequence parallelism splits the tokens between blocks, which such a projection contracts."""

    def rows(shape) -> int | None:
        if not shape or any(d <= 0 for d in shape):
            return None
        return math.prod(shape) // shape[-1]

    # the residual stream: the block's last value used outside it (masks and tables come in, too)
    outputs = sorted((u, d["result"]) for u, v, d in graph.out_edges(nodes, data=True) if v not in nodes)
    block_rows = rows(graph.nodes[outputs[-1][0]]["shapes"][outputs[-1][1]]) if outputs else None
    uses = projection_uses(graph)
    for weight in weights:
        if weight not in uses:
            continue
        weight_node, matmul = uses[weight]
        operand, transposed = weight_use(graph, weight_node, matmul)
        slots = _factors(graph, matmul)
        assert slots is not None, "a linear's factors are its operands"
        x_operand = slots[1 - operand]
        x = operand_sources(graph, matmul).get(x_operand)
        shape = graph.nodes[x[0]]["shapes"][x[1]] if x is not None else None
        if block_rows is not None and rows(shape) is not None and rows(shape) != block_rows and operand == 1:
            return weight.rpartition(".")[0]
    return None


def _bias(graph: nx.DiGraph, view: nx.DiGraph, node: int) -> str | None:
    """The 1-D parameter added to the projection's output (``addmm``'s input, or an ``add``)."""
    if view.nodes[node]["op"] == "addmm":
        params = [
            p for p in view.predecessors(node) if view.nodes[p]["op"] == PARAM and 0 in view.edges[p, node]["operands"]
        ]
        return view.nodes[params[0]]["param"] if params else None
    for succ in view.successors(node):
        if view.nodes[succ]["op"] != "add":
            continue
        others = [p for p in view.predecessors(succ) if p != node]
        if len(others) == 1 and view.nodes[others[0]]["op"] == PARAM and view.nodes[others[0]]["param"]:
            shape = graph.nodes[others[0]]["shapes"][0]
            if len(shape) == 1:
                return view.nodes[others[0]]["param"]
    return None


def _feeding_linears(view: nx.DiGraph, row: _Linear, by_node: dict[int, _Linear]) -> list[_Linear]:
    """Projections whose output reaches ``row``'s input without passing another projection."""
    start = [p for p in view.predecessors(row.node) if p != row.weight and view.nodes[p]["op"] != PARAM]
    seen, stack, found = set(start), list(start), []
    while stack:
        node = stack.pop()
        if node in by_node:
            found.append(by_node[node])
            continue
        for pred in view.predecessors(node):
            if pred not in seen and view.nodes[pred]["op"] not in ("input", PARAM):
                seen.add(pred)
                stack.append(pred)
    return found


def _owner(fqn: str) -> str:
    return fqn.rpartition(".")[0]


def _dists(params, columns: list[_Linear], row: _Linear) -> dict[str, Dist]:
    dists = {}
    sides: list[tuple[_Linear, Literal["column", "row"]]] = [(c, "column") for c in columns] + [(row, "row")]
    for lin, role in sides:
        shape = tuple(params[lin.fqn][0])
        dims = [-1, -1]
        dims[split_dim(role, lin.operand, lin.transposed)] = 0
        dists[lin.fqn] = Dist(shape, tuple(dims))
        if lin.bias is not None:
            dists[lin.bias] = Dist(tuple(params[lin.bias][0]), (0,) if role == "column" else (-1,))
    return dists


# -- the SPMD check ---------------------------------------------------------------------------------------


def _implicit(
    graph, nodes, weights, mesh, constants, gathered, at: frozenset[int] = frozenset()
) -> tuple[list[tuple[int, int]], set[int]]:
    """(node, operand) of every communication Paddle would add on its own, the outputs of the
    ``gathered`` layers and of the ops ``at`` taken whole; ``(node, -1)`` for
    a value that leaves the block split (the next block and the layers after the blocks expect
    whole values: a split has to end inside the block that starts it). And the replay's ops with
    no SPMD rule (:attr:`.spmd.Replay.ruleless`)."""
    replay = Replay(graph, nodes, weights, mesh, constants, frozenset(gathered), at)
    problems = {
        (r.node, r.operand)
        for r in replay.run()
        if r.collective is not None and not is_planned(graph, r) and not is_statistic(graph, r)
    }
    for (node, result), dist in replay.values.items():
        if isinstance(dist, list) or not any(
            v not in nodes and d["result"] == result for _, v, d in graph.out_edges(node, data=True)
        ):
            continue
        if any(d == 0 for d in dist.dims) or (dist.partial and not _from_projection(graph, dist)):
            problems.add((node, -1))
    return sorted(problems), replay.ruleless


def _layout_nodes(graph: nx.DiGraph, problems: set[tuple[int, int]]) -> set[int]:
    """The ops among ``problems`` (:func:`_implicit`) that only move values (layout ops) and where
    Paddle would reshard an operand (not a value leaving the block split)."""
    return {node for node, operand in problems if operand >= 0 and short_op(graph.nodes[node]["op"]) in LAYOUT_OPS}


def _from_projection(graph: nx.DiGraph, dist: Dist) -> bool:
    return dist.partial_source is not None and short_op(graph.nodes[dist.partial_source]["op"]) in LINEAR_OPS


def _try_gathers(graph, nodes, weights, mesh, constants, gathered, columns, baseline, problems, ruleless, result):
    """A column whose output is cut into segments (fused ``q|k|v``, ``gate|up``) where the split
    reaches the cut: gather its output with a post-hook, as the plan will, and replay.
    ``(gathered layers, (problems, ruleless))`` (:func:`_implicit`); nothing gathered when no
    problem is such a cut."""
    new = {node for node, _ in set(problems) - set(baseline)}
    fused = [c for c in columns if _hookable(graph, c) and _segment_cuts(graph, nodes, c.node) & new]
    if not fused:
        return set(), (problems, ruleless)
    chosen = {_owner(c.fqn) for c in fused}
    result.replays += 1
    return chosen, _implicit(graph, nodes, weights, mesh, constants, gathered | chosen)


def _segment_cuts(graph: nx.DiGraph, nodes: frozenset[int], source: int, cut_ops=SEGMENT_OPS) -> set[int]:
    """The ops (of ``cut_ops``) that cut ``source``'s output into pieces, reached through layout
    ops and a bias add."""
    seen, stack, cuts = {source}, [source], set()
    while stack:
        for succ in graph.successors(stack.pop()):
            if succ in seen or succ not in nodes:
                continue
            seen.add(succ)
            op = short_op(graph.nodes[succ]["op"])
            if op in cut_ops:
                cuts.add(succ)
            if op in LAYOUT_OPS or op == "add" or graph.nodes[succ]["op"].startswith("builtin."):
                stack.append(succ)
    return cuts


def _hookable(graph: nx.DiGraph, lin: _Linear) -> bool:
    """A post-hook can gather the projection's output: its own layer (a Linear, a Conv1D) ends
    with it, i.e. the layer's last op is the projection or follows from it alone."""
    layer = _owner(lin.fqn)
    own = [n for n in graph if graph.nodes[n]["layer"] == layer and graph.nodes[n]["op"] != "builtin.parameter"]
    return bool(own) and (max(own) == lin.node or lin.node in nx.ancestors(graph, max(own)))


# -- naming what was found ------------------------------------------------------------------------------


def _sublayer(graph, view, nodes, columns: list[_Linear], row: _Linear, params) -> SubLayer:
    """Name the group: an attention if a softmax (or a fused attention op) lies between columns
    and row, an MLP otherwise; a column whose pieces take different roles (q, k and v; gate and
    up) is a fused projection. A projection called twice (DeBERTa's ``query_proj`` of the hidden
    states and of the relative-position table) is one column, named by its first call."""
    region = set().union(*(nx.descendants(view, c.node) for c in columns)) & nx.ancestors(view, row.node)
    columns = [c for i, c in enumerate(columns) if c.fqn not in {d.fqn for d in columns[:i]}]
    scores = [n for n in sorted(region) if view.nodes[n]["op"] in PRODUCT_OPS and not _has_param(view, n)]
    fused_ops = [n for n in sorted(region) if view.nodes[n]["op"] in FUSED_ATTENTION_OPS]
    softmax = any(view.nodes[n]["op"] == "softmax" for n in region)
    out_features = {c.node: params[c.fqn][0][split_dim("column", c.operand, c.transposed)] for c in columns}
    if (softmax and scores) or fused_ops:
        return _attention(graph, view, nodes, columns, row, out_features, scores, fused_ops)
    names = _mlp_names(graph, view, nodes, columns, region)
    projections = tuple(
        _projection(c, "column", names[c.node], 2 if names[c.node] == "gate_up" else 1) for c in columns
    )
    gated = set(names.values()) in ({"gate", "up"}, {"gate_up"})
    first = out_features[columns[0].node]
    return SubLayer(
        "mlp",
        projections,
        _projection(row, "row", "down" if gated else "fc_out", 1),
        intermediate_size=first // 2 if names[columns[0].node] == "gate_up" else first,
    )


def _mark_fused(sub: SubLayer, layers: set[str]) -> SubLayer:
    """Columns the replay showed are cut into segments (gathered) count as fused, two at least."""
    return replace(
        sub, columns=tuple(replace(c, fused=max(c.fused, 2)) if c.layer in layers else c for c in sub.columns)
    )


def _has_param(view: nx.DiGraph, node: int) -> bool:
    return any(view.nodes[p]["op"] == PARAM for p in view.predecessors(node))


def _reaches(view: nx.DiGraph, source: int, target: int, operand: int) -> bool:
    """``source``'s value reaches operand ``operand`` of ``target``."""
    return any(
        operand in view.edges[p, target]["operands"] and (p == source or nx.has_path(view, source, p))
        for p in view.predecessors(target)
    )


def _attention(graph, view, nodes, columns, row, out_features, scores, fused_ops) -> SubLayer:
    if fused_ops:
        core = fused_ops[0]
        q_shape = graph.nodes[_operand(graph, core, 0)]["shapes"][0]
        num_heads, head_dim = q_shape[-2], q_shape[-1]
        # the value's own head width where the kernel takes it apart (not packed with q and k)
        source = operand_sources(graph, core).get(2)
        value = graph.nodes[source[0]]["shapes"][source[1]] if source else None
        value_dim = value[-1] if value and len(value) == len(q_shape) else head_dim
        roles = {
            c.node: "".join(n for n, o in (("q", 0), ("k", 1), ("v", 2)) if _reaches(view, c.node, core, o))
            for c in columns
        }
    else:
        core = scores[0]
        q_shape = graph.nodes[_product_input(graph, core, 0)]["shapes"][0]
        # the row projection's output has the query's tokens (rows), whatever the columns read
        num_heads = head_count(graph.nodes[core]["shapes"][0], graph.nodes[row.node]["shapes"][0])
        head_dim = q_shape[-1]
        context = next((n for n in scores[1:] if nx.has_path(view, core, n)), None)
        # a value head may be wider than a query's (Perceiver's v_channels): its own last dim
        value_dim = graph.nodes[_product_input(graph, context, 1)]["shapes"][0][-1] if context else head_dim
        roles = {
            c.node: "".join(
                n
                for n, target, o in (("q", core, 0), ("k", core, 1), ("v", context, 1))
                if target is not None and _feeds(graph, view, c.node, target, o)
            )
            for c in columns
        }
    latent = _latent_projections(view, columns)
    kv_heads = num_heads
    for c in columns:
        name = roles[c.node]
        if c.node in latent:
            continue
        width = _head_width(graph, nodes, c) if _up_projection(view, c, latent) else None
        if width:
            kv_heads = out_features[c.node] // width
        elif name in ("k", "v", "kv"):
            kv_heads = out_features[c.node] // ((head_dim if "k" in name else 0) + (value_dim if "v" in name else 0))
        elif name == "qkv":
            kv_heads = (out_features[c.node] - num_heads * head_dim) // (head_dim + value_dim)
    # Fewer KV heads than the replay's ranks can share (one KV head: multi-query attention): K/V
    # stay whole on every rank and only Q is split, as Megatron and HF do.
    whole_kv = kv_heads % REPLAY_MP != 0 and num_heads % REPLAY_MP == 0
    projections = tuple(
        replace(
            _projection(
                c,
                "replicate" if c.node in latent or (whole_kv and roles[c.node] in ("k", "v", "kv")) else "column",
                "latent" if c.node in latent else roles[c.node] or "q",
                1 if _up_projection(view, c, latent) else max(len(roles[c.node]), 1),
            ),
            groups=fused_groups(graph, nodes, c.node) if len(roles[c.node]) > 1 else 1,
        )
        for c in columns
    )
    o = _projection(row, "row", "o", 1)
    return SubLayer("attention", projections, o, num_heads=num_heads, num_kv_heads=kv_heads, head_dim=head_dim)


def fused_groups(graph: nx.DiGraph, nodes: frozenset[int], column: int) -> int:
    """How many groups a fused column's output is reshaped into (its last dim made two, ``[...,
    groups, width / groups]``) before it is cut along that last dim into its projections; 1 when
    it is cut whole. HF CodeGen's ``qkv_proj`` ``[b, s, 192]`` becomes ``[b, s, 4, 48]``
    (``mp_num = 4``), each group cut into its query, value and key: 4 groups; GPT-NeoX's
    ``query_key_value`` becomes ``[b, s, heads, 3 * head_dim]``, cut into q, k and v: one group
    per head. Which layout a local view takes from it is :func:`.reshards.local_weights`'s.

    >>> g = nx.DiGraph()
    >>> g.add_node(0, op="pd_op.matmul", shapes=[[2, 5, 24]])
    >>> g.add_node(1, op="pd_op.reshape", shapes=[[2, 5, 4, 6]])
    >>> g.add_node(2, op="pd_op.split", shapes=[None], consts={2: 3.0}, attrs={})
    >>> g.add_edge(0, 1, operand=0, result=0); g.add_edge(1, 2, operand=0, result=0)
    >>> fused_groups(g, frozenset(g), 0)
    4
    """
    for cut in sorted(_segment_cuts(graph, nodes, column, CUT_OPS)):
        source = _operand(graph, cut, 0)
        if short_op(graph.nodes[source]["op"]) != "reshape" or source not in graph.successors(column):
            continue
        before = graph.nodes[column]["shapes"][0]
        after = graph.nodes[source]["shapes"][0]
        if (
            len(after) == len(before) + 1
            and after[:-2] == before[:-1]
            and after[-2] > 1
            and after[-2] * after[-1] == before[-1]
            and _cut_axis(graph.nodes[cut], len(after)) == len(after) - 1
        ):
            return after[-2]
    return 1


def _cut_axis(data: dict, rank: int) -> int | None:
    """The axis a cut op (:data:`~autodist.planner.ops.CUT_OPS`) cuts along, None when the graph
    does not say: where the catalogue's ``cut_axis`` says (``split``'s axis operand, a slice's
    one axis)."""
    where, consts, attrs = op(short_op(data["op"])).cut_axis, data.get("consts", {}), data.get("attrs", {})
    axis = consts.get(where) if isinstance(where, int) else None
    if where == "axes" and len(attrs.get("axes", [])) == 1:
        axis = attrs["axes"][0]
    if axis is None or isinstance(axis, list):
        return None
    return int(axis) % rank


def _latent_projections(view: nx.DiGraph, columns: list[_Linear]) -> set[int]:
    """The columns whose output another column of the group contracts (multi-head latent
    attention's ``kv_a_proj_with_mqa``, whose latent ``kv_b_proj`` projects up to the heads):
    split by columns, that column would need the latent gathered first, so they stay whole on
    every rank, as Megatron keeps them (the norm between them runs whole on the small latent)."""
    return {c.node for c in columns if any(o is not c and nx.has_path(view, c.node, o.node) for o in columns)}


def _up_projection(view: nx.DiGraph, column: _Linear, latent: set[int]) -> bool:
    """``column`` projects a latent (:func:`_latent_projections`) up to the heads."""
    return column.node not in latent and any(nx.has_path(view, a, column.node) for a in latent)


def _head_width(graph: nx.DiGraph, nodes: frozenset[int], column: _Linear) -> int | None:
    """The features an up-projection gives each head: the last dim its output is reshaped to
    before it is cut into the head's pieces (``kv_b_proj``'s ``k_nope | v`` per head); None when
    its output is not cut."""
    cuts = sorted(_segment_cuts(graph, nodes, column.node, CUT_OPS))
    return graph.nodes[_operand(graph, cuts[0], 0)]["shapes"][0][-1] if cuts else None


def head_count(scores: list[int], tokens: list[int]) -> int:
    """The heads of an attention whose scores (the product of q and k) have shape ``scores``, the
    query's tokens being the rows of ``tokens`` (all dims but the last: the row projection's
    output, ``[batch, seq, hidden]`` or ``[batch * seq, hidden]``). Each head scores each query
    token against each key, so the heads are the scores' elements over (tokens x keys, the last
    dim), however the heads are laid out: on their own dim, merged with the batch
    (``paddle.bmm`` over ``[batch * heads, q, k]``, HF OPT, GPT-NeoX) or with the query
    (``[batch, q * heads, k]``, HF GPT-BigCode's multi-query ``baddbmm``). A dynamic dim (-1: the
    batch, the sequence) counts as 1 on both sides.

    >>> head_count([2, 4, 8, 16], [2, 8, 32])  # [batch, heads, q, k]
    4
    >>> head_count([2 * 4, 8, 16], [2, 8, 32]), head_count([2, 8 * 4, 16], [2 * 8, 32])
    (4, 4)
    >>> head_count([-1, 4, 8, 16], [-1, 8, 32]), head_count([2, 4, -1, -1], [2, -1, 32])
    (4, 4)
    """

    def known(dims: list[int]) -> int:
        return math.prod(d for d in dims if d != -1)

    return known(scores) // (known(tokens[:-1]) * known(scores[-1:]))


def _operand(graph: nx.DiGraph, node: int, operand: int) -> int:
    return operand_sources(graph, node)[operand][0]


def _factors(graph: nx.DiGraph, product: int) -> tuple[int, int] | None:
    """A product's factors' operand slots (:attr:`~autodist.planner.ops.Product.factors`: None
    for an einsum, whose factors are items of one operand)."""
    found = op(graph.nodes[product]["op"]).product
    assert isinstance(found, Product), f"{graph.nodes[product]['op']} is no product"
    return found.factors


def _product_input(graph: nx.DiGraph, product: int, index: int) -> int:
    """The node of a product's ``index``-th factor (:func:`_factors`): a matmul's operand,
    ``baddbmm``'s after the tensor it adds, an einsum's item of the one list it takes (a
    ``builtin.combine``)."""
    slots = _factors(graph, product)
    if slots is None:
        return _operand(graph, _operand(graph, product, 0), index)
    return _operand(graph, product, slots[index])


def _feeds(graph: nx.DiGraph, view: nx.DiGraph, source: int, product: int, index: int) -> bool:
    """``source``'s value reaches the ``index``-th factor of ``product`` (:func:`_reaches`; an
    einsum's factors are items of one operand, told apart in the graph)."""
    slots = _factors(graph, product)
    if slots is None:
        node = _product_input(graph, product, index)
        return node == source or nx.has_path(graph, source, node)
    return _reaches(view, source, product, slots[index])


def _mlp_names(graph, view, nodes, columns, region) -> dict[int, str]:
    """``fc_in`` for one plain column; ``gate_up`` for one column cut in two whose pieces meet
    at a product; ``gate`` (through the activation) and ``up`` (straight to the product)."""
    products = [n for n in region if view.nodes[n]["op"] == "multiply"]
    if len(columns) == 1:
        column = columns[0]
        cut = _segment_cuts(graph, nodes, column.node, CUT_OPS)
        both = any(_reaches(view, column.node, m, 0) and _reaches(view, column.node, m, 1) for m in products)
        return {column.node: "gate_up" if cut and both else "fc_in"}
    if len(columns) == 2:
        a, b = columns
        a_direct = any(
            view.nodes[s]["op"] == "multiply" and nx.has_path(view, b.node, s) for s in view.successors(a.node)
        )
        return {a.node: "up", b.node: "gate"} if a_direct else {a.node: "gate", b.node: "up"}
    return {c.node: f"in{i}" for i, c in enumerate(columns)}


def _projection(lin: _Linear, role: Literal["column", "row", "replicate"], name: str, fused: int) -> Projection:
    return Projection(
        _owner(lin.fqn), lin.fqn, lin.bias, role, split_dim(role, lin.operand, lin.transposed), fused, name
    )
