"""Derive a :class:`ModelCost` from the traced graph: FLOPs, saved activations, collectives.

Nothing here knows an architecture. Per block (the node set the matcher assigned to it):

- FLOPs: every product of two factors (the op catalogue's ``product`` role, planner/ops.py:
  ``matmul``, ``addmm``, ``bmm``, ``baddbmm``, ``einsum``) costs 2 x (output elements) x
  (elements contracted). A product with a weight scales with the tokens (b*s); one of two
  activations (attention scores, scores x V) with b*s^2. Convolutions and fused attention ops
  are counted too, by their catalogue rules; elementwise ops are not (they are memory-bound and
  small next to the matmuls).
- Saved activations: what each op's backward kernel reads (``matmul_grad(x, y)``,
  ``softmax_grad(out)``, ``gelu_grad(x)``, ``dropout_grad(mask)``, ``layer_norm_grad(x, mean,
  var)`` ... the catalogue's bytes rules), each tensor counted once however many ops read it, parameters
  and constants excluded. Floating-point tensors are counted in elements (priced at the
  training dtype), boolean/uint8 masks at one byte.
- Per-rank matmul shapes: each matmul with a weight as a :class:`Gemm` (n, k and how mp splits
  it), so :mod:`autodist.planner.cost.compute` can price it by shape.
- Memory-bound ops: every op that is not a matmul, a view or a constant moves the elements it
  reads and writes (as traced, unfused) through device memory; counted per token by where the
  result sits (outside or inside the tensor-parallel region, attention-score shaped, or
  logits-shaped on the edges).
- Tensor-parallel region: a value is *inside* when it descends from a column-parallel
  linear and has not yet passed a row-parallel one; those are split over mp, the rest not
  (Korthikanti et al.). Forward all-reduces: row-parallel outputs; backward all-reduces: the
  distinct inputs of column-parallel linears, and of any other op that reads a value needing a
  gradient whole beside split ones (Megatron's ``f``: a per-token input every rank's heads read,
  a local view's ``CallInput.gradient`` "whole"). A value leaving a gathered layer (a fused
  projection the plan gathers, not run as a local view) is whole again, all-gathered once; what
  reads it runs whole on every rank (:func:`walk_nodes`).

Dynamic dims (-1) are counted as 1, consistently with the traced token count, so coefficients
come out per token either way.

Example::

    >>> cost = model_cost(analysis)                           # doctest: +SKIP
    >>> cost.blocks[0].flops_per_token == 24 * h * h          # doctest: +SKIP
    True
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Callable, Iterable

import networkx as nx

from autodist.schemas.vocabulary import FLOAT_DTYPES, TrainingDType, training_dtype

from autodist.planner.cost.blocks import BlockCost, EdgeCost, Gemm, ModelCost, Moved, Saved
from autodist.planner.cost.step_time import Implicit
from autodist.planner.errors import PlannerError
from autodist.planner.ops import WEIGHT_VIEW_OPS, Op, op, short_op

if TYPE_CHECKING:
    from autodist.planner.recognise.analysis import ModelAnalysis
    from autodist.schemas import Kernels, LocalWeight

Value = tuple[int, int]  # (producing node, result index)

_MASK_DTYPES = frozenset({"bool", "uint8", "int8"})


@dataclass(frozen=True)
class Roles:
    """Which parameters of a block are split over mp, and how; which layers' outputs are gathered."""

    column: frozenset[str]  # weights of column-parallel linears
    row: frozenset[str]  # weights of row-parallel linears
    split: frozenset[str]  # every parameter divided over mp (those weights and column biases)
    #: Layers of column-parallel linears whose output the plan gathers over mp as it leaves them
    #: (reshards.gathered_linears: a fused q|k|v or gate|up not run as a local view).
    gathered: frozenset[str] = frozenset()


