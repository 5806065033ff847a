"""Trace a loop over the selected rows of a tensor as the loop over every row.

HuggingFace's MoE blocks (Qwen3-MoE, Mixtral, Qwen2-MoE) run only the experts that got tokens::

    expert_hit = torch.greater(expert_mask.sum(dim=(-1, -2)), 0).nonzero()
    for expert_idx in expert_hit:
        expert_layer = self.experts[expert_idx]      # Paddle: self.experts[int(expert_idx)]

How many rows ``nonzero`` returns, and which, is known only when the model runs, so a static
trace (``to_static(full_graph=True)``) can neither unroll the loop nor pick a layer by
``int(expert_idx)``: dy2static makes the loop a ``while`` op and the index a ``cast`` (a
``KeyError`` in ``LayerList.__getitem__``). While :func:`every_selection_taken` is active, the
trace takes the case where every element is selected (every expert got tokens, the usual case
in training), answering for a ``nonzero`` result over a tensor of static shape:

- ``len()`` of it: the number of elements it was taken over;
- ``int()`` of its row ``i`` (a loop over it, the tensor 1-D): ``i``;
- ``.tolist()`` of its column ``j`` (``nonzero(x, as_tuple=True)[j]``, HF's Switch
  Transformers and Qwen2-MoE): every element's index along axis ``j``;
- ``.numel()`` of it or of a column: that size, so a guard such as HF DeepSeek-V3's
  ``if token_indices.numel() > 0:`` around each expert is taken, not a ``cond`` op whose
  branch the planner would not see;
- ``.tolist()`` of ``bincount(indices, minlength=m)`` (DeepSeek-V3's own inference code counts
  each expert's tokens so and skips ``if counts[i] == 0``): ``m`` even, non-zero shares.

The program is then the forward of that case, which is all the planner reads it for: which
layers run on which values. Any other ``len()``, ``int()``, ``.tolist()`` or ``.numel()`` is
Paddle's own.

Example::

    >>> experts = paddle.nn.LayerList([paddle.nn.Linear(3, 3) for _ in range(3)])
    >>> def forward(x):
    ...     out = x * 0
    ...     for e in paddle.nonzero(x.sum(axis=0) > 0):
    ...         out = out + experts[int(e)](x)
    ...     return out
    >>> static = paddle.jit.to_static(forward, input_spec=[paddle.static.InputSpec([4, 3])], full_graph=True)
    >>> with every_selection_taken():
    ...     ops = static.concrete_program.main_program.global_block().ops
    >>> sum(op.name() == "pd_op.matmul" for op in ops)  # every expert's linear, once
    3
    >>> _ = static.rollback()

The guarded form (HF DeepSeek-V3's experts loop)::

    >>> def guarded(x):
    ...     out = x * 0
    ...     for e in range(3):
    ...         rows, cols = paddle.where(x[:, e:e + 1] > 0)
    ...         if rows.numel() > 0:
    ...             out = paddle.index_add(out, rows, 0, experts[e](x[rows]))
    ...     return out
    >>> static = paddle.jit.to_static(guarded, input_spec=[paddle.static.InputSpec([4, 3])], full_graph=True)
    >>> with every_selection_taken():
    ...     ops = static.concrete_program.main_program.global_block().ops
    >>> sum(op.name() == "pd_op.matmul" for op in ops), sum(op.name() == "pd_op.if" for op in ops)
    (3, 0)
    >>> _ = static.rollback()

The counted form (DeepSeek-V3's own ``MoE.forward``)::

    >>> def counted(x):
    ...     out, indices = x * 0, paddle.topk(x, 2)[1]
    ...     counts = paddle.bincount(indices.flatten(), minlength=3).tolist()
    ...     for e in range(3):
    ...         if counts[e] == 0:
    ...             continue
    ...         rows, top = paddle.where(indices == e)
    ...         out = paddle.index_add(out, rows, 0, experts[e](x[rows]))
    ...     return out
    >>> static = paddle.jit.to_static(counted, input_spec=[paddle.static.InputSpec([4, 3])], full_graph=True)
    >>> with every_selection_taken():
    ...     ops = static.concrete_program.main_program.global_block().ops
    >>> sum(op.name() == "pd_op.matmul" for op in ops)
    3
    >>> _ = static.rollback()
"""

