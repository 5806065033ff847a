"""Vocabulary-parallel token lookups (``plan.vocab_lookup``): Megatron-LM's ``VocabParallelEmbedding``.

Paddle 3.3.1's ``embedding`` rule wants the table replicated, so a lookup in a table split over
its vocabulary (``S(0)`` on mp) all-gathers the whole table in every forward and again in its
backward (docs/paddle-notes.md, "SPMD rules"). For an ``nn.Embedding`` the plan lists, each rank
instead runs its forward on local tensors, as Megatron-LM does:

- the ids (a DistTensor replicated over mp, or a plain tensor: an evaluation loader's, the same
  on every rank) as this rank's local value; those outside its rows
  ``[start, start + rows)`` of the table are masked, the others shifted to ``id - start``
  (masked ids look up row 0, whose answer is then zeroed);
- ``F.embedding`` on the rank's own rows of the table (:func:`~.local_calls.param_local`: the
  gradient comes back ``S(0)`` over mp, each rank's on its own rows, and Partial over dp, summed
  by the optimizer as any data-parallel gradient); a ``padding_idx`` in the rank's rows is passed
  on shifted, so its row answers zero and gets no gradient, as ``nn.Embedding(padding_idx=...)``
  does; one in another rank's rows is masked here and answered (zero) there;
- the ranks' answers summed over the mp line (one all-reduce, :class:`~.local_calls.SumOverRanks`,
  whose backward hands each rank the whole output gradient), handed back as a DistTensor placed
  as the ids are (plain ids: replicated on the table's mesh), which is where Paddle's global
  lookup places its output; under sequence parallelism, where the plan's post hook splits the
  output over the sequence, left Partial over mp for that hook's reduce-scatter instead
  (:func:`~.local_calls.summed`, Megatron's ``reduce_scatter_embeddings``).

Nothing in the backward communicates for the table, and no rank ever holds it whole. A table the
LM head reads too (tied) still trains right: the head reads the distributed parameter in the global
view, and its gradient and the lookup's add on the same parameter.

Example::

    >>> wrap_vocab_lookups(model, plan)                         # doctest: +SKIP
"""

from __future__ import annotations

import functools

import paddle
import paddle.distributed as dist
import paddle.nn.functional as F
from autodist.schemas import Plan, VocabLookup

from autodist.applier.placement.hooks import sequence_split_sides
from autodist.applier.modes.local_calls import local_value, mp_line, param_local, strategy_problems, summed


def wrap_vocab_lookups(model: paddle.nn.Layer, plan: Plan) -> None:
    """Replace the forward of every lookup ``plan.vocab_lookup`` lists, on the instance (after
    sharding: the table is a DistTensor then)."""
    if not plan.vocab_lookup:
        return
    layers = dict(model.named_sublayers())
    line = mp_line(plan, dist.get_rank())
    for lookup in plan.vocab_lookup:
        _wrap(layers[lookup.layer], lookup, line, sequence_split_sides(plan, lookup.layer)[1])


def _wrap(layer: paddle.nn.Embedding, lookup: VocabLookup, line: dist.ProcessMesh, split: bool) -> None:
    position = line.process_ids.index(dist.get_rank())

    @functools.wraps(layer.forward)
    def run(*args: paddle.Tensor, **kwargs: paddle.Tensor) -> paddle.Tensor:
        (x,) = (*args, *kwargs.values())  # nn.Embedding's forward takes one tensor, as x or input
        if x.is_dist():
            if any(
                not isinstance(p, dist.Replicate) for n, p in zip(x.process_mesh.dim_names, x.placements) if n == "mp"
            ):
                raise RuntimeError(f"vocab_lookup: {lookup.layer} wants its ids replicated over mp, got {x.placements}")
            ids, mesh, placements = local_value(x), x.process_mesh, x.placements
        else:  # ids from a loader apply_plan did not wrap (an evaluation's): the same on every
            # rank, and answered replicated on the table's mesh, as Paddle's global lookup does
            ids, mesh = x, layer.weight.process_mesh
            placements = [dist.Replicate() for _ in mesh.dim_names]
        table = param_local(layer.weight)
        rows = table.shape[0]
        start = position * rows
        inside = (ids >= start) & (ids < start + rows)
        shifted = paddle.where(inside, ids - start, paddle.zeros_like(ids))
        pad = layer._padding_idx
        if pad is not None and pad < 0:  # counted from the end of the whole table, as nn.Embedding does
            pad += layer._num_embeddings
        local_pad = pad - start if pad is not None and start <= pad < start + rows else None
        found = F.embedding(shifted, table, padding_idx=local_pad)
        found = found * inside.unsqueeze(-1).astype(found.dtype)
        return summed(found, mesh, placements, line, split)

    layer.forward = run


def vocab_lookup_problems(model: paddle.nn.Layer, plan: Plan) -> list[str]:
    """Why ``plan.vocab_lookup`` cannot run on ``model``: a layer that is not an ``nn.Embedding``
    running its own forward on the listed table (with neither ``max_norm``, ``sparse`` nor
    ``scale_grad_by_freq``), a table not placed ``S(0)`` on mp, or a strategy local views do not
    run under (:func:`~autodist.schemas.parallel_dims.runs_local_views`)."""
    if not plan.vocab_lookup:
        return []
    problems = strategy_problems("vocab_lookup", plan)
    layers = dict(model.named_sublayers())
    params = dict(model.named_parameters())
    for lookup in plan.vocab_lookup:
        where = f"vocab_lookup {lookup.layer}"
        layer = layers.get(lookup.layer)
        if not isinstance(layer, paddle.nn.Embedding) or type(layer).forward is not paddle.nn.Embedding.forward:
            problems.append(
                f"{where}: the model's layer is {type(layer).__name__ if layer is not None else 'missing'}, "
                "not an nn.Embedding running its own forward"
            )
            continue
        if layer._max_norm or layer._sparse or layer._scale_grad_by_freq:
            problems.append(
                f"{where}: an nn.Embedding with max_norm, sparse or scale_grad_by_freq runs in the global view"
            )
        if params.get(lookup.weight) is not layer.weight:
            problems.append(f"{where}: its table is not {lookup.weight}")
        planned = plan.params.get(lookup.weight)
        got = planned.placements[plan.mesh.axes.index("mp")] if planned and "mp" in plan.mesh.axes else "R"
        if got != "S(0)":
            problems.append(
                f"{where}: {lookup.weight} is placed {got} on mp; the lookup needs it S(0) (its vocabulary)"
            )
    return problems