class GraphFacts:
    """Per-value facts over the whole graph, computed once: shapes, weights, grad-needs."""

    def __init__(self, graph: nx.DiGraph):
        self.graph = graph
        self.order = list(nx.topological_sort(graph))
        self.position = {n: i for i, n in enumerate(self.order)}
        self.inputs: dict[int, dict[int, Value]] = {
            n: {d["operand"]: (u, d["result"]) for u, _, d in graph.in_edges(n, data=True)} for n in graph
        }
        self.weight_of: dict[Value, str] = {}  # value -> parameter FQN it is a view of
        self.needs_grad: set[Value] = set()
        for n in self.order:
            node = graph.nodes[n]
            if node["op"] == "builtin.parameter":
                if node["param"]:
                    self.weight_of[(n, 0)] = node["param"]
                    self.needs_grad.add((n, 0))
                continue
            sources = list(self.inputs[n].values())
            if short_op(node["op"]) in WEIGHT_VIEW_OPS and len(sources) == 1 and sources[0] in self.weight_of:
                self.weight_of[(n, 0)] = self.weight_of[sources[0]]
            if any(v in self.needs_grad for v in sources):
                for r, dtype in enumerate(node["dtypes"]):
                    if dtype in FLOAT_DTYPES or dtype is None:  # None: a vector (unbind, combine)
                        self.needs_grad.add((n, r))

    def shape(self, value: Value) -> list[int] | None:
        shapes = self.graph.nodes[value[0]]["shapes"]
        return shapes[value[1]] if value[1] < len(shapes) else None

    def known_shape(self, value: Value) -> list[int]:
        """The shape of an op's input or output that the walk prices (a traced op records one)."""
        shape = self.shape(value)
        if shape is None:
            raise ValueError(f"op {value[0]} has no recorded shape for its result {value[1]}")
        return shape

    def numel(self, value: Value) -> int:
        shape = self.shape(value)
        return math.prod(d if d > 0 else 1 for d in shape) if shape is not None else 0

    def dtype(self, value: Value) -> str | None:
        dtypes = self.graph.nodes[value[0]]["dtypes"]
        return dtypes[value[1]] if value[1] < len(dtypes) else None

    def is_activation(self, value: Value) -> bool:
        return value not in self.weight_of and self.graph.nodes[value[0]]["op"] != "builtin.parameter"

    def factors(self, n: int) -> tuple[Value, Value] | None:
        """The two values node ``n`` multiplies, when it is a product of two (the catalogue's
        :class:`~autodist.planner.ops.Product`: an einsum's are the items of its one list)."""
        product = op(self.graph.nodes[n]["op"]).product
        if product is None:
            return None
        inputs = self.inputs[n]
        if product.factors is None:
            listed = inputs.get(0)
            inputs = self.inputs[listed[0]] if listed is not None else {}
            return (inputs[0], inputs[1]) if sorted(inputs) == [0, 1] else None
        x, y = (inputs.get(i) for i in product.factors)
        return (x, y) if x is not None and y is not None else None

    def saved_by(self, n: int) -> list[Value]:
        """The activations node ``n``'s backward keeps (empty when nothing it reads needs grad),
        by its catalogue entry's bytes rule (:class:`~autodist.planner.ops.Op`)."""
        entry = op(self.graph.nodes[n]["op"])
        inputs = self.inputs[n]
        if not any(v in self.needs_grad for v in inputs.values()):
            return []
        saved: list[Value] = []
        if entry.cross:  # each operand (a product's each factor) for the other's gradient
            operands = dict(enumerate(self.factors(n) or ())) if entry.product else inputs
            for i, value in operands.items():
                if any(v in self.needs_grad for j, v in operands.items() if j != i):
                    saved.append(value)
            if entry.output_for is not None and inputs.get(entry.output_for) in self.needs_grad:
                saved.append((n, 0))
        kept_operands, kept_results = entry.saved
        saved += [inputs[i] for i in kept_operands if i in inputs]
        saved += [(n, r) for r in kept_results]
        return [v for v in saved if self.is_activation(v) and self.numel(v) > 0]


@dataclass
class _Walk:
    """What one pass over a set of nodes found, in traced units (not yet per token)."""

    flops_weight: float = 0.0
    flops_activation: float = 0.0
    flops_by_weight: dict[str, float] = field(default_factory=dict)
    saved: dict[Value, str] = field(default_factory=dict)  # -> "outside" | "inside" | "inside_seq"
    allreduce_fwd: float = 0.0
    allreduce_bwd: float = 0.0
    allreduce_fwd_count: int = 0
    allreduce_bwd_count: int = 0
    #: Values all-gathered over mp: forward, a gathered layer's outputs; backward, the gradients
    #: of the whole inputs of row-parallel linears (each its whole size).
    gathered_fwd: set[Value] = field(default_factory=set)
    gathered_bwd: set[Value] = field(default_factory=set)
    flops_activation_whole: float = 0.0  # of flops_activation: cores reading whole values
    gemms: list[tuple[str, int, int]] = field(default_factory=list)  # (weight, n, k)
    attention_matmuls: int = 0
    moved: dict[str, float] = field(default_factory=dict)  # where -> elements (traced units)
    #: Under flash attention: elements the fused cores read and write (q, k, v in, the output out),
    #: and the log-sum-exp rows they save (where -> floats).
    attention_io: float = 0.0
    lse: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Fusion:
    """Which kernels the walk prices fused (the plan's ``kernels``, planner/kernels.py).

    ``flash``: each attention core is one kernel. Its ops are the ones between the two matmuls of
    activations whose results are seq x seq shaped (scores, scale, mask, softmax, dropout), plus
    every op a call to a fused attention function added (``kernel`` == ``attention`` on the node:
    the causal mask it builds on CPU). They move no memory of their own and save nothing for
    backward; the kernel reads q, k, v and writes its output once (``attention_io``), and saves
    its output's log-sum-exp (one float per row of scores) besides the matmuls' own inputs.

    ``layers``: layers run as one fused kernel each (RMSNorm): their ops move the layer's input
    and output once, pay one op's fixed cost, and save the layer's input.
    """

    flash: bool = False
    layers: frozenset[str] = frozenset()


def walk_nodes(
    facts: GraphFacts,
    nodes: Iterable[int],
    roles: Roles | None = None,
    vocab: int | None = None,
    fusion: Fusion = Fusion(),
) -> _Walk:
    """FLOPs, saved tensors, matmul shapes, memory traffic and mp collectives of ``nodes`` (in
    topological order). ``vocab``: values whose last dim is this count as logits-shaped;
    ``fusion``: the kernels priced fused (:class:`Fusion`). Each op is priced by the handler of
    its role in the op catalogue (:class:`_Walker`).

    A value of a layer in ``roles.gathered`` leaves it whole (all-gathered once): what reads it
    outside that layer runs whole on every mp rank, an attention core too (its FLOPs in
    ``flops_activation_whole``), and a row-parallel linear reading a whole value gets its gradient
    split over mp, all-gathered in the backward (Paddle 3.3.1's ``matmul_grad`` with the input
    replicated and the weight ``Shard(0)``; the gather hook's own backward is a slice, measured
    with ``GLOG_v=4`` on 2 gloo ranks, docs/paddle-notes.md)."""
    return _Walker(facts, nodes, roles or Roles(frozenset(), frozenset(), frozenset()), vocab, fusion).run()