from __future__ import annotations

import math
from contextlib import contextmanager

import numpy as np
import paddle
import paddle.jit.dy2static as jst
from paddle.pir import Value


@contextmanager
def every_selection_taken():
    """``len()``, ``int()``, ``.tolist()`` and ``.numel()`` of traced values, specialised to a
    ``nonzero`` that selects everything (module docstring), for the ``with`` body."""
    length, as_dtype = jst.Len, jst.AsDtype

    @paddle.jit.not_to_static
    def dense_length(value):
        source = _selected_from(value)
        return math.prod(source) if source is not None else length(value)

    @paddle.jit.not_to_static
    def dense_as_dtype(value, dtype):
        index = _selected_index(value) if dtype == "int" else None
        return index if index is not None else as_dtype(value, dtype)

    @paddle.jit.not_to_static
    def dense_tolist(value):
        answer = _selected_column(value)
        answer = answer if answer is not None else _even_counts(value)
        return answer if answer is not None else tolist(value)

    @paddle.jit.not_to_static
    def dense_numel(value):
        column, source = _selected_column(value), _selected_from(value)
        if column is not None:
            return len(column)
        return math.prod(source) * len(source) if source is not None else numel(value)  # rows x axes

    tolist, numel = Value.tolist, Value.numel
    jst.Len, jst.AsDtype, Value.tolist, Value.numel = dense_length, dense_as_dtype, dense_tolist, dense_numel
    try:
        yield
    finally:
        jst.Len, jst.AsDtype, Value.tolist, Value.numel = length, as_dtype, tolist, numel


def _selected_from(value) -> list[int] | None:
    """The shape ``nonzero`` was taken over, when ``value`` is its result of unknown length."""
    if not isinstance(value, Value) or not value.is_dense_tensor_type() or value.shape[0] >= 0:
        return None
    op = _defined_by(value, "pd_op.nonzero")
    shape = list(op.operand_source(0).shape) if op is not None else []
    return shape if shape and all(d > 0 for d in shape) else None


def _selected_index(value) -> int | None:
    """``i`` when ``value`` is row ``i`` of a ``nonzero`` result over a 1-D tensor (a loop over
    the result takes its rows by ``slice`` at a constant start), else None."""
    row = _defined_by(value, "pd_op.slice") if isinstance(value, Value) else None
    if row is None or row.attrs().get("axes") != [0]:
        return None
    source = _selected_from(row.operand_source(0))
    start = _defined_by(row.operand_source(1), "pd_op.full_int_array")
    if source is None or len(source) != 1 or start is None:
        return None
    return int(start.attrs()["value"][0])


def _selected_column(value) -> list[int] | None:
    """The indices along axis ``j`` of every element, when ``value`` is column ``j`` of a
    ``nonzero`` result (``nonzero(x, as_tuple=True)[j]``), else None."""
    column = _defined_by(value, "pd_op.slice") if isinstance(value, Value) else None
    if column is None or column.attrs().get("axes") != [1]:
        return None
    source = _selected_from(column.operand_source(0))
    start = _defined_by(column.operand_source(1), "pd_op.full_int_array")
    if source is None or start is None:
        return None
    return np.indices(source).reshape(len(source), -1)[start.attrs()["value"][0]].tolist()


def _even_counts(value) -> list[int] | None:
    """Every bin's even share, when ``value`` is ``bincount(x, minlength=m)`` of a tensor of
    static size ``n`` with ``m`` a constant (the experts a token may be routed to): ``m`` counts of
    ``max(1, n // m)``, every expert with tokens; else None."""
    op = _defined_by(value, "pd_op.bincount") if isinstance(value, Value) else None
    if op is None or op.num_operands() < 3:
        return None
    size, bins = list(op.operand_source(0).shape), _defined_by(op.operand_source(2), "pd_op.full")
    if bins is None or not size or any(d < 0 for d in size) or int(bins.attrs()["value"]) < 1:
        return None
    count = int(bins.attrs()["value"])
    return [max(1, math.prod(size) // count)] * count


def _defined_by(value, name: str):
    op = value.get_defining_op()
    return op if op is not None and op.name() == name else None
