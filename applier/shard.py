"""Replace every planned parameter by a distributed one on its stage's mesh.

A Parameter reachable under several names (tied weights: an LM head sharing the embedding
table) is sharded once and the one new object is put back under every name, so the tie
survives; sharding the copies separately would train two diverging tables
(docs/paddle-notes.md, "Parameters and optimizers"). The exception is a name the plan puts on
another pipeline stage (``tied_stages``): it gets its own copy on that stage's mesh, which the
pipeline schedule keeps equal to the original by summing their gradients.

Parameters of a model built under ``paddle.LazyGuard()`` have no storage yet: they are sharded
first and initialised after, so each rank allocates only its own shard.

Example::

    >>> pairs = shard_parameters(model, plan)               # doctest: +SKIP
    >>> model.lm_head.weight.placements  # doctest: +SKIP
    [Replicate(), Shard(dim=1)]
"""

from __future__ import annotations

import warnings
from typing import NamedTuple

import paddle
import paddle.distributed as dist

from autodist.schemas import Plan

from autodist.applier.mesh import stage_mesh, stage_placements


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


#: Said once per apply_plan of a lazily built model (docs/paddle-notes.md, "Parameters and optimizers").
LAZY_START = (
    "apply_plan: the model was built under paddle.LazyGuard(), so each rank initialises its shards from its "
    "own random stream, in parameter-name order: training starts from other weights than an eager build with "
    "the same seed would (not a wrong training, another start); load a checkpoint for an exact start"
)


def shard_parameters(model: paddle.nn.Layer, plan: Plan) -> list[tuple[paddle.Tensor, paddle.Tensor]]:
    """Shard each planned parameter (``dist.shard_tensor`` on its stage mesh, with its
    placements), put it back in every slot that held the old one, and initialise lazily built
    ones. Returns the ``(old, new)`` parameter pairs."""
    slots_by_fqn = {slot.fqn: slots for slots in parameter_owners(model).values() for slot in slots}
    replaced, lazy = [], []
    for fqn in sorted(plan.params):
        planned = plan.params[fqn]
        slots = slots_by_fqn[fqn]
        old = slots[0].layer._parameters[slots[0].key]
        placements = stage_placements(plan, planned.placements)
        new = dist.shard_tensor(old, stage_mesh(plan, planned.stage), placements)
        # A name tied across stages (an LM head sharing the embedding) holds its own copy on its
        # stage; the pipeline keeps the copies equal (pipeline.py).
        copies = {alias: dist.shard_tensor(old, stage_mesh(plan, stage), placements)
                  for alias, stage in sorted(planned.tied_stages.items())}
        for slot in slots:
            slot.layer._parameters[slot.key] = copies.get(slot.fqn, new)
        replaced += [(old, new)] + [(old, copy) for copy in copies.values()]
        if not old._is_initialized():  # built under LazyGuard
            lazy += [new, *copies.values()]
    if lazy:
        warnings.warn(LAZY_START, stacklevel=3)
    for new in lazy:
        # After sharding: allocates this rank's shard only (nothing off the param's mesh).
        new.initialize()
    return replaced