class _Walker:
    """One pass of :func:`walk_nodes`: the facts it gathers as it goes (which values are split
    over mp, which are attention-score shaped) and one handler per op role of the catalogue
    (:data:`~autodist.planner.ops.CATALOGUE`): products, convolutions, fused attention kernels,
    and every other op by the memory it moves. A handler returns whether the op's backward keeps
    tensors of its own (an op inside a flash kernel keeps none)."""

    def __init__(self, facts: GraphFacts, nodes: Iterable[int], roles: Roles, vocab: int | None, fusion: Fusion):
        self.facts, self.roles, self.vocab, self.fusion = facts, roles, vocab, fusion
        self.nodes = sorted(set(nodes), key=facts.position.__getitem__)
        layers = {n: facts.graph.nodes[n]["layer"] for n in self.nodes}
        #: Node -> the gathered layer it lies in ('' for none), and the fused layer it lies in.
        self.in_gathered = {n: _within(layers[n], roles.gathered) for n in self.nodes} if roles.gathered else {}
        self.fused_layer = {n: _within(layers[n], fusion.layers) for n in self.nodes} if fusion.layers else {}
        self.walk = _Walk()
        self.inside: set[Value] = set()  # in the tensor-parallel region
        self.quadratic: set[Value] = set()  # attention-score shaped (b * s * s)
        self.column_inputs: set[Value] = set()
        self.regions: dict[str, list[int]] = {}  # fused layer -> its ops, priced after the walk

    def run(self) -> _Walk:
        for n in self.nodes:
            self._step(n)
        for ops in self.regions.values():
            _fused_region(self.facts, ops, self.inside, self.quadratic, self.vocab, self.walk)
        self.walk.allreduce_bwd = float(sum(self.facts.numel(v) for v in self.column_inputs))
        self.walk.allreduce_bwd_count = len(self.column_inputs)
        return self.walk

    def split_for(self, n: int, values: Iterable[Value]) -> list[Value]:
        """The values split over mp as node ``n`` reads them: inside, and not leaving a gathered
        layer (one leaving it is all-gathered once, :attr:`_Walk.gathered_fwd`)."""
        found = []
        for v in values:
            if (
                v in self.inside
                and self.in_gathered.get(v[0])
                and self.in_gathered.get(v[0]) != self.in_gathered.get(n)
            ):
                self.walk.gathered_fwd.add(v)
            elif v in self.inside:
                found.append(v)
        return found

    def _step(self, n: int) -> None:
        entry = op(self.facts.graph.nodes[n]["op"])
        if self.fused_layer.get(n) and entry.role != "product":
            self.regions.setdefault(self.fused_layer[n], []).append(n)
            if self._split(n):
                self._mark_inside(n)
            return
        if _HANDLERS.get(entry.role, _Walker._memory)(self, n, entry):
            for value in self.facts.saved_by(n):
                if value in self.quadratic:
                    if not self.fusion.flash:  # a flash kernel keeps no scores
                        self.walk.saved[value] = "inside_seq"
                else:
                    self.walk.saved.setdefault(value, "inside" if self.split_for(n, [value]) else "outside")

    def _activations(self, n: int) -> list[Value]:
        return [v for v in self.facts.inputs[n].values() if self.facts.is_activation(v)]

    def _split(self, n: int) -> list[Value]:
        return self.split_for(n, self._activations(n))

    def _mark_inside(self, n: int) -> None:
        self.inside.update((n, r) for r in range(len(self.facts.graph.nodes[n]["shapes"])))

    def _product(self, n: int, entry: Op) -> bool:
        """A product of two factors (any spelling: ``matmul``, ``bmm``, ``baddbmm``, ``einsum``):
        a linear's when one factor is a weight, else an attention core's (scores or context)."""
        facts = self.facts
        factors = facts.factors(n)
        if factors is None or entry.product is None:  # a one-operand einsum: priced by what it moves
            return self._memory(n, entry)
        attrs, out = facts.graph.nodes[n]["attrs"], facts.known_shape((n, 0))
        shapes = [facts.known_shape(v) for v in factors]
        flops = entry.flops(attrs, shapes, out)
        acts = [v for v in factors if facts.is_activation(v)]
        split = self.split_for(n, acts)
        weight = next((facts.weight_of[v] for v in factors if v in facts.weight_of), None)
        if weight is None:
            self._core(n, factors, flops, acts, split)
            return True
        contracted = max(entry.product.contracted(attrs, *shapes), 1)
        walk = self.walk
        walk.gemms.append((weight, max(out[-1], 1), contracted))
        walk.flops_weight += flops
        walk.flops_by_weight[weight] = walk.flops_by_weight.get(weight, 0.0) + flops
        if weight in self.roles.column:
            self.inside.add((n, 0))
            self.column_inputs.update(acts)
        elif weight in self.roles.row:
            walk.allreduce_fwd += facts.numel((n, 0))
            walk.allreduce_fwd_count += 1
            walk.gathered_bwd.update(v for v in acts if v not in split)
        elif split:
            self.inside.add((n, 0))
        return True

    def _core(self, n: int, factors: tuple[Value, Value], flops: float, acts: list[Value], split: list[Value]) -> None:
        """A product of two activations: an attention's scores (its factors not score-shaped) or
        its context (the probabilities times V)."""
        facts, walk = self.facts, self.walk
        walk.flops_activation += flops
        walk.attention_matmuls += 1
        if split:
            self.inside.add((n, 0))
        else:
            walk.flops_activation_whole += flops
        scores = not any(v in self.quadratic for v in acts)
        if scores:
            self.quadratic.add((n, 0))
        if self.fusion.flash:  # q and k in (scores), or v in and the output out (context)
            io = [v for v in factors if v not in self.quadratic] + ([] if scores else [(n, 0)])
            walk.attention_io += sum(facts.numel(v) for v in io)
            if scores:  # the log-sum-exp per row of scores, saved for the backward
                where = "inside" if (n, 0) in self.inside else "outside"
                rows = facts.numel((n, 0)) / max(facts.known_shape((n, 0))[-1], 1)
                walk.lse[where] = walk.lse.get(where, 0.0) + rows

    def _convolution(self, n: int, entry: Op) -> bool:
        facts = self.facts
        weights = [facts.weight_of[v] for v in facts.inputs[n].values() if v in facts.weight_of]
        if not weights:
            return self._memory(n, entry)
        self._split(n)  # a value leaving a gathered layer is gathered for a convolution too
        flops = entry.flops(facts.graph.nodes[n]["attrs"], self._operand_shapes(n), facts.known_shape((n, 0)))
        self.walk.flops_weight += flops
        self.walk.flops_by_weight[weights[0]] = self.walk.flops_by_weight.get(weights[0], 0.0) + flops
        return True

    def _fused_attention(self, n: int, entry: Op) -> bool:
        """An attention core in one kernel (q, k, v in)."""
        inputs = self.facts.inputs[n]
        if 0 not in inputs or 1 not in inputs:
            return self._memory(n, entry)
        flops = entry.flops(self.facts.graph.nodes[n]["attrs"], self._operand_shapes(n), self.facts.known_shape((n, 0)))
        self.walk.flops_activation += flops
        if self._split(n):
            self._mark_inside(n)
        else:
            self.walk.flops_activation_whole += flops
        return True

    def _operand_shapes(self, n: int) -> list[list[int]]:
        inputs = self.facts.inputs[n]
        return [(self.facts.shape(inputs[i]) or []) if i in inputs else [] for i in range(max(inputs, default=-1) + 1)]

    def _memory(self, n: int, entry: Op) -> bool:
        """Any other op: it keeps its input's mp split and score shape, pays one op's fixed cost
        and moves the floats it reads and writes, unless it lies in a flash attention kernel."""
        facts, walk = self.facts, self.walk
        node = facts.graph.nodes[n]
        acts = self._activations(n)
        split = self.split_for(n, acts)
        if split:  # read whole beside split values (Megatron's f): its gradient all-reduced over mp
            self.column_inputs.update(v for v in acts if v not in split and v in facts.needs_grad)
        for r in range(len(node["shapes"])):
            if split:
                self.inside.add((n, r))
            if any(v in self.quadratic and facts.numel(v) == facts.numel((n, r)) for v in acts):
                self.quadratic.add((n, r))
        if self.fusion.flash and (node.get("kernel") == "attention" or any(v in self.quadratic for v in acts)):
            return False  # inside a fused attention core: no memory pass, op or saved tensor of its own
        if node["op"].startswith("builtin.") or "untimed" in entry.traits:
            return True
        walk.moved["ops"] = walk.moved.get("ops", 0) + 1  # every op pays the fixed cost
        if entry.moves and node["shapes"]:
            where = _moved_where(facts, (n, 0), self.inside, self.quadratic, self.vocab)
            inputs = facts.inputs[n].values()
            elements = sum(facts.numel(v) for v in inputs if facts.dtype(v) in FLOAT_DTYPES)
            elements += sum(
                facts.numel((n, r)) for r in range(len(node["shapes"])) if facts.dtype((n, r)) in FLOAT_DTYPES
            )
            walk.moved[where] = walk.moved.get(where, 0.0) + elements
        return True


