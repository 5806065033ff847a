"""Replace every planned parameter by a distributed one on its stage's mesh.

A Parameter reachable under several names (tied weights: an LM head sharing the embedding
table) is sharded once and the one new object is put back under every name, so the tie
survives; sharding the copies separately would train two diverging tables
(docs/paddle-notes.md, "Parameters and optimizers"). The exception is a name the plan puts on
another pipeline stage (``tied_stages``): it gets its own copy on that stage's mesh, which the
pipeline schedule keeps equal to the original by summing their gradients. A weight tied by a
function call (the head ``paddle.matmul(h, self.wte.weight, transpose_y=True)``, ``tied_stages``
naming the parameter itself) has one name only: on the ranks of the other stage that name holds
the copy, since those ranks never run the stage that reads the original.

Parameters of a model built under a LazyGuard have no storage yet: each is initialised whole,
in the order they were created, sharded, and the whole tensor freed, so a lazily built model
starts from the eager build's values (lazy.py).

Example::

    >>> pairs = shard_parameters(model, plan).pairs         # doctest: +SKIP
    >>> model.lm_head.weight.placements  # doctest: +SKIP
    [Replicate(), Shard(dim=1)]
"""

from __future__ import annotations

from typing import NamedTuple

import paddle
import paddle.distributed as dist

from autodist.schemas import Plan

from autodist.applier.placement import lazy
from autodist.applier.modes.local_calls import LocalViews
from autodist.applier.placement.mesh import stage_mesh, stage_placements


class Slot(NamedTuple):
    """One place a Parameter is held: ``layer._parameters[key]``, known to users as ``fqn``."""

    fqn: str
    layer: paddle.nn.Layer
    key: str


def parameter_owners(model: paddle.nn.Layer) -> dict[int, list[Slot]]:
    """Every slot of every Parameter object, keyed by ``id(param)``; a tied Parameter has
    several slots. Unlike ``named_parameters()`` this does not drop the duplicate names."""
    owners: dict[int, list[Slot]] = {}
    for prefix, layer in model.named_sublayers(include_self=True):
        for key, param in layer._parameters.items():
            if param is not None:
                fqn = f"{prefix}.{key}" if prefix else key
                owners.setdefault(id(param), []).append(Slot(fqn, layer, key))
    return owners


class Sharded(NamedTuple):
    """What :func:`shard_parameters` made: the ``(old, new)`` parameter pairs (a copy on another
    stage is a pair too), ``copies[(name, stage)]``, the copy a tied name holds on a stage
    (for a tie by function call, also the original on the parameter's own stage)."""

    pairs: list[tuple[paddle.Tensor, paddle.Tensor]]
    copies: dict[tuple[str, int], paddle.Tensor]


def shard_parameters(model: paddle.nn.Layer, plan: Plan, dropped: frozenset[str] = frozenset()) -> Sharded:
    """Shard each planned parameter (``dist.shard_tensor`` on its stage mesh, with its
    placements) and put it back in every slot that held the old one; remove the ``dropped``
    ones (experts other ranks hold, experts.py) from the model. A lazily built parameter
    is first initialised whole, in creation order (lazy.py), and freed once sharded or dropped."""
    slots_by_fqn = {slot.fqn: slots for slots in parameter_owners(model).values() for slot in slots}
    held = {fqn: slots[0].layer._parameters[slots[0].key] for fqn, slots in slots_by_fqn.items()}
    turn = lazy.creation_turns(model, [held[fqn] for fqn in plan.params])
    replaced_layers = lazy.Dropped(list(held.values()))  # built with the model, no longer in it
    replaced, copied = [], {}
    me = dist.get_rank()
    local_views = LocalViews(plan)
    for fqn in sorted(plan.params, key=lambda f: (turn[id(held[f])], f)):
        planned = plan.params[fqn]
        slots = slots_by_fqn[fqn]
        old = held[fqn]
        built_lazily = lazy.is_lazy(old)
        if built_lazily:  # whole, on every rank, from the global generator: the eager build's draw
            replaced_layers.draw_before(old)
            lazy.materialise(old, [slot.layer for slot in slots])
        if fqn in dropped:  # drawn all the same, so the next parameters draw what the eager build did
            for slot in slots:
                del slot.layer._parameters[slot.key]
            old._set_impl(paddle.Tensor())  # freed now, though the user's old optimizer still names it
            continue
        if fqn in local_views.weights:  # a fused weight's segments, rank by rank (local_view.py)
            old.set_value(local_views.to_local_layout(fqn, old))
        placements = stage_placements(plan, planned.placements)
        new = dist.shard_tensor(old, stage_mesh(plan, planned.stage), placements)
        # A name tied across stages (an LM head sharing the embedding) holds its own copy on its
        # stage; the pipeline keeps the copies equal (pipeline.py).
        copies = {
            alias: dist.shard_tensor(old, stage_mesh(plan, stage), placements)
            for alias, stage in sorted(planned.tied_stages.items())
        }
        # Tied by function call: on the ranks of the copy's stage, the one name holds the copy.
        called_stage = planned.tied_stages.get(fqn)
        here = new
        if called_stage is not None and me in stage_mesh(plan, called_stage).process_ids:
            here = copies[fqn]
        for slot in slots:
            slot.layer._parameters[slot.key] = copies.get(slot.fqn, here) if slot.fqn != fqn else here
        replaced += [(old, new)] + [(old, copy) for copy in copies.values()]
        copied.update({(alias, planned.tied_stages[alias]): copy for alias, copy in copies.items()})
        if called_stage is not None:
            copied[(fqn, planned.stage)] = new
        if built_lazily:
            old._set_impl(paddle.Tensor())  # drop the whole tensor (not _clear_data: new may share it)
    return Sharded(replaced, copied)
