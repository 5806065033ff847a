"""Check tensor-parallel placements against Paddle's own SPMD rules, op by op.

Paddle's auto-parallel runs every op through its SPMD rule
(``paddle.base.core.get_phi_spmd_rule(op).infer_forward``): given the inputs' placements, the
rule says which placements the op needs, and Paddle reshards any input that differs. This
module replays that on the traced graph of each block, with the weights placed as the analysis
chose (column: output features split over mp, row: input features), and reports every reshard
the plan did not ask for. It needs no process group: the rules run on a 1-D ``mp`` mesh.

What counts as *asked for*: Partial -> Replicate after a row-parallel matmul (the row linear's
all-reduce). What is *implicit*: a Shard -> Replicate (all-gather) or Shard -> Shard
(all-to-all) forced by an op that cannot work on the split value, and a Partial reduced
anywhere but after a matmul. The classic case is a column-split fused projection: each rank holds
a slice of ``q|k|v`` (or ``gate|up``) that crosses the segment boundaries, so the reshape /
slice / split that separates the segments needs the whole tensor back.

The replay of one block's ops is here (:class:`Replay`); what it says for a whole model (the
plan's reshard hooks, the implicit collectives priced) is in :mod:`.reshards`.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, replace
from typing import Callable, Iterator, Sequence

import networkx as nx

from autodist.schemas.describe import layers_text

from autodist.planner.graph import operand_sources
from autodist.planner.ops import (
    ARITHMETIC_OPS,
    EXPAND_OPS,
    FUSED_ATTENTION_OPS,
    LIKE_OPS,
    LINEAR_OPS,
    PASS_THROUGH_OPS,
    REDUCTION_OPS,
    SIZE_RULE_OPS,
    UNARY_OPS,
    short_op,
)
from autodist.planner.recognise.rule_worker import RULES, Answer, Answered, Operand, RuleCrashed, RuleRefused


@dataclass(frozen=True)
class Dist:
    """A value's layout over the mp group: ``dims[i]`` is 0 when tensor dim ``i`` is split over
    mp, -1 when whole; ``partial`` marks a pending sum, ``partial_source`` the node that made it."""

    shape: tuple[int, ...]
    dims: tuple[int, ...]
    partial: bool = False
    partial_source: int | None = None

    @classmethod
    def replicated(cls, shape: Sequence[int]) -> Dist:
        return cls(tuple(shape), (-1,) * len(shape))

    @property
    def is_replicated(self) -> bool:
        return not self.partial and all(d == -1 for d in self.dims)

    def placement(self) -> str:
        """The mp entry of a plan placement list: ``R``, ``P`` or ``S(k)``."""
        if self.partial:
            return "P"
        return next((f"S({i})" for i, d in enumerate(self.dims) if d == 0), "R")


@dataclass(frozen=True)
class Reshard:
    """Paddle would reshard operand ``operand`` of graph node ``node`` from ``before`` to ``after``."""

    node: int
    operand: int
    before: Dist
    after: Dist

    @property
    def collective(self) -> str | None:
        """The collective this reshard costs; None for Replicate -> Shard (a local slice)."""
        if self.before.partial:
            return "all_reduce" if not self.after.partial and self.after.is_replicated else "reduce_scatter"
        if self.before.is_replicated:
            return None
        return "all_gather" if self.after.is_replicated else "all_to_all"


# -- replaying the rules -----------------------------------------------------------------------------


def _operand(value: Dist | list[Dist]) -> Operand:
    """A value as the rule worker hands it to a rule (rule_worker.Tensor)."""
    if isinstance(value, list):
        return [(d.shape, d.dims, d.partial) for d in value]
    return (value.shape, value.dims, value.partial)


def _from_layout(layout: Answered, shape: Sequence[int], source: int) -> Dist:
    """One tensor's layout as a rule answered it (a list's are read one by one)."""
    assert not isinstance(layout, list), "a list of layouts is read item by item"
    dims, partial = layout
    return Dist(tuple(shape), dims, partial, source if partial else None)


def _whole(value: Dist | list[Dist]) -> bool:
    return all(d.is_replicated for d in (value if isinstance(value, list) else [value]))


def _int(value) -> int:
    return int(value[0] if isinstance(value, list) else value)


#: op -> (rule name, extra arguments after the tensor specs, from the node's attrs/consts/shapes)
_RULE_ARGS: dict[str, tuple[str, Callable[[dict], list]]] = {
    "expand_as": ("expand_as", lambda d: [list(d["shapes"][0])]),
    "matmul": ("matmul", lambda d: [d["attrs"].get("transpose_x", False), d["attrs"].get("transpose_y", False)]),
    "reshape": ("reshape", lambda d: [list(d["shapes"][0])]),
    "transpose": ("transpose", lambda d: [list(d["attrs"]["perm"])]),
    "unsqueeze": ("unsqueeze", lambda d: [[int(a) for a in d["consts"].get(1, [])]]),
    "squeeze": ("squeeze", lambda d: [[int(a) for a in d["consts"].get(1, [])]]),
    "slice": (
        "slice",
        lambda d: [
            list(d["attrs"]["axes"]),
            [int(v) for v in d["consts"][1]],
            [int(v) for v in d["consts"][2]],
            list(d["attrs"].get("infer_flags", [])),
            list(d["attrs"].get("decrease_axis", [])),
        ],
    ),
    "split_with_num": ("split_with_num", lambda d: [int(d["attrs"]["num"]), _int(d["consts"][1])]),
    "split": ("split", lambda d: [[int(v) for v in d["consts"][1]], _int(d["consts"][2])]),
    "unbind": ("unbind", lambda d: [int(d["attrs"]["axis"])]),
    "softmax": ("softmax", lambda d: [int(d["attrs"]["axis"])]),
    "layer_norm": ("layer_norm", lambda d: [float(d["attrs"]["epsilon"]), int(d["attrs"]["begin_norm_axis"])]),
    "embedding": (
        "embedding",
        lambda d: [int(d["attrs"].get("padding_idx", -1)), bool(d["attrs"].get("sparse", False))],
    ),
    "pow": ("pow", lambda d: [float(d["attrs"].get("y", 2.0))]),
    "concat": ("concat", lambda d: [_int(d["consts"][1])]),
    "swiglu": ("swiglu", lambda d: []),
    "gather_nd": ("gather_nd", lambda d: []),
    "where": ("where", lambda d: []),
    "strided_slice": (
        "strided_slice",
        lambda d: [
            list(d["attrs"]["axes"]),
            [int(v) for v in d["consts"][1]],
            [int(v) for v in d["consts"][2]],
            [int(v) for v in d["consts"][3]],
        ],
    ),
    "stack": ("stack", lambda d: [int(d["attrs"]["axis"])]),
    "flatten": ("flatten", lambda d: [int(d["attrs"]["start_axis"]), int(d["attrs"]["stop_axis"])]),
    "triu": ("triu", lambda d: [int(d["attrs"].get("diagonal", 0))]),
    "tile": ("tile", lambda d: [[int(v) for v in d["consts"][1]]]),
    **{op: ("elementwise_unary", lambda d: []) for op in UNARY_OPS},
    **{op: (op, lambda d: []) for op in sorted(ARITHMETIC_OPS)},
}


#: The refusal of a group whose fused column no post-hook can gather (its layer's forward never
#: runs: the model reads its weight, ``F.linear(x, self.qkv.weight, bias)``): split only as a
#: local view (planner/recognise/roles.py).
UNHOOKABLE = "fused projection inside a larger layer"

#: The smallest change to a model's code that lets Paddle keep a split through an op that stops
#: it, by op (docs/paddle-notes.md, "Masks", "SPMD rules"); :data:`RUN_TIME_SIZES` for an op whose
#: sizes the trace does not know.
REWRITES = {
    "masked_fill": "write paddle.where(mask, paddle.full_like(scores, value), scores), which keeps the heads split",
    "tril": "build the causal mask with paddle.triu(paddle.full_like(scores, -inf), 1), which keeps the heads split",
    "as_complex": "rotate with cos and sin on real tensors (rotate_half) instead of complex multiplication",
    "einsum": "write the contraction with matmul (Paddle runs einsum on local tensors only)",
    UNHOOKABLE: (
        "call the projection's own layer (self.qkv(x), adding any bias of your own after it), whose output "
        "a hook can gather: its columns are then split"
    ),
}
#: The rewrite for projections that multiply by slices of one parameter (roles.sliced_weights).
SLICED_WEIGHT = (
    "give each slice of {name} a Linear layer of its own and call it (self.q_proj(x), self.k_proj(x), ...), "
    "whose columns are then split"
)
RUN_TIME_SIZES = (
    "read the sizes with x.shape (Python ints under a fixed input spec) instead of paddle.shape, "
    "and give the input spec fixed sizes"
)


def dynamic(shapes: Sequence[Sequence[int] | None]) -> bool:
    """Whether any of ``shapes`` holds a size known only at run time (-1 in the trace).

    >>> dynamic([[2, -1, 48], None]), dynamic([[2, 12, 48]])
    (True, False)
    """
    return any(size < 0 for shape in shapes if shape for size in shape)


class Replay:
    """One block's forward, op by op, with each value's :class:`Dist`."""

    def __init__(
        self,
        graph: nx.DiGraph,
        nodes: frozenset[int],
        weights: dict[str, Dist],
        mesh,
        constants,
        gathered_layers: frozenset[str] = frozenset(),
        gathered_nodes: frozenset[int] = frozenset(),
    ):
        self.graph, self.nodes, self.weights, self.mesh, self.constants = graph, nodes, weights, mesh, constants
        self.values: dict[tuple[int, int], Dist | list[Dist]] = {}
        self.reshards: list[Reshard] = []
        #: The ops replayed with no SPMD rule at all (:meth:`_unknown` for want of one, not a rule
        #: refusing its arguments): Paddle gathers their inputs in the global view, but nothing
        #: says the op needs them whole; on local tensors (a local view) it may run per head.
        self.ruleless: set[int] = set()
        # a post-hook resharding a layer's output to Replicate acts after the layer's last op;
        # ``gathered_nodes``: outputs taken whole right after the op (a fused projection no hook can
        # gather, replayed as if one did: roles.recognise_block)
        self.gathered_outputs = {
            max(n for n in nodes if graph.nodes[n]["layer"] == layer)
            for layer in gathered_layers
            if any(graph.nodes[n]["layer"] == layer for n in nodes)
        } | set(gathered_nodes)

    def run(self) -> list[Reshard]:
        for node in sorted(self.nodes):
            self._step(node)
            output = self.values[node, 0]
            if node in self.gathered_outputs and isinstance(output, Dist):
                self.values[node, 0] = Dist.replicated(output.shape)
        return self.reshards

    def value(self, node: int, result: int) -> Dist | list[Dist]:
        if (node, result) in self.values:
            return self.values[node, result]
        data = self.graph.nodes[node]
        if data["param"] in self.weights:
            return self.weights[data["param"]]
        shape = (data["shapes"][result] if data["shapes"] else None) or []
        return Dist.replicated(shape)  # a value from outside the block arrives whole

    def operands(self, node: int) -> list[tuple[int, Dist | list[Dist]]]:
        return sorted((operand, self.value(*source)) for operand, source in operand_sources(self.graph, node).items())

    def _step(self, node: int) -> None:
        data = self.graph.nodes[node]
        op, shapes = short_op(data["op"]), data["shapes"]
        operands = self.operands(node)
        first = operands[0][1] if operands else None
        if op in LIKE_OPS and isinstance(first, Dist):
            self._like(node, first)
        elif not operands or (node in self.constants and all(_whole(v) for _, v in operands)):
            self._set(node, [Dist.replicated(s or []) for s in shapes])
        elif data["op"] == "builtin.combine" and all(isinstance(v, Dist) for _, v in operands):
            self.values[node, 0] = [v for _, v in operands if isinstance(v, Dist)]
        elif data["op"] == "builtin.split" and isinstance(first, list):
            self._set(node, [replace(d, shape=tuple(s)) for d, s in zip(first, shapes)])
        elif op in PASS_THROUGH_OPS and len(operands) == 1 and isinstance(first, Dist):
            self._set(node, [replace(first, shape=tuple(shapes[0]))])
        elif op in REDUCTION_OPS:
            self._reduce(node, operands[0])
        elif op in EXPAND_OPS:
            self._expand(node, operands[0])
        elif op == "addmm":
            self._addmm(node, operands)
        elif op == "where" and len(operands) < 3:
            self._broadcast(node, operands)
        elif op in FUSED_ATTENTION_OPS:
            self._fused_attention(node, operands)
        elif op in _RULE_ARGS:
            self._rule(node, op, operands)
        else:
            self.ruleless.add(node)
            self._unknown(node, operands)

    def _set(self, node: int, dists: list[Dist]) -> None:
        for i, dist in enumerate(dists):
            self.values[node, i] = dist

    def _need(self, node: int, operand: int, before: Dist, after: Dist) -> None:
        if (before.dims, before.partial) != (after.dims, after.partial):
            self.reshards.append(Reshard(node, operand, before, after))

    def _rule(self, node: int, op: str, operands) -> None:
        data = self.graph.nodes[node]
        rule_name, extra = _RULE_ARGS[op]
        tensors = [v for _, v in operands]
        if op in ARITHMETIC_OPS and len(tensors) == 1:
            # the other operand is a folded constant: elementwise with a scalar-like value
            self._need(node, operands[0][0], tensors[0], replace(tensors[0], partial=False, partial_source=None))
            self._set(node, [replace(tensors[0], shape=tuple(data["shapes"][0]), partial=False, partial_source=None)])
            return
        if op == "layer_norm" and [o for o, _ in operands] != [0, 1, 2]:
            # without its scale or bias the rule reads a missing operand (a segfault in Paddle
            # 3.3): assume the worst instead
            self._unknown(node, operands)
            return
        inputs_flat = [t for v in tensors for t in (v if isinstance(v, list) else [v])]
        if rule_name in SIZE_RULE_OPS and dynamic([t.shape for t in inputs_flat] + list(data["shapes"])):
            self._unknown(node, operands)  # whole inputs assumed, as for an op with no rule known
            return
        try:
            arguments = extra(data)
        except KeyError:  # an argument the rule reads is computed, not a constant: ``w[expert_idx]``'s start
            self._unknown(node, operands)
            return
        answer = self._ask(node, rule_name, tensors, arguments)
        if answer is None:  # the rule refused these arguments, or crashed: assume the worst
            self._unknown(node, operands)
            return
        inputs, outputs = answer.inputs, answer.outputs
        for (operand, before), needed in zip(operands, inputs):
            if isinstance(before, list):
                assert isinstance(needed, list), "a list operand is answered with a list of layouts"
                for b, n in zip(before, needed):
                    self._need(node, operand, b, _from_layout(n, b.shape, node))
            else:
                self._need(node, operand, before, _from_layout(needed, before.shape, node))
        # a partial sum passed on (a reshape of a row projection's output, its product with a
        # routing weight) is still the row projection's: its origin is kept
        origin = next((t.partial_source for t in inputs_flat if t.partial), node)
        if data["shapes"] == [None]:  # a vector result (split, unbind): builtin.split sets the shapes
            flat = [o for out in outputs for o in (out if isinstance(out, list) else [out])]
            self.values[node, 0] = [_from_layout(o, (), origin) for o in flat]
        else:
            self._set(node, [_from_layout(o, s or (), origin) for o, s in zip(outputs, data["shapes"])])

    def _ask(self, node: int, rule: str, tensors: list, extra: list) -> Answer | None:
        """Paddle's rule for ``node``, asked in the rule worker's process (rule_worker.py); None
        when it refuses the arguments or crashes (a crash noted, :func:`crashes_noted`)."""
        try:
            return RULES.infer(rule, self.mesh.process_ids, [_operand(t) for t in tensors], extra)
        except RuleRefused:
            return None
        except RuleCrashed as crash:
            data = self.graph.nodes[node]
            if _NOTED is not None:
                shapes = " ".join(str(list(t.shape)) for t in tensors if isinstance(t, Dist))
                _NOTED.setdefault((str(crash), data["op"], shapes), []).append(data["layer"] or "the top level")
            return None

    def _reduce(self, node: int, operand) -> None:
        """mean/sum over ``axis``: a split reduced axis leaves a partial sum."""
        _, before = operand
        data = self.graph.nodes[node]
        rank = len(before.dims)
        axes = {a % rank for a in (data["consts"].get(1) or range(rank))}
        keep = data["attrs"].get("keepdim", False)
        dims = [(-1 if i in axes else d) for i, d in enumerate(before.dims) if keep or i not in axes]
        partial = before.partial or any(before.dims[a] == 0 for a in axes)
        self._set(node, [Dist(tuple(data["shapes"][0]), tuple(dims), partial, node if partial else None)])

    def _like(self, node: int, shaped: Dist) -> None:
        """``full_like(x, v)`` and co.: constant values laid out like ``x`` (a partial sum's
        shape is whole), so no operand is resharded."""
        self._set(node, [Dist(tuple(self.graph.nodes[node]["shapes"][0]), shaped.dims)])

    def _expand(self, node: int, operand) -> None:
        """Broadcasting keeps split dims (aligned from the right); new dims are whole."""
        _, before = operand
        shape = tuple(self.graph.nodes[node]["shapes"][0])
        offset = len(shape) - len(before.dims)
        dims = tuple(-1 if i < offset else before.dims[i - offset] for i in range(len(shape)))
        self._set(node, [replace(before, shape=shape, dims=dims)])

    def _addmm(self, node: int, operands) -> None:
        """``input + x @ y`` (a Conv1D): the matmul rule for ``x @ y``, then the bias add."""
        tensors = dict(operands)
        if 1 not in tensors or 2 not in tensors:
            self._unknown(node, operands)
            return
        answer = self._ask(node, "matmul", [tensors[1], tensors[2]], [False, False])
        if answer is None:
            self._unknown(node, operands)
            return
        for operand, needed in zip((1, 2), answer.inputs):
            self._need(node, operand, tensors[operand], _from_layout(needed, tensors[operand].shape, node))
        product = _from_layout(answer.outputs[0], self.graph.nodes[node]["shapes"][0], node)
        if 0 in tensors:
            bias = tensors[0]
            wanted = Dist(bias.shape, product.dims[len(product.dims) - len(bias.dims) :])
            self._need(node, 0, bias, wanted if not product.partial else Dist.replicated(bias.shape))
        self._set(node, [product])

    def _broadcast(self, node: int, operands) -> None:
        """An elementwise op whose other operands are folded constants: the highest-rank operand's
        layout, aligned from the right; a partial sum is summed first."""
        operand, before = max(operands, key=lambda item: len(item[1].dims))
        shape = tuple(self.graph.nodes[node]["shapes"][0])
        offset = len(shape) - len(before.dims)
        dims = tuple(-1 if i < offset else before.dims[i - offset] for i in range(len(shape)))
        self._need(node, operand, before, replace(before, partial=False, partial_source=None))
        for other, dist in operands:
            if other != operand and not dist.is_replicated:
                self._need(node, other, dist, Dist.replicated(dist.shape))
        self._set(node, [Dist(shape, dims)])

    def _fused_attention(self, node: int, operands) -> None:
        """A one-kernel attention (flash attention; q, k, v as ``[batch, seq, heads, head_dim]``,
        or ``[tokens, heads, head_dim]`` unpadded): each head is computed on its own, so q, k and
        v split alike on the heads axis give an output split the same way; any other layout is
        gathered first. Extra operands (masks, seeds) must be whole. Paddle 3.3 has no SPMD rule
        for these ops, hence this one."""
        tensors = dict(operands)
        qkv = [t for t in (tensors.get(i) for i in range(3)) if isinstance(t, Dist)]
        if len(qkv) < 3:
            self._unknown(node, operands)
            return
        heads = len(qkv[0].dims) - 2
        layout = tuple(-1 if i != heads else qkv[0].dims[heads] for i in range(len(qkv[0].dims)))
        for operand, dist in operands:
            if isinstance(dist, list):
                self._unknown(node, operands)
                return
            wanted = (
                Dist(dist.shape, layout)
                if operand < 3 and len(dist.dims) == len(layout)
                else Dist.replicated(dist.shape)
            )
            self._need(node, operand, dist, wanted)
        shapes = self.graph.nodes[node]["shapes"]
        self._set(node, [Dist(tuple(shapes[0]), layout)] + [Dist.replicated(s or []) for s in shapes[1:]])

    def _unknown(self, node: int, operands) -> None:
        """No rule known here: assume the op needs whole inputs (an over-count, never a miss)."""
        for operand, before in operands:
            for b in before if isinstance(before, list) else [before]:
                self._need(node, operand, b, Dist.replicated(b.shape))
        self._set(node, [Dist.replicated(s or []) for s in self.graph.nodes[node]["shapes"]])


#: The crashes met while :func:`crashes_noted` is open: the layers, by crash, op and operand shapes.
_NOTED: dict[tuple[str, str, str], list[str]] | None = None


@contextlib.contextmanager
def crashes_noted() -> Iterator[list[str]]:
    """Note each rule crash met inside the ``with``: on leaving it, the list holds one line per
    crash and op (the layers it met them in named at once), for the plan's notes and a warning.

    >>> with crashes_noted() as crashes:
    ...     pass  # replays here
    >>> crashes
    []
    """
    global _NOTED
    outer, _NOTED = _NOTED, {}
    lines: list[str] = []
    try:
        yield lines
    finally:
        noted, _NOTED = _NOTED, outer
        for (crash, op, shapes), layers in noted.items():
            lines.append(
                f"{crash} on {op} {shapes} in {layers_text(list(dict.fromkeys(layers)))}: the planner took "
                "the op as needing whole inputs there, so what it reads runs gathered or replicated "
                '(a Paddle bug; docs/paddle-notes.md, "SPMD rules")'
            )
            if outer is not None:  # an enclosing ``with`` hears of it too
                outer.setdefault((crash, op, shapes), []).extend(layers)


def is_statistic(graph: nx.DiGraph, r: Reshard) -> bool:
    """A mean or sum over split features (a whole-width norm's mean of squares: OLMo2's
    ``q_norm`` over ``q_proj``'s output) leaves each rank a share of the statistic, which Paddle
    all-reduces by itself before it is used: one small sum per token that keeps the features
    split, priced as Paddle's own collective (:func:`.reshards.implicit_comm`). Measured on 2
    gloo ranks: the norm's output and every gradient match one device's (docs/paddle-notes.md).

    A row projection's partial output is no statistic (:func:`is_planned`)."""
    source = r.before.partial_source
    return (
        r.before.partial
        and r.after.is_replicated
        and source is not None
        and short_op(graph.nodes[source]["op"]) in REDUCTION_OPS
    )


def is_planned(graph: nx.DiGraph, r: Reshard) -> bool:
    """A row-parallel matmul's partial output being summed is the row linear's own all-reduce."""
    source = r.before.partial_source
    return r.before.partial and source is not None and short_op(graph.nodes[source]["op"]) in LINEAR_OPS