#: The walk's handler of each op role (:class:`_Walker`); every other role moves memory.
_HANDLERS: dict[str, Callable[[_Walker, int, Op], bool]] = {
    "product": _Walker._product,
    "convolution": _Walker._convolution,
    "fused_attention": _Walker._fused_attention,
}


def _within(layer: str, layers: frozenset[str]) -> str:
    """The layer of ``layers`` that ``layer`` is (or lies inside), or ''.

    >>> _within("h.0.attn.c_attn", frozenset({"h.0.attn.c_attn"})), _within("h.0.attn", frozenset({"h.0.attn.c_attn"}))
    ('h.0.attn.c_attn', '')
    """
    return next((f for f in layers if layer == f or layer.startswith(f + ".")), "")


def _fused_region(
    facts: GraphFacts, ops: list[int], inside: set[Value], quadratic: set[Value], vocab: int | None, walk: _Walk
) -> None:
    """Price one fused layer's ops as one kernel (:class:`Fusion`): its float inputs from outside
    and its weights read once, its results used outside written once, one op's fixed cost; its
    activation inputs saved for the backward."""
    mine = set(ops)
    inputs = {v for n in ops for v in facts.inputs[n].values() if v[0] not in mine or v in facts.weight_of}
    outputs = {(n, d["result"]) for n in ops for _, m, d in facts.graph.out_edges(n, data=True) if m not in mine}
    floats = [v for v in inputs | outputs if facts.dtype(v) in FLOAT_DTYPES]
    where = _moved_where(facts, max(outputs, default=(ops[-1], 0)), inside, quadratic, vocab)
    walk.moved[where] = walk.moved.get(where, 0.0) + sum(facts.numel(v) for v in floats)
    walk.moved["ops"] = walk.moved.get("ops", 0) + 1
    if not any(v in facts.needs_grad for v in inputs):
        return
    for value in sorted(inputs):  # the backward reads the input, for its gradient or the weight's
        if facts.is_activation(value) and facts.dtype(value) in FLOAT_DTYPES and facts.numel(value) > 0:
            walk.saved.setdefault(value, "inside" if value in inside else "outside")


