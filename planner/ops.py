"""The op catalogue: every Paddle op the planner's stages treat specially, in one table
(:data:`CATALOGUE`), at the bottom of the planner (it imports nothing).

Each entry (:class:`Op`) says once what the recognition, the cost model and the SPMD replay read:

- ``role``: what the op does, which the cost model's walk dispatches on
  (``graph_cost.walk_nodes``): a ``product`` of two factors (:class:`Product`: their operand
  slots, how many elements each output element contracts), a ``convolution``, a
  ``fused_attention`` kernel, an ``elementwise`` or ``normalisation`` op, a ``loss``, a
  ``layout`` op (moves, reshapes, picks or re-types data), a ``fill`` of an operand's shape, a
  ``constant``, a ``source`` (``arange``), the program's ``input``, a ``shape``, an ``embedding``,
  a ``reduction``, a ``selection`` (an MoE router's ``topk``);
- its FLOPs rule (:meth:`Op.flops`; products from :attr:`Product.contracted`);
- its bytes rule: what its backward keeps (``saved``, ``cross``, ``output_for``: see
  ``graph_cost.GraphFacts.saved_by``) and whether it moves data of its own (``moves``);
- its SPMD behaviour where the replay has one: the traits ``pass_through``, ``unary``,
  ``arithmetic``, ``like``, ``expand``, ``local_only`` and the ``reduction`` role (the sets below
  ``recognise/spmd.py`` reads; Paddle's rules' arguments live there, keyed by these names);
- whether Paddle runs it on distributed tensors at all (:func:`local_only_use`: the ``local_only``
  trait, or a read through a boolean mask's positions, ``masked_by``);
- the sets the recognition contracts or cuts by (``layout``, ``cut``, ``reshape``, ``select``).

The named sets (:data:`LAYOUT_OPS`, :data:`PRODUCT_OPS`, ...) are views of the catalogue, not
tables of their own. Names are short (:func:`short_op`: ``pd_op.`` and an in-place ``_``
dropped) unless a set says it holds full names (``pd_op.softmax``), as the graph's nodes carry them.

    >>> "dropout" in PASS_THROUGH_OPS and "dropout" in LAYOUT_OPS
    True
    >>> sorted(PRODUCT_OPS), sorted(LINEAR_OPS)
    (['addmm', 'baddbmm', 'bmm', 'einsum', 'matmul'], ['addmm', 'matmul'])
    >>> op("baddbmm").flops({}, [[8, 6, 5], [8, 5, 7]], [8, 6, 7])   # 2 x (8 x 6 x 7) x 5
    3360.0
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Mapping, Sequence

Shape = Sequence[int]
Role = Literal[
    "product",
    "convolution",
    "fused_attention",
    "elementwise",
    "normalisation",
    "loss",
    "layout",
    "fill",
    "constant",
    "source",
    "input",
    "shape",
    "embedding",
    "reduction",
    "selection",
]
#: The short name of ``builtin.parameter`` (a trainable parameter or a buffer).
PARAM = "param"


def short_op(op: str) -> str:
    """``pd_op.matmul`` -> ``matmul``; in-place ``add_`` -> ``add``; builtins keep their prefix,
    except ``builtin.parameter`` -> ``param``.

    >>> short_op("pd_op.relu_"), short_op("builtin.combine"), short_op("builtin.parameter")
    ('relu', 'builtin.combine', 'param')
    """
    if op == "builtin.parameter":
        return PARAM
    if op.startswith("pd_op."):
        op = op[len("pd_op.") :]
    return op.rstrip("_")


def numel(shape: Shape) -> int:
    """Elements of a traced shape, a dynamic dim (-1) counted as 1."""
    return math.prod(d if d > 0 else 1 for d in shape)


def _matmul_contracted(attrs: Mapping[str, Any], x: Shape, y: Shape) -> int:
    return x[-2] if attrs.get("transpose_x") and len(x) > 1 else x[-1]


def _last_dim_contracted(attrs: Mapping[str, Any], x: Shape, y: Shape) -> int:
    return x[-1]


def einsum_contracted(attrs: Mapping[str, Any], x: Shape, y: Shape) -> int:
    """Elements each output element of a two-operand ``einsum`` sums over: the sizes of the
    letters of its inputs that its output drops (implicit output: the letters seen once).

    >>> einsum_contracted({"equation": "bhid,bhjd->bhij"}, [2, 4, 6, 5], [2, 4, 7, 5])
    5
    >>> einsum_contracted({"equation": "...id,...jd"}, [3, 6, 5], [3, 7, 5])   # implicit: ij
    5
    """
    equation = str(attrs["equation"]).replace(" ", "")
    inputs, arrow, output = equation.partition("->")
    terms = inputs.split(",")
    if not arrow:
        letters = "".join(terms).replace(".", "")
        output = "".join(sorted(c for c in set(letters) if letters.count(c) == 1))
    sizes: dict[str, int] = {}
    for term, shape in zip(terms, (x, y)):
        head, _, tail = term.partition("...")
        sizes.update(zip(head, shape))
        sizes.update(zip(tail, shape[len(shape) - len(tail) :]))
    return math.prod(max(size, 1) for letter, size in sizes.items() if letter not in output)


@dataclass(frozen=True)
class Product:
    """A product of two factors. ``factors``: their operand slots (``baddbmm(input, x, y)`` adds
    its first operand to ``x @ y``), None for ``einsum``, whose factors are the items of the one
    list it takes; ``contracted(attrs, x, y)``: how many elements of its factors each output
    element sums over; ``transposes``: the attributes transposing each factor (``matmul``'s);
    ``linear``: a linear layer computes with it (``x @ W``, HF's ``Conv1D`` as ``addmm``)."""

    factors: tuple[int, int] | None
    contracted: Callable[[Mapping[str, Any], Shape, Shape], int]
    transposes: tuple[str, str] | None = None
    linear: bool = False


def _convolution_flops(attrs: Mapping[str, Any], shapes: Sequence[Shape], out: Shape) -> float:
    """Each output element: one multiply-add per input channel (of its group) x kernel tap."""
    return 2.0 * numel(out) * math.prod(shapes[1][1:])


def _attention_flops(attrs: Mapping[str, Any], shapes: Sequence[Shape], out: Shape) -> float:
    """q, k, v ``[batch, seq, heads, head_dim]``: scores and context, 2 x 2 x q x keys."""
    return 4.0 * numel(shapes[0]) * max(shapes[1][1], 1)


@dataclass(frozen=True)
class Op:
    """One op of the catalogue (module docstring).

    ``saved``: (operand slots, result indices) its backward keeps whatever needs a gradient;
    ``cross``: each operand (a product's each factor) is kept for the other's gradient
    (z = x * y: dx = dz * y); ``output_for``: the output is kept too when this operand needs a
    gradient (``divide``: dy = -dz * z / y); ``moves``: it reads and writes its tensors through
    memory (priced as a memory-bound op); ``rule``: FLOPs of an op that is not a product."""

    role: Role
    product: Product | None = None
    rule: Callable[[Mapping[str, Any], Sequence[Shape], Shape], float] | None = None
    saved: tuple[tuple[int, ...], tuple[int, ...]] = ((), ())
    cross: bool = False
    output_for: int | None = None
    moves: bool = True
    traits: frozenset[str] = field(default_factory=frozenset)
    #: Where a ``cut`` op's axis is: its operand index (``split``'s 2), or ``"axes"``, the one
    #: entry of its ``axes`` attribute (a slice); None where the graph does not say.
    cut_axis: int | Literal["axes"] | None = None
    #: The operand that, when it holds a boolean mask's positions (a ``positions`` op's result),
    #: makes the op ``x[mask]``: Paddle traces that as ``gather_nd(x, nonzero(mask))``, and its
    #: eager indexing raises on a DistTensor ``x`` (:func:`local_only_use`).
    masked_by: int | None = None
    #: For an op Paddle runs on local tensors only: how to write it instead (a refusal's advice).
    rewrite: str = ""

    @property
    def priced(self) -> bool:
        """It has a FLOPs rule."""
        return self.product is not None or self.rule is not None

    def flops(self, attrs: Mapping[str, Any], shapes: Sequence[Shape], out: Shape) -> float:
        """Forward FLOPs from the shapes of its factors (a product) or operands, and its output's."""
        if self.product is not None:
            return 2.0 * numel(out) * max(self.product.contracted(attrs, shapes[0], shapes[1]), 1)
        return self.rule(attrs, shapes, out) if self.rule is not None else 0.0


def _entries(names: Sequence[str], role: Role, *traits: str, **fields: Any) -> dict[str, Op]:
    return {name: Op(role, traits=frozenset(traits), **fields) for name in names}


_RESULT = ((), (0,))  # the backward reads the op's output
_INPUT = ((0,), ())  # the backward reads the op's input
_LAYOUT = ("layout",)

#: Every op the planner treats specially, by short name (module docstring).
CATALOGUE: dict[str, Op] = {
    # -- products and the other ops priced by FLOPs
    "matmul": Op(
        "product",
        Product((0, 1), _matmul_contracted, ("transpose_x", "transpose_y"), linear=True),
        cross=True,
        moves=False,
    ),
    "addmm": Op("product", Product((1, 2), _last_dim_contracted, linear=True), cross=True, moves=False),
    "bmm": Op("product", Product((0, 1), _last_dim_contracted), cross=True, moves=False),
    "baddbmm": Op("product", Product((1, 2), _last_dim_contracted), cross=True, moves=False),
    # Paddle 3.3 runs no einsum on distributed tensors (``PreconditionNotMet: Arg must be a vector
    # of TensorDistAttr``, docs/paddle-notes.md): a layer using one trains under apply_plan only
    # where it runs on plain local tensors (an MoE layer run locally, a local view).
    "einsum": Op(
        "product",
        Product(None, einsum_contracted),
        cross=True,
        moves=False,
        traits=frozenset({"local_only"}),
        rewrite="write it with matmul and transposes",
    ),
    "conv2d": Op("convolution", rule=_convolution_flops, saved=_INPUT, moves=False),
    # Attention in one kernel (GPU traces of ``F.scaled_dot_product_attention``); the first three
    # take q, k, v ``[batch, seq, heads, head_dim]``.
    "flash_attn": Op(
        "fused_attention", rule=_attention_flops, saved=((0, 1, 2), (0, 1)), moves=False, traits=frozenset({"mixing"})
    ),
    **_entries(
        ["memory_efficient_attention", "fused_dot_product_attention"],
        "fused_attention",
        "mixing",
        rule=_attention_flops,
        moves=False,
    ),
    **_entries(
        [
            "flash_attn_unpadded",
            "variable_length_memory_efficient_attention",
            "flash_attn_qkvpacked",
            "flash_attn_varlen_qkvpacked",
        ],
        "fused_attention",
        "mixing",
        moves=False,
    ),
    # -- elementwise: functions of one tensor (a split on any dim stays where it is) ...
    **_entries(["tanh", "relu", "sigmoid", "exp", "sqrt", "rsqrt"], "elementwise", "unary", saved=_RESULT),
    **_entries(["log", "square", "sin", "cos", "gelu"], "elementwise", "unary", saved=_INPUT),
    "silu": Op("elementwise", saved=((0,), (0,)), traits=frozenset({"unary"})),
    **_entries(
        ["abs", "erf", "relu6", "leaky_relu", "hardswish", "mish", "softplus", "clip", "neg"], "elementwise", "unary"
    ),
    "pow": Op("elementwise", saved=_INPUT),
    "swiglu": Op("elementwise", saved=((0, 1), ())),
    "triu": Op("elementwise"),
    # ... and of two operands, broadcasting (Paddle's SPMD rule for each is named after the op);
    # ``where``'s backward keeps the condition (x and y only for their shapes)
    **_entries(["add", "subtract", "maximum", "minimum"], "elementwise", "arithmetic"),
    "multiply": Op("elementwise", cross=True, traits=frozenset({"arithmetic"})),
    "divide": Op("elementwise", cross=True, output_for=1, traits=frozenset({"arithmetic"})),
    "where": Op("elementwise", saved=_INPUT, traits=frozenset({"select"})),
    # -- normalisations and the loss
    "softmax": Op("normalisation", saved=_RESULT, traits=frozenset({"mixing"})),
    "layer_norm": Op("normalisation", saved=((0,), (1, 2))),  # x, mean, variance
    "rms_norm": Op("normalisation", saved=_INPUT),
    "cross_entropy_with_softmax": Op("loss", saved=_RESULT),
    "embedding": Op("embedding"),
    **_entries(["mean", "sum"], "reduction"),
    **_entries(["topk", "argmax"], "selection"),
    # -- layout: the same values, cut from autograd or not (dropout is the identity in the
    # eval-mode trace the planner makes; ``share_data`` is ``Tensor.detach()``) ...
    **_entries(["scale", "contiguous", "share_data"], "layout", *_LAYOUT, "pass_through"),
    "cast": Op("layout", traits=frozenset({*_LAYOUT, "pass_through", "weight_view"})),
    "dropout": Op("layout", saved=((), (1,)), traits=frozenset({*_LAYOUT, "pass_through"})),  # keeps its mask
    "assign": Op("layout", moves=False, traits=frozenset({*_LAYOUT, "pass_through", "weight_view"})),
    # ... reshaped (no data moved) ...
    "reshape": Op(
        "layout", moves=False, traits=frozenset({*_LAYOUT, "reshape", "segment", "weight_view", "size_rule"})
    ),
    **_entries(["squeeze", "unsqueeze"], "layout", *_LAYOUT, "reshape", moves=False),
    "flatten": Op("layout", moves=False, traits=frozenset({*_LAYOUT, "reshape", "size_rule"})),
    # ... cut into pieces (a fused q|k|v or gate|up into its projections) ...
    **_entries(["slice", "strided_slice"], "layout", *_LAYOUT, "cut", "segment", cut_axis="axes"),
    "split": Op("layout", traits=frozenset({*_LAYOUT, "cut", "segment"}), cut_axis=2),
    "split_with_num": Op("layout", traits=frozenset({*_LAYOUT, "cut", "segment"}), cut_axis=1),
    "unbind": Op("layout", traits=frozenset({*_LAYOUT, "cut", "segment"})),
    "chunk": Op("layout", traits=frozenset({"cut", "segment"}), cut_axis=1),
    # ... or moved, repeated, picked
    "transpose": Op("layout", traits=frozenset({*_LAYOUT, "weight_view"})),
    **_entries(["expand_as", "broadcast_to", "tile", "concat", "stack", "gather", "index_select"], "layout", *_LAYOUT),
    # ``x[mask]`` with a mask of fewer dims than ``x`` (HF Switch Transformers' and Ling's experts
    # reading their tokens) is ``gather_nd(x, nonzero(mask))`` in the trace; eagerly, on a DistTensor
    # ``x``, Paddle 3.3 raises ``NotImplementedError: Only support reshape operation on DenseTensor
    # now`` (a dense mask: a segfault), docs/paddle-notes.md. An index of another kind (Qwen-MoE's
    # ``x[None, top_x]``, a ``stack`` of integer tensors) runs.
    "gather_nd": Op(
        "layout",
        traits=frozenset(_LAYOUT),
        masked_by=1,
        rewrite="write it without a boolean index (paddle.where, or a multiply by the mask)",
    ),
    "nonzero": Op("elementwise", traits=frozenset({"positions"})),
    **_entries(["expand", "repeat_interleave"], "layout", *_LAYOUT, "expand"),
    **_entries(["combine", "builtin.combine", "builtin.split", "builtin.slice"], "layout", *_LAYOUT),
    # -- values that do not depend on the data: a tensor of an operand's shape (its values are
    # constants, but on a distributed operand Paddle gives the result the operand's placements,
    # docs/paddle-notes.md "Masks") ...
    "full_like": Op("fill", moves=False, traits=frozenset({*_LAYOUT, "like", "untimed"})),
    **_entries(["zeros_like", "ones_like", "empty_like"], "fill", "like"),
    # ... constants the graph folds into their consumers' ``consts``, ranges, shapes, the inputs
    **_entries(["full", "full_int_array", "assign_value"], "constant", "untimed", moves=False),
    "arange": Op("source", moves=False, traits=frozenset({"untimed"})),
    **_entries(["shape", "shape64"], "shape", moves=False),
    "data": Op("input", moves=False, traits=frozenset({"untimed"})),
    # a model traced block by block: a block's input that the model's own glue computed
    "glue": Op("input", moves=False, traits=frozenset({"untimed"})),
}


def local_only_use(name: str, operands: Mapping[int, str]) -> str:
    """What of op ``name`` Paddle 3.3 cannot run on distributed tensors, in words ('' when it
    runs them), its operands computed by the ops ``operands`` (``{operand index: op name}``): a
    ``local_only`` op, or a read through a boolean mask (its ``masked_by`` operand a
    ``positions`` op's result). Such an op trains only where its layer runs on plain local tensors.

    >>> local_only_use("pd_op.einsum", {0: "pd_op.matmul"})
    'einsum'
    >>> local_only_use("pd_op.gather_nd", {0: "pd_op.matmul", 1: "pd_op.nonzero"})  # x[mask]
    "x[mask] (gather_nd of a boolean mask's positions)"
    >>> local_only_use("pd_op.gather_nd", {0: "pd_op.matmul", 1: "pd_op.stack"})   # x[None, index]
    ''
    """
    short, masked_by = short_op(name), op(name).masked_by
    if short in LOCAL_ONLY_OPS:
        return short
    if masked_by is not None and short_op(operands.get(masked_by, "")) in POSITIONS_OPS:
        return f"x[mask] ({short} of a boolean mask's positions)"
    return ""


def op(name: str) -> Op:
    """The catalogue's entry for a short or full op name; an op it does not list is an
    elementwise op of its own (priced by the memory it moves, keeping nothing)."""
    return CATALOGUE.get(short_op(name), _OTHER)


_OTHER = Op("elementwise")


def _named(trait: str) -> frozenset[str]:
    return frozenset(name for name, entry in CATALOGUE.items() if trait in entry.traits)


def _of_role(*roles: Role) -> frozenset[str]:
    return frozenset(name for name, entry in CATALOGUE.items() if entry.role in roles)


def _full(names: frozenset[str]) -> frozenset[str]:
    return frozenset(f"pd_op.{name}" for name in names)


#: Products of two factors (a linear's ``x @ W``, an attention's ``q @ k.T`` in any spelling).
PRODUCT_OPS = _of_role("product")
#: The products a linear layer computes with (a projection: one factor a 2-D weight).
LINEAR_OPS = frozenset(name for name, entry in CATALOGUE.items() if entry.product and entry.product.linear)
#: Ops that keep their input's layout, partial sums included: linear in their one input.
PASS_THROUGH_OPS = _named("pass_through")
#: Ops Paddle 3.3 does not run on distributed tensors at all, whatever their placements (and, by
#: their operands, reads through a boolean mask: :func:`local_only_use`).
LOCAL_ONLY_OPS = _named("local_only")
#: Ops giving the positions of a boolean mask's true entries (``nonzero``).
POSITIONS_OPS = _named("positions")
#: Ops that move, reshape, pick or re-type data without computing on it, plus the pass-through
#: ops: the matcher's compute view contracts them.
LAYOUT_OPS = _named("layout")
#: Ops changing a tensor's shape, not its elements or their order (token ids laid out anew:
#: ``input_ids.reshape([-1, seq])``, HF GPT-2's ``input_ids.view(-1, input_shape[-1])``).
RESHAPE_OPS = _named("reshape")
#: Ops whose SPMD rule works from the product of a value's sizes (a reshape's dim transforms):
#: meaningless for a size the trace does not know, and ``flatten``'s crashes the process then
#: (docs/paddle-notes.md, "SPMD rules"; recognise/spmd.py asks neither about such sizes).
SIZE_RULE_OPS = _named("size_rule")
#: Ops making a new tensor of their operand's shape (``full_like(scores, -inf)``).
LIKE_OPS = _named("like")
#: Ops that cut a tensor into pieces (a fused q|k|v or gate|up into its projections).
CUT_OPS = _named("cut")
#: Layout ops where a split that crosses a fused projection's segment boundaries shows.
SEGMENT_OPS = _named("segment")
#: Arithmetic of two operands, broadcasting: Paddle's SPMD rule for each is named after the op.
ARITHMETIC_OPS = _named("arithmetic")
#: Elementwise ops of two or more operands; layout-like in the view when all operands but one
#: are constants or buffers (``x + eps``, ``where(causal_mask, scores, fill)``).
ELEMENTWISE_OPS = ARITHMETIC_OPS | _named("select")
#: Elementwise functions of one tensor: a split on any dim stays where it is.
UNARY_OPS = _named("unary")
#: Ops computing attention in one kernel.
FUSED_ATTENTION_OPS = _of_role("fused_attention")
#: The program's inputs.
INPUT_OPS = _of_role("input")
#: A unit's input computed by the glue between units, when a model is traced block by block.
GLUE = "glue"
#: Ops that only move or retype a tensor: a weight seen through them is still the weight (which
#: product a parameter feeds, for the recognition and the cost model).
WEIGHT_VIEW_OPS = _named("weight_view")
#: Ops that broadcast or repeat a tensor along new or size-1 dims (GQA's K/V heads repeated).
EXPAND_OPS = _named("expand")
#: Reductions over some dims (``mean``, ``sum``).
REDUCTION_OPS = _of_role("reduction")
#: Ops picking the largest entries along an axis (an MoE router choosing experts).
SELECTION_OPS = _of_role("selection")
#: Ops reading a tensor's shape (a Python int when the model runs).
SHAPE_OPS = _of_role("shape")
#: Ops whose result depends on their input's shape only, never its values: constants for a
#: traced program with static shapes (``triu(full_like(scores))`` is a fixed causal mask).
SHAPE_ONLY_OPS = LIKE_OPS | SHAPE_OPS
#: Graph nodes the cost model does not count as a kernel launched each step: the program's
#: inputs and the fills and ranges it treats as constants.
UNTIMED_OPS = _named("untimed")

#: Full names. Ops whose only output is a value fixed at trace time: the graph folds them into
#: their consumers' ``consts`` (the in-place ``assign_value_`` too).
CONSTANT_OPS = _full(_of_role("constant")) | {"pd_op.assign_value_"}
#: Full names. Ops that mix information across sequence positions: a sub-layer holding one
#: needs the whole sequence, so sequence parallelism gathers its input and re-splits its output.
SEQUENCE_MIXING_OPS = _full(_named("mixing"))
