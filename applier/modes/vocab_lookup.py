"""Vocabulary-parallel token lookups (``plan.vocab_lookup``): Megatron-LM's ``VocabParallelEmbedding``.

Paddle 3.3.1's ``embedding`` rule wants the table replicated, so a lookup in a table split over
its vocabulary (``S(0)`` on mp) all-gathers the whole table in every forward and again in its
backward (docs/paddle-notes.md, "SPMD rules"). For a lookup the plan lists (a layer and its
table), each call of that layer runs its forward as written, and Paddle's ``embedding`` op
(``paddle._C_ops.embedding``, which ``nn.Embedding`` and ``F.embedding`` call) reading that table
is answered on local tensors, as Megatron-LM does; so an ``nn.Embedding``, a subclass scaling
``super().forward(ids)`` (HF MiniCPM's ``MiniCPMScaledWordEmbedding``) and a layer calling
``F.embedding(ids, self.weight)`` all look up so (the planner lists the layer from the dataflow:
``recognise/analysis.local_lookup``). The answer:

- the ids (a DistTensor replicated over mp, or a plain tensor: an evaluation loader's, the same
  on every rank) as this rank's local value; those outside its rows
  ``[start, start + rows)`` of the table are masked, the others shifted to ``id - start``
  (masked ids look up row 0, whose answer is then zeroed);
- the lookup on the rank's own rows of the table (:func:`~.local_calls.param_local`: the
  gradient comes back ``S(0)`` over mp, each rank's on its own rows, and Partial over dp, summed
  by the optimizer as any data-parallel gradient); a ``padding_idx`` in the rank's rows is passed
  on shifted, so its row answers zero and gets no gradient, as ``nn.Embedding(padding_idx=...)``
  does; one in another rank's rows is masked here and answered (zero) there;
- the ranks' answers summed over the mp line (one all-reduce, :class:`~.local_calls.SumOverRanks`,
  whose backward hands each rank the whole output gradient), handed back as a DistTensor placed
  as the ids are (plain ids: replicated on the table's mesh), which is where Paddle's global
  lookup places its output; under sequence parallelism, where the plan's post hook splits the
  layer's output over the sequence, left Partial over mp for that hook's reduce-scatter instead
  (:func:`~.local_calls.summed`, Megatron's ``reduce_scatter_embeddings``).

Nothing in the backward communicates for the table, and no rank ever holds it whole. A table the
LM head reads too (tied) still trains right: the head reads the distributed parameter in the global
view, and its gradient and the lookup's add on the same parameter. A call of the layer that looks
nothing up in its table raises: the plan's lookup would not have run.

Example::

    >>> wrap_vocab_lookups(model, plan)                         # doctest: +SKIP
"""

from __future__ import annotations

import functools
from typing import Callable

import paddle
import paddle.distributed as dist
from autodist.schemas import Plan, VocabLookup

from autodist.applier.placement.hooks import sequence_split_sides
from autodist.applier.modes.local_calls import local_value, mp_line, param_local, strategy_problems, summed

#: ``paddle._C_ops.embedding``'s ``padding_idx`` for none (``F.embedding`` turns None into it and
#: a negative index into one counted from the end of the whole table).
NO_PADDING = -1


def wrap_vocab_lookups(model: paddle.nn.Layer, plan: Plan) -> None:
    """Replace the forward of every layer ``plan.vocab_lookup`` lists, on the instance (after
    sharding: the table is a DistTensor then)."""
    if not plan.vocab_lookup:
        return
    layers = dict(model.named_sublayers())
    line = mp_line(plan, dist.get_rank())
    for lookup in plan.vocab_lookup:
        owner, _, name = lookup.weight.rpartition(".")
        table = functools.partial(getattr, layers[owner] if owner else model, name)
        local = _local_lookup(lookup, line, sequence_split_sides(plan, lookup.layer)[1])
        layer = layers[lookup.layer]
        layer.forward = answering(layer.forward, lookup, table, local)