def _moved_where(facts: GraphFacts, value: Value, inside: set[Value], quadratic: set[Value], vocab: int | None) -> str:
    shape = facts.shape(value) or []
    if vocab and shape and shape[-1] == vocab:
        return "vocab"
    return "inside_seq" if value in quadratic else "inside" if value in inside else "outside"


def _moved(walk: _Walk, tokens: float, seq: float) -> Moved:
    return Moved(
        outside=walk.moved.get("outside", 0.0) / tokens,
        inside=walk.moved.get("inside", 0.0) / tokens,
        inside_seq=walk.moved.get("inside_seq", 0.0) / (tokens * seq),
        vocab=walk.moved.get("vocab", 0.0) / tokens,
        ops=int(walk.moved.get("ops", 0)),
    )


def _saved(facts: GraphFacts, walk: _Walk, kind: str, per: float) -> Saved:
    floats, masks = walk.lse.get(kind, 0.0), 0.0
    for value, where in walk.saved.items():
        if where != kind:
            continue
        dtype = facts.dtype(value)
        if dtype in FLOAT_DTYPES:
            floats += facts.numel(value)
        elif dtype in _MASK_DTYPES:
            masks += facts.numel(value)
    return Saved(floats / per, masks / per)


def block_cost(
    facts: GraphFacts,
    nodes: Iterable[int],
    layer: str,
    roles: Roles,
    params: dict[str, int],
    tokens: int,
    seq: int,
    fusion: Fusion = Fusion(),
    recomputed: str | None = None,
    local: frozenset[str] = frozenset(),
    **shape: Any,  # ints: the block's heads, head size, hidden and intermediate sizes
) -> BlockCost:
    """One block's :class:`BlockCost`. ``params``: numel of the block's parameters by FQN;
    ``tokens``/``seq``: the traced batch x sequence and sequence (dynamic dims as 1);
    ``shape``: ``num_heads``, ``num_kv_heads``, ``intermediate_size`` for the constraints, and
    and for an MoE block what :func:`_moe_cost` gives; ``fusion``: the kernels priced fused;
    ``recomputed``: the sub-layer selective recompute runs again (:func:`_selective`), ``local``
    the sub-layers run as local views."""
    nodes = set(nodes)
    walk = walk_nodes(facts, nodes, roles, fusion=fusion)
    outputs = [facts.numel((u, d["result"])) for u, v, d in facts.graph.out_edges(nodes, data=True) if v not in nodes]
    views = {fqn: n for fqn, n in params.items() if any(_under(fqn, view) for view in local)}
    return BlockCost(
        layer=layer,
        params_split=sum(n for fqn, n in params.items() if fqn in roles.split),
        largest_split=max((n for fqn, n in params.items() if fqn in roles.split), default=0),
        largest_whole=max((n for fqn, n in params.items() if fqn not in roles.split), default=0),
        params_whole=sum(n for fqn, n in params.items() if fqn not in roles.split),
        param_tensors=len(params),
        output_per_token=max(outputs, default=0) / tokens,
        view_params_split=sum(n for fqn, n in views.items() if fqn in roles.split),
        view_params_whole=sum(n for fqn, n in views.items() if fqn not in roles.split),
        view_param_tensors=len(views),
        selective=_selective(facts, nodes, walk, layer, recomputed, roles, tokens, seq, fusion, local),
        **_walked(facts, walk, roles, tokens, seq, fusion),
        **shape,
    )


def _walked(facts: GraphFacts, walk: _Walk, roles: Roles, tokens: int, seq: int, fusion: Fusion) -> dict[str, Any]:
    """The :class:`BlockCost` fields a walk gives (per token, or per token x sequence)."""
    return dict(
        flops_per_token=walk.flops_weight / tokens,
        flops_per_token_seq=walk.flops_activation / (tokens * seq),
        saved_outside=_saved(facts, walk, "outside", tokens),
        saved_inside=_saved(facts, walk, "inside", tokens),
        saved_inside_seq=_saved(facts, walk, "inside_seq", tokens * seq),
        allreduce_fwd_per_token=walk.allreduce_fwd / tokens,
        allreduce_bwd_per_token=walk.allreduce_bwd / tokens,
        allreduce_fwd_count=walk.allreduce_fwd_count,
        allreduce_bwd_count=walk.allreduce_bwd_count,
        gather_fwd_per_token=sum(facts.numel(v) for v in walk.gathered_fwd) / tokens,
        gather_bwd_per_token=sum(facts.numel(v) for v in walk.gathered_bwd) / tokens,
        gather_fwd_count=len(walk.gathered_fwd),
        gather_bwd_count=len(walk.gathered_bwd),
        core_whole=walk.flops_activation_whole / walk.flops_activation if walk.flops_activation else 0.0,
        gemms=tuple(
            Gemm(n, k, "column" if w in roles.column else "row" if w in roles.row else "none") for w, n, k in walk.gemms
        ),
        attention_matmuls=walk.attention_matmuls,
        moved=_moved(walk, tokens, seq),
        fused_attention=fusion.flash and walk.flops_activation > 0,
        attention_io_per_token=walk.attention_io / tokens,
    )


