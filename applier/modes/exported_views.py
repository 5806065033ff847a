"""``apply_local_views(model, plan)``: a plan's local views and local token lookups, for code that
lays the rest of the model out with Paddle's own ``dist.parallelize`` (the module
``autodist-plan export --to paddle-parallelize`` writes, the PaddleFormers ``Trainer``).

``dist.parallelize`` has no key for a sub-layer that runs on local tensors (``plan.local_view``:
a fused ``q|k|v`` or ``gate|up`` run at 1/mp width, Megatron's way) or for a token lookup in a
vocabulary-split table (``plan.vocab_lookup``). This installs exactly those, with
apply_plan's own installers (:mod:`~autodist.applier.modes.local_calls`,
:mod:`~autodist.applier.modes.vocab_lookup`):

- every parameter they hold is sharded here as the plan places it (a fused weight first laid out
  rank by rank, ``q_0|k_0|v_0|q_1|k_1|v_1``), and put back in every slot that held it (a tied LM
  head keeps sharing the table). ``dist.parallelize``'s ``ColWiseParallel``/``RowWiseParallel``
  leave a parameter that is already distributed alone, so call this *before* it;
- their forwards are replaced on the instance, as ``apply_plan`` replaces them.

Unlike ``apply_plan`` it does not copy rank 0's values or random state to the other ranks: seed
every rank alike (a dropout inside a local view must draw the same mask on every mp rank).

Nothing is changed when the plan does not fit the model: the problems are one
:class:`~autodist.schemas.PlanError`. Call it on every rank, with the plan's mesh set up by
the launcher (``python -m paddle.distributed.launch``).

Example::

    >>> import autodist, paddle.distributed as dist                     # doctest: +SKIP
    >>> model = autodist.apply_local_views(model, "plan.json")          # doctest: +SKIP
    >>> model, optimizer = dist.parallelize(model, optimizer, config=CONFIG)  # doctest: +SKIP
"""

from __future__ import annotations

from pathlib import Path

import paddle
import paddle.distributed as dist

from autodist.schemas import Plan, PlanError, load_plan
from autodist.schemas.parallelize import local_parameters

from autodist.applier.modes.local_calls import LocalViews, local_view_problems
from autodist.applier.placement.mesh import stage_mesh, stage_placements, to_paddle_placement
from autodist.applier.placement.shard import Slot, parameter_owners
from autodist.applier.modes.vocab_lookup import vocab_lookup_problems, wrap_vocab_lookups


def apply_local_views(
    model: paddle.nn.Layer, plan: Plan | str | Path, mesh: dist.ProcessMesh | None = None
) -> paddle.nn.Layer:
    """Shard the parameters of ``plan``'s local views and local token lookups and run those
    sub-layers on local tensors, on ``model`` in place (returned). A plan with neither leaves
    the model as it is. Raises :class:`~autodist.schemas.PlanError` naming every problem,
    with the model unchanged.

    ``mesh``: where the rest of the model lives, when that is not the plan's mesh but one over
    the same ranks with more axes (the PaddleFormers Trainer's keeps axes of size one that the
    plan leaves out; Paddle wants one mesh for all of an op's inputs): the parameters take the
    plan's placement on each axis the plan names, ``Replicate`` on the others."""
    source = "plan" if isinstance(plan, Plan) else str(plan)
    plan = plan if isinstance(plan, Plan) else load_plan(plan)
    if not plan.local_view and not plan.vocab_lookup:
        return model
    slots_of = parameter_owners(model)  # id(param) -> every slot holding it (a tied table has two)
    id_of = {slot.fqn: param_id for param_id, slots in slots_of.items() for slot in slots}
    names = local_parameters(plan)
    problems = local_view_problems(model, plan) + vocab_lookup_problems(model, plan)
    problems += [f"the model has no parameter {fqn}" for fqn in names if fqn not in id_of]
    problems += [
        f"{fqn}: already distributed; call apply_local_views before dist.parallelize"
        for fqn in names
        if fqn in id_of and _held(slots_of[id_of[fqn]]).is_dist()
    ]
    if problems:
        raise PlanError(problems, source)
    views = LocalViews(plan)
    for param_id in dict.fromkeys(id_of[fqn] for fqn in names):  # a tied parameter once
        slots = slots_of[param_id]
        old, fqn = _held(slots), next(f for f in names if id_of[f] == param_id)
        old.set_value(views.to_local_layout(fqn, old))
        planned = plan.params[fqn]
        if mesh is None:
            new = dist.shard_tensor(old, stage_mesh(plan, planned.stage), stage_placements(plan, planned.placements))
        else:
            by_axis = dict(zip(plan.mesh.axes, planned.placements))
            placements = [to_paddle_placement(by_axis.get(name, "R")) for name in mesh.dim_names]
            new = dist.shard_tensor(old, mesh, placements)
        for slot in slots:
            slot.layer._parameters[slot.key] = new
    views.wrap(model)
    wrap_vocab_lookups(model, plan)
    return model


def _held(slots: list[Slot]) -> paddle.Tensor:
    return slots[0].layer._parameters[slots[0].key]
