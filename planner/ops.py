"""Names of Paddle ops the recognition, the graph and the cost model treat alike, in one place (the
bottom of the planner: it imports nothing).

Short names (``pd_op.`` prefix and in-place ``_`` dropped, see :func:`autodist.planner.recognise.match.short_op`) unless
the set says it holds full names (``pd_op.softmax``), as the graph's nodes carry them.

    >>> "dropout" in PASS_THROUGH_OPS and "dropout" in LAYOUT_OPS
    True
"""

from __future__ import annotations

#: Ops that keep their input's layout, partial sums included: linear in their one input
#: (dropout is the identity in the eval-mode trace the planner makes; ``share_data`` is what
#: ``Tensor.detach()`` traces to: the same values, cut from autograd).
PASS_THROUGH_OPS = frozenset({"cast", "scale", "assign", "contiguous", "dropout", "share_data"})

#: Ops Paddle 3.3 does not run on distributed tensors at all, whatever their placements (``einsum``:
#: ``PreconditionNotMet: Arg must be a vector of TensorDistAttr``, docs/paddle-notes.md): a layer
#: using one trains under apply_plan only where it runs on plain local tensors (an MoE layer under
#: data or expert parallelism).
LOCAL_ONLY_OPS = frozenset({"einsum"})

#: Ops that move, reshape, pick or re-type data without computing on it, plus the
#: pass-through ops: the matcher's compute view contracts them.
LAYOUT_OPS = PASS_THROUGH_OPS | frozenset(
    {
        "reshape",
        "transpose",
        "unsqueeze",
        "squeeze",
        "expand",
        "expand_as",
        "broadcast_to",
        "tile",
        "flatten",
        "full_like",
        "slice",
        "strided_slice",
        "concat",
        "stack",
        "split",
        "split_with_num",
        "unbind",
        "gather",
        "gather_nd",
        "index_select",
        "combine",
        "repeat_interleave",
        "builtin.combine",
        "builtin.split",
        "builtin.slice",
    }
)

#: Ops making a new tensor of their operand's shape (``full_like(scores, -inf)``): their values are
#: constants, but on a distributed operand Paddle gives the result the operand's placements
#: (measured, docs/paddle-notes.md, "Masks"), so a fill beside head-split scores is split too.
LIKE_OPS = frozenset({"full_like", "zeros_like", "ones_like", "empty_like"})

#: Ops that cut a tensor into pieces (a fused q|k|v or gate|up into its projections).
CUT_OPS = frozenset({"slice", "strided_slice", "split", "split_with_num", "unbind", "chunk"})
#: Layout ops where a split that crosses a fused projection's segment boundaries shows.
SEGMENT_OPS = CUT_OPS | {"reshape"}

#: Arithmetic of two operands, broadcasting: Paddle's SPMD rule for each is named after the op.
ARITHMETIC_OPS = frozenset({"add", "subtract", "multiply", "divide", "maximum", "minimum"})
#: Elementwise ops of two or more operands; layout-like in the view when all operands but one
#: are constants or buffers (``x + eps``, ``where(causal_mask, scores, fill)``).
ELEMENTWISE_OPS = ARITHMETIC_OPS | {"where"}

#: Elementwise functions of one tensor: a split on any dim stays where it is.
UNARY_OPS = frozenset(
    {
        "tanh",
        "relu",
        "sigmoid",
        "exp",
        "abs",
        "log",
        "sqrt",
        "square",
        "erf",
        "relu6",
        "leaky_relu",
        "hardswish",
        "mish",
        "softplus",
        "clip",
        "neg",
        "sin",
        "cos",
        "rsqrt",
        "silu",
        "gelu",
    }
)

#: Ops computing attention in one kernel (GPU traces of ``F.scaled_dot_product_attention``),
#: inputs ``[batch, seq, heads, head_dim]``.
FUSED_ATTENTION_OPS = frozenset(
    {
        "flash_attn",
        "flash_attn_unpadded",
        "memory_efficient_attention",
        "fused_dot_product_attention",
        "variable_length_memory_efficient_attention",
        "flash_attn_qkvpacked",
        "flash_attn_varlen_qkvpacked",
    }
)

#: Full names. Ops whose only output is a value fixed at trace time: the graph folds them into
#: their consumers' ``consts``.
CONSTANT_OPS = frozenset({"pd_op.full", "pd_op.full_int_array", "pd_op.assign_value", "pd_op.assign_value_"})
#: Full names. Graph nodes the cost model does not count as a kernel launched each step: the
#: program's inputs and the fills and ranges it treats as constants (besides the folded
#: :data:`CONSTANT_OPS`, which are no nodes at all).
UNTIMED_OPS = CONSTANT_OPS | {"pd_op.full_like", "pd_op.arange", "pd_op.data"}

#: Full names. Ops that only move or retype a tensor: a weight seen through them is still the
#: weight (the cost model's view of which matmul a parameter feeds).
WEIGHT_VIEW_OPS = frozenset({"pd_op.transpose", "pd_op.reshape", "pd_op.cast", "pd_op.assign"})

#: Full names. Ops that mix information across sequence positions: a sub-layer holding one
#: needs the whole sequence, so sequence parallelism gathers its input and re-splits its output.
SEQUENCE_MIXING_OPS = frozenset({"pd_op.softmax"} | {f"pd_op.{op}" for op in FUSED_ATTENTION_OPS})