def answering(
    forward: Callable[..., object],
    lookup: VocabLookup,
    table: Callable[[], paddle.Tensor],
    local: Callable[[Callable, paddle.Tensor, paddle.Tensor, int], paddle.Tensor],
) -> Callable[..., object]:
    """``forward`` run as written, with each call of Paddle's ``embedding`` op on ``table()`` (the
    parameter as it is at the call) answered by ``local(embedding, ids, table, padding_idx)``
    instead (``embedding`` is Paddle's op, for the answer's own lookup); other tables' lookups
    run as ever, and so does this table's outside ``forward``. A call that never looks the table
    up raises.

    >>> emb, other = paddle.nn.Embedding(11, 4), paddle.nn.Embedding(11, 4)
    >>> def scaled(ids):
    ...     return emb(ids) * 3.0
    >>> run = answering(scaled, VocabLookup("emb", "emb.weight"), lambda: emb.weight,
    ...                 lambda embedding, ids, table, pad: embedding(ids, other.weight, pad, False))
    >>> ids = paddle.to_tensor([1, 5])
    >>> bool((run(ids) == other(ids) * 3.0).all())
    True
    """

    @functools.wraps(forward)
    def run(*args: object, **kwargs: object) -> object:
        paddle_op, ours, answered = paddle._C_ops.embedding, table(), []

        def embedding_op(
            x: paddle.Tensor, weight: paddle.Tensor, padding_idx: int = NO_PADDING, sparse: bool = False
        ) -> paddle.Tensor:
            if weight is not ours:
                return paddle_op(x, weight, padding_idx, sparse)
            if sparse:
                raise RuntimeError(f"vocab_lookup {lookup.layer}: {lookup.weight} is looked up sparse")
            answered.append(True)
            return local(paddle_op, x, weight, padding_idx)

        paddle._C_ops.embedding = embedding_op
        try:
            out = forward(*args, **kwargs)
        finally:
            paddle._C_ops.embedding = paddle_op
        if not answered:
            raise RuntimeError(
                f"vocab_lookup {lookup.layer}: the call looked nothing up in {lookup.weight}, "
                "so the plan's lookup on local tensors did not run"
            )
        return out

    return run


def _local_lookup(
    lookup: VocabLookup, line: dist.ProcessMesh, split: bool
) -> Callable[[Callable, paddle.Tensor, paddle.Tensor, int], paddle.Tensor]:
    """Megatron's lookup of ``ids`` in the vocabulary-split ``table`` (the module's docstring)."""
    position = line.process_ids.index(dist.get_rank())

    def local(embedding: Callable, x: paddle.Tensor, table: paddle.Tensor, padding_idx: int) -> paddle.Tensor:
        if x.is_dist():
            if any(
                not isinstance(p, dist.Replicate) for n, p in zip(x.process_mesh.dim_names, x.placements) if n == "mp"
            ):
                raise RuntimeError(f"vocab_lookup: {lookup.layer} wants its ids replicated over mp, got {x.placements}")
            ids, mesh, placements = local_value(x), x.process_mesh, x.placements
        else:  # ids from a loader apply_plan did not wrap (an evaluation's): the same on every
            # rank, and answered replicated on the table's mesh, as Paddle's global lookup does
            ids, mesh = x, table.process_mesh
            placements = [dist.Replicate() for _ in mesh.dim_names]
        rows_of_rank = param_local(table, list(placements))
        rows = rows_of_rank.shape[0]
        start = position * rows
        inside = (ids >= start) & (ids < start + rows)
        shifted = paddle.where(inside, ids - start, paddle.zeros_like(ids))
        local_pad = padding_idx - start if start <= padding_idx < start + rows else NO_PADDING
        found = embedding(shifted, rows_of_rank, local_pad, False)
        found = found * inside.unsqueeze(-1).astype(found.dtype)
        return summed(found, mesh, placements, line, split)

    return local


def vocab_lookup_problems(model: paddle.nn.Layer, plan: Plan) -> list[str]:
    """Why ``plan.vocab_lookup`` cannot run on ``model``: a layer or a table (a parameter) the
    model lacks, a table not placed ``S(0)`` on mp, or a strategy local views do not run under
    (:func:`~autodist.schemas.parallel_dims.runs_local_views`). Whether the layer's calls look the
    table up shows in its first call (:func:`answering`)."""
    if not plan.vocab_lookup:
        return []
    problems = strategy_problems("vocab_lookup", plan)
    layers = dict(model.named_sublayers())
    params = dict(model.named_parameters())
    for lookup in plan.vocab_lookup:
        where = f"vocab_lookup {lookup.layer}"
        if lookup.layer not in layers:
            problems.append(f"{where}: the model has no layer {lookup.layer}")
        if lookup.weight not in params:
            problems.append(f"{where}: the model has no parameter {lookup.weight}")
        planned = plan.params.get(lookup.weight)
        got = planned.placements[plan.mesh.axes.index("mp")] if planned and "mp" in plan.mesh.axes else "R"
        if got != "S(0)":
            problems.append(
                f"{where}: {lookup.weight} is placed {got} on mp; the lookup needs it S(0) (its vocabulary)"
            )
    return problems