def _selective(
    facts: GraphFacts,
    nodes: set[int],
    walk: _Walk,
    block: str,
    recomputed: str | None,
    roles: Roles,
    tokens: int,
    seq: int,
    fusion: Fusion,
    local: frozenset[str],
) -> BlockCost | None:
    """What selective recompute of the sub-layer ``recomputed`` does (``BlockCost.selective``):
    its ops walked alone (the forward the backward runs again, with the collectives inside it:
    its fused projections' gathers, the sums of row-parallel outputs an op inside it reads
    (:func:`_summed_inside`); a local view's all-reduces run once, outside the recompute:
    applier/modes/local_calls.py ``_wrap``), and as its saved tensors what the block (``walk``)
    no longer keeps: each value its ops made and saved for their backward that no op after it
    saves too (its inputs, made before it, are what the recompute keeps)."""
    if recomputed is None:
        return None
    inner = {n for n in nodes if _under(facts.graph.nodes[n]["layer"], recomputed)}
    if not inner:
        return None
    kept = {value for n in nodes - inner for value in facts.saved_by(n)}
    alone = walk_nodes(facts, inner, roles, fusion=fusion)
    alone.saved = {value: where for value, where in walk.saved.items() if value[0] in inner and value not in kept}
    fields = _walked(facts, alone, roles, tokens, seq, fusion)
    summed, count = (0.0, 0) if recomputed in local else _summed_inside(facts, inner, roles)
    fields.update(allreduce_fwd_per_token=summed / tokens, allreduce_fwd_count=count)
    return BlockCost(layer=recomputed.removeprefix(block + "."), **fields)


def _summed_inside(facts: GraphFacts, inner: set[int], roles: Roles) -> tuple[float, int]:
    """(elements, collectives) of the row-parallel outputs among ``inner``'s ops that Paddle sums
    over mp inside them. A row projection's output is Partial over mp, and Paddle sums it (its
    ``PToR`` reshard) at the first op that reads it: inside, a bias add (the projection's own); a
    projection without bias hands it on Partial, summed by the residual add after the sub-layer.
    Measured on 2 gloo ranks with ``GLOG_v=3`` (docs/paddle-notes.md): a function run again by
    Paddle's recompute runs the sum again only in the first case."""
    elements, count = 0.0, 0
    for n in inner:
        factors = facts.factors(n) or ()
        if not any(facts.weight_of.get(v) in roles.row for v in factors):
            continue
        if any(m in inner for _, m, d in facts.graph.out_edges(n, data=True) if d["result"] == 0):
            elements, count = elements + facts.numel((n, 0)), count + 1
    return elements, count


def _multi_query(weights: list[LocalWeight], numel: dict[str, int]) -> dict[str, Any]:
    """The :class:`BlockCost` fields of a block's fused multi-query weights: each one's elements
    and its segments' sizes along its split dim."""
    return dict(
        multi_query_params=tuple(numel[w.param] for w in weights),
        multi_query_sizes=tuple(tuple(w.sizes) for w in weights),
    )


def traced_tokens(analysis: ModelAnalysis) -> tuple[int, int]:
    """(batch x seq, seq) of the traced input, dynamic dims counted as 1 like the graph's."""
    shape = analysis.input_specs[0].shape if analysis.input_specs else [1, 1]
    batch, seq = (max(d, 1) for d in (list(shape) + [1, 1])[:2])
    return batch * seq, seq


def model_cost(
    analysis: ModelAnalysis, kernels: Kernels | None = None, local: frozenset[str] = frozenset()
) -> ModelCost:
    """The cost description of an analysed model (see the module docstring), as a strategy runs
    it: ``analysis`` is the analysis under that strategy (:mod:`.strategy_analysis`: its stopped
    sub-layers in ``local`` split, its MoE layers whole where they run so), with ``kernels``
    (the plan's: flash or eager attention, fused norms; None: as traced) priced as the target
    runs them (:class:`Fusion`), and the sub-layers in ``local`` as local views: their fused
    projections not gathered (:func:`~autodist.planner.recognise.reshards.gathered_linears`),
    so their cores run on 1/mp of the heads; every other fused projection is gathered.

    Example::

        >>> cost = model_cost(analyze(traced, graph, model))   # doctest: +SKIP
        >>> len(cost.blocks), cost.vocab_size                  # doctest: +SKIP
        (32, 32000)
    """
    return _model_cost(analysis, fusion_of(analysis, kernels), local)


def fusion_of(analysis: ModelAnalysis, kernels: Kernels | None) -> Fusion:
    """The :class:`Fusion` the plan's ``kernels`` mean for this model: flash attention, and the
    model's norm layers (in its blocks and after them) as one kernel each when ``rms_norm`` is fused."""
    if kernels is None:
        return Fusion()
    weights = (
        [*(w for b in analysis.blocks for w in b.norms), *analysis.final_norm] if "rms_norm" in kernels.fused else []
    )
    norms = frozenset(weight.rpartition(".")[0] for weight in weights)  # the analysis names a norm by its weight
    return Fusion(flash=kernels.attention == "flash", layers=norms)


def _model_cost(analysis: ModelAnalysis, fusion: Fusion, local: frozenset[str]) -> ModelCost:
    from autodist.planner.recognise.analysis import attention_layer
    from autodist.planner.recognise.reshards import gathered_linears, multi_query_weights

    facts = GraphFacts(analysis.graph)
    tokens, seq = traced_tokens(analysis)
    numel = {fqn: math.prod(shape) for fqn, (shape, _dtype) in analysis.params.items()}
    blocks: list[BlockCost] = []
    in_blocks: set[int] = set()
    block_params: set[str] = set()
    for info in analysis.blocks:
        roles = replace(_roles(info.linears), gathered=frozenset(lin.layer for lin in gathered_linears(info, local)))
        attention = attention_layer(info)
        mine = {fqn: n for fqn, n in numel.items() if fqn.startswith(info.layer + ".")}
        block_params.update(mine)
        in_blocks.update(info.nodes)
        moe = _moe_cost(facts, info, mine, tokens) if info.experts else {}
        blocks.append(
            block_cost(
                facts,
                info.nodes,
                info.layer,
                roles,
                mine,
                tokens,
                seq,
                fusion,
                attention,
                local,
                num_heads=info.num_heads,
                num_kv_heads=info.num_kv_heads,
                kv_split=_kv_split(info),
                intermediate_size=info.intermediate_size,
                **_multi_query(multi_query_weights(info, analysis.params, local), numel),
                **moe,
            )
        )
    first, last, tied, notes = _edges(analysis, facts, numel, block_params, in_blocks, tokens, fusion)
    batch = analysis.batch_size if analysis.batch_size > 0 else 1
    return ModelCost(
        blocks=tuple(blocks),
        hidden_size=int(blocks[0].output_per_token) if blocks else 0,
        vocab_size=analysis.vocab_size,
        first=first,
        last=last,
        tied_vocab_params=tied,
        traced_batch=batch,
        traced_seq=analysis.seq_len if analysis.seq_len > 0 else seq,
        notes=tuple(notes),
        token_mixing=next((b.token_mixing for b in analysis.blocks if b.token_mixing), None),
        unchained=tuple(sorted(analysis.unchained.items())),
        dtype=parameter_dtype(analysis.params),
        **analysis.local_only(local),
    )


def parameter_dtype(params: dict[str, tuple[list[int], str]]) -> TrainingDType:
    """The training dtype of a model's floating-point parameters (``{FQN: (shape, dtype)}``): the
    one most of their elements are in. What the planner prices unless ``--dtype`` asks for mixed
    precision. A ``PlannerError`` when that is a dtype it does not price (``float64``).

    >>> parameter_dtype({"w": ([4, 8], "float32"), "ids": ([4], "int64")})
    'fp32'
    """
    elements: dict[str, int] = {}
    for shape, dtype in params.values():
        if dtype in FLOAT_DTYPES:
            elements[dtype] = elements.get(dtype, 0) + math.prod(shape)
    if not elements:
        return "fp32"  # no floating-point parameter: nothing to price in another width
    most = max(sorted(elements), key=lambda dtype: elements[dtype])
    found = training_dtype(most)
    if found is None:
        raise PlannerError(f"the model's parameters are {most}, which the planner does not price; give --dtype")
    return found


def _kv_split(info) -> bool:
    """The attention core gets K and V split by heads (:attr:`BlockCost.kv_split`): not when a
    multi-query attention's K/V projections are whole on every rank (priced whole: their weights
    in ``params_whole``, their matmuls unsplit, their outputs outside the mp region), nor after a
    fused ``qkv`` / ``kv`` projection, whose output the plan gathers right after it
    (reshards.reshard_hooks; only its weight's features need to divide). A ``kv`` column not
    fused (multi-head latent attention's up-projection, cut into each head's key and value)
    gives them split by heads."""
    return any(lin.role == "column" and lin.fused == 1 and lin.name in ("k", "v", "kv") for lin in info.linears)


def _moe_cost(facts: GraphFacts, info, params: dict[str, int], tokens: int) -> dict:
    """The :class:`BlockCost` fields of a block's MoE layer (the parent of its experts container):
    the experts' count, elements and tensors, the rest of the layer's (the router's) elements and
    tensors, its input per token (the hidden size), what it saves for backward outside the
    experts, per token (every kind: the MoE layer is not split over mp under ep), and its shared
    experts' forward FLOPs per token."""
    experts = info.experts.layer
    moe = experts.rpartition(".")[0]
    expert_params = {fqn: n for fqn, n in params.items() if _under(fqn, experts)}
    router_params = {fqn: n for fqn, n in params.items() if _under(fqn, moe) and fqn not in expert_params}
    graph = facts.graph
    owned = [
        n for n in info.nodes if _under(graph.nodes[n]["layer"], moe) and not _under(graph.nodes[n]["layer"], experts)
    ]
    walk = walk_nodes(facts, owned)
    return dict(
        experts=info.experts.count,
        experts_batched=info.experts.batched,
        expert_params=sum(expert_params.values()),
        expert_tensors=len(expert_params),
        router_params=sum(router_params.values()),
        router_tensors=len(router_params),
        dispatch_per_token=info.hidden_size,
        saved_router=sum((_saved(facts, walk, kind, tokens) for kind in ("outside", "inside", "inside_seq")), Saved()),
        shared_flops_per_token=sum(
            flops
            for weight, flops in walk.flops_by_weight.items()
            if any(_under(weight, shared) for shared in info.experts.shared)
        )
        / tokens,
    )


def _under(layer: str, parent: str) -> bool:
    return layer == parent or layer.startswith(parent + ".")


def _roles(linears) -> Roles:
    column = {u.weight for u in linears if u.role == "column"}
    row = {u.weight for u in linears if u.role == "row"}
    column_biases = {u.bias for u in linears if u.role == "column" and u.bias}
    return Roles(frozenset(column), frozenset(row), frozenset(column | row | column_biases))


def _edges(
    analysis,
    facts: GraphFacts,
    numel: dict[str, int],
    block_params: set[str],
    in_blocks: set[int],
    tokens: int,
    fusion: Fusion,
) -> tuple[EdgeCost, EdgeCost, int, list[str]]:
    """Embedding side and head side: graph nodes outside the blocks, split at the blocks'
    position in program order, plus the LM head from its weight when it was not traced."""
    from autodist.planner.recognise.analysis import params_before_blocks, params_read_on_both_sides

    notes = []
    head = analysis.lm_head.weight if analysis.lm_head else None
    vocab_params = {p for p in (analysis.embedding, head) if p}
    before = params_before_blocks(analysis)
    # A table both sides read (a head tied to the embedding by name or by function call): the
    # last stage of a pipeline holds a copy.
    tied = ({head} if head and head == analysis.embedding else set()) | params_read_on_both_sides(analysis)
    boundary = min(in_blocks) if in_blocks else max(facts.graph.nodes, default=0) + 1
    sides: dict[str, list[int]] = {"first": [], "last": []}
    for n in facts.graph.nodes:
        if n not in in_blocks:
            sides["first" if n < boundary else "last"].append(n)
    walks = {side: walk_nodes(facts, nodes, vocab=analysis.vocab_size, fusion=fusion) for side, nodes in sides.items()}
    edges: dict[str, dict[str, Any]] = {}
    for side, walk in walks.items():
        on_side = {fqn for fqn in numel if fqn not in block_params and (fqn in before) == (side == "first")}
        on_side |= tied
        vocab_flops = sum(f for w, f in walk.flops_by_weight.items() if w in vocab_params)
        saved = _saved(facts, walk, "outside", tokens) + _saved(facts, walk, "inside", tokens)
        edges[side] = dict(
            params_vocab=sum(numel[p] for p in on_side if p in vocab_params),
            params_whole=sum(numel[p] for p in on_side if p not in vocab_params),
            param_tensors=len(on_side),
            largest_vocab=max((numel[p] for p in on_side if p in vocab_params), default=0),
            largest_whole=max((numel[p] for p in on_side if p not in vocab_params), default=0),
            flops_vocab_per_token=vocab_flops / tokens,
            flops_whole_per_token=(walk.flops_weight - vocab_flops) / tokens,
            saved_whole=saved,
            gemms=tuple(Gemm(n, k, "vocab" if w in vocab_params else "none") for w, n, k in walk.gemms),
            moved=_moved(walk, tokens, 1),
        )
    hidden = analysis.blocks[0].hidden_size if analysis.blocks else 0
    if analysis.embedding:
        edges["first"]["lookup_table"] = numel.get(analysis.embedding, 0)  # gathered when vocab-split
        if analysis.local_lookup is not None:  # or looked up locally (plan.vocab_lookup)
            edges["first"]["lookup_output"] = analysis.params[analysis.embedding][0][1]
    if head:
        traced_head = head in walks["last"].flops_by_weight or head in walks["first"].flops_by_weight
        if not traced_head:
            # Outside the traced sub-layer (PaddleFormers traces only the decoder): price the
            # head's matmul from its weight shape, and keep its input for backward.
            edges["last"]["flops_vocab_per_token"] += 2.0 * numel[head]
            edges["last"]["saved_whole"] = edges["last"]["saved_whole"] + Saved(floats=hidden)
            notes.append(f"{analysis.lm_head.layer} was not traced; its cost comes from the weight shape")
        vocab = analysis.vocab_size or 0
        # Logits plus the loss's fp32 softmax: Korthikanti's 4sbv bytes at 2-byte elements.
        edges["last"]["saved_vocab"] = Saved(floats=2.0 * vocab)
        edges["last"]["allreduce_bwd_per_token"] = hidden  # column-parallel head input gradient
    return EdgeCost(**edges["first"]), EdgeCost(**edges["last"]), sum(numel[p] for p in tied), notes


def implicit_collectives(analysis: ModelAnalysis, mp: int, dtype_bytes: int) -> Implicit:
    """The communication Paddle's SPMD rules add at tensor-parallel degree ``mp`` for the plan as
    emitted, beyond its own hooks (``implicit_comm`` replayed with the ``reshard`` hooks that gather
    each column-split fused projection's output, which the blocks' costs price: :func:`walk_nodes`):
    bytes one rank sends, forward and backward, per traced token, and the plan's ``implicit_comm``
    entries. The one replay both the search's prices and the plan's list come from. A local view
    runs outside Paddle's rules: replayed as gathered, its layers add nothing here either."""
    from autodist.planner.recognise.reshards import implicit_comm, reshard_hooks  # the SPMD-rule replay

    tokens, _ = traced_tokens(analysis)
    found = implicit_comm(analysis, mp, dtype_bytes=dtype_bytes, hooks=reshard_hooks(analysis, mp))
    return Implicit(
        sent_per_token=sum(c.bytes_per_step for c in found) / tokens,
        count=len(found),
        entries=tuple(found),
    )
