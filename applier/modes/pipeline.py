"""Pipeline schedules ``1F1B`` and ``VPP`` for the user's own model, through Paddle's
``paddle.distributed.auto_parallel.pipelining`` (``PipelineStage``, ``Schedule1F1B``,
``ScheduleVPP``).

The plan's ``sequential`` schedule needs nothing here: its stage hand-off hooks (hooks.py)
move each block's output onto the next stage's mesh inside an ordinary training loop, and
the stages run one after another.

A real schedule runs micro-batches of different stages at the same time, so each rank needs
a *stage module* for each of its chunks, taking the previous chunk's output. autodist builds
them from the user's model without rewriting it or tracing it again. A pipeline cuts the
model between *units* (the plan's blocks; for a ``paddle.nn.Sequential`` without blocks, its
children), and a *chunk* is a run of consecutive units on one stage (schemas/schedules.py).
A chunk's :class:`StageChunk` runs **the model's own forward** with three changes, active only
while that chunk runs:

- units of other chunks are *stubbed*: their forward returns its first input unchanged, and
  layers holding parameters used before the first unit (the embeddings) return the received
  activation, so no op ever touches another stage's parameters (on the CPU wheel an op on a
  mesh the rank is not part of segfaults, docs/paddle-notes.md, "Collectives on the CPU wheel");
- a forward pre-hook on the chunk's first unit replaces that unit's first input with the
  activation received from the previous chunk;
- a forward post-hook on the chunk's last unit stops the forward (an exception the chunk
  catches) and hands that unit's first output tensor on — except on the last chunk, whose
  forward runs to the end and returns the first tensor of the model's output (the logits).

Everything between the units — position ids, rotary tables, causal masks — is the model's own
code and is recomputed on each stage from the model's inputs, which travel along with the
activation (they take no gradient). So the user's model file stays unchanged, and the only
thing a stage sends is what the model itself passes from block to block. (The alternative,
torchtitan's per-stage copies with the other layers deleted, needs a forward written to skip
missing layers; splitting the traced program would trace again at run time.)

Tied weights across stages (an LM head on the last stage sharing the embedding's table on the
first, ``ParamPlan.tied_stages``): the last stage holds its own copy, and Paddle's
``PipelineStage(shared_parameters=...)`` broadcasts it from the first stage when the stage is
built and sums the two gradients after each step, as Megatron-LM does.

``apply_plan`` then returns a :class:`PipelineModel`: it holds only this rank's chunks (so
the rebuilt optimizer holds exactly this rank's parameters) and runs a whole training step::

    model, opt, loader = apply_plan(model, opt, loader, "plan.json", loss_fn=loss_fn)
    for inputs, labels in loader:
        losses = model.step(inputs, target=labels)  # forward + backward of every micro-batch
        opt.step()                                   # losses: one per micro-batch on the last stage,
        opt.clear_grad()                             # [] on the other stages

``loss_fn(logits, labels)`` receives the first tensor the model returns. Paddle's schedules
add the micro-batches' gradients; autodist divides each micro-batch loss by the micro-batch
count for backward (and reports it undivided), so a step trains exactly like the whole batch
with a mean loss on one device.

On Paddle 3.3.1's CPU wheel ``batch_isend_irecv`` under gloo times out (docs/paddle-notes.md,
"Collectives on the CPU wheel"), so the schedules cannot run there as they are; with a test-only
stand-in that runs each P2P op as a blocking send/recv (tests/harness/cpu_substitutes.py) they
train on 2 CPU ranks equal to one device. A pipeline with dp or mp inside each stage also needs
one process group per pipeline column, made one at a time (gloo fails on groups made back to
back, :func:`~autodist.applier.placement.mesh.new_group`); pp2 x mp2 trains on 4 CPU ranks that way.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Iterator

import paddle
import paddle.distributed as dist

from autodist.schemas import Plan
from autodist.schemas.schedules import PIPELINING_SCHEDULES, chunk_stages, schedule_problems

from autodist.applier.placement.hooks import first_input, first_tensor, map_first_input
from autodist.applier.placement.mesh import new_group, pp_group_ranks, stage_of_rank
from autodist.applier.ranks.readable import pipeline_losses
from autodist.applier.placement.shard import parameter_owners


def uses_schedule(plan: Plan) -> bool:
    """True when the plan runs its stages with a real pipelining schedule."""
    return plan.strategy.schedule in PIPELINING_SCHEDULES


# -- the cut: units, chunks, and who owns which parameter -----------------------------------------------


def stage_units(model: paddle.nn.Layer, plan: Plan) -> list[tuple[str, int]]:
    """``[(layer FQN, stage), ...]`` of the units a pipeline cuts between, in forward order:
    the plan's blocks, else the children of a ``paddle.nn.Sequential`` (a child without
    parameters on the stage of the child before it), else none."""
    if plan.blocks:
        return [(block.layer, block.stage) for block in plan.blocks]
    if not isinstance(model, paddle.nn.Sequential):
        return []
    units: list[tuple[str, int]] = []
    for name, child in model.named_children():
        planned = (plan.params.get(f"{name}.{fqn}") for fqn, _ in child.named_parameters())
        stages = sorted({p.stage for p in planned if p is not None})  # unplanned: validation reports them
        units.append((name, stages[0] if stages else (units[-1][1] if units else 0)))
    return units


def chunk_units(units: list[tuple[str, int]]) -> list[list[str]]:
    """The units of each chunk (runs of consecutive units on one stage), in order."""
    chunks: list[list[str]] = []
    for i, (layer, stage) in enumerate(units):
        if i == 0 or units[i - 1][1] != stage:
            chunks.append([])
        chunks[-1].append(layer)
    return chunks


def _unit_of(fqn: str, units: list[tuple[str, int]]) -> str | None:
    return next((layer for layer, _ in units if fqn.startswith(layer + ".")), None)


def _contains_a_unit(layer: str, units: list[tuple[str, int]]) -> bool:
    return any(layer == "" or unit.startswith(layer + ".") for unit, _ in units)


def called_on_last_stage(plan: Plan) -> frozenset[str]:
    """Parameters tied by function call: read on the first stage and, by the model's own code,
    on the last (``tied_stages`` naming the parameter itself)."""
    return frozenset(fqn for fqn, p in plan.params.items() if fqn in p.tied_stages)


def name_stages(plan: Plan) -> dict[str, int]:
    """The stage of every parameter name, tied names included: a tied name runs on its
    ``tied_stages`` entry if it has one, else on its parameter's stage."""
    stages = {}
    for fqn, planned in plan.params.items():
        stages[fqn] = planned.stage
        for alias in planned.tied_to:
            stages[alias] = planned.tied_stages.get(alias, planned.stage)
    return stages


def pipeline_problems(model: paddle.nn.Layer, plan: Plan, loss_fn: Callable | None) -> list[str]:
    """Why the plan's schedule cannot run on ``model`` (empty when it can, and for plans
    without a pipelining schedule)."""
    if not uses_schedule(plan):  # a table tied across stages without one: check_combination's
        return []
    schedule, pp = plan.strategy.schedule, plan.strategy.pp
    problems = (
        []
        if loss_fn is not None
        else [
            f"$.strategy.schedule: {schedule} computes the loss inside the schedule: pass apply_plan(..., loss_fn=fn)"
        ]
    )
    units = stage_units(model, plan)
    layers = dict(model.named_sublayers())
    problems += [f'$.blocks: no sub-layer "{layer}" in the model' for layer, _ in units if layer not in layers]
    stages = [stage for _, stage in units]
    problems += [
        f"$.strategy.schedule: {p}" for p in schedule_problems(schedule, pp, plan.strategy.micro_batches, stages)
    ]
    chunks = len(chunk_stages(stages))
    if stages and chunks != pp * plan.strategy.virtual_stages:
        problems.append(
            f"$.strategy.virtual_stages: {plan.strategy.virtual_stages} chunks per rank, but the units' "
            f"stages form {chunks} chunks over pp={pp}"
        )
    stage_of = name_stages(plan)
    for slots in parameter_owners(model).values():
        for slot in slots:
            stage = stage_of.get(slot.fqn)
            if stage is None or _unit_of(slot.fqn, units) is not None:
                continue
            if stage not in (0, pp - 1):
                problems.append(
                    f'$.params["{slot.fqn}"].stage: {stage}, but a parameter outside the blocks '
                    f"runs before them (stage 0) or after them (stage {pp - 1})"
                )
            elif stage == 0 and _contains_a_unit(slot.fqn.rpartition(".")[0], units):
                problems.append(
                    f'$.params["{slot.fqn}"]: runs before the first block but is held by a layer that '
                    "also holds blocks, so later stages cannot skip it; a pipeline schedule needs it in "
                    "a layer of its own (e.g. an nn.Embedding)"
                )
    return problems


# -- one chunk: the model's own forward, started and stopped at the chunk's units -----------------------------


class _HandOff(BaseException):
    """Raised by the post-hook on a chunk's last unit to leave the model's forward with the
    activation. A BaseException, so that a model's own ``except Exception`` cannot swallow it."""

    def __init__(self, activation: paddle.Tensor):
        super().__init__()
        self.activation = activation


class _Running:
    """Which chunk of this rank is inside the model's forward right now (the hooks ask)."""

    chunk: StageChunk | None = None


class StageChunk(paddle.nn.Layer):
    """One chunk of the user's model as a stage module for ``PipelineStage``.

    ``forward(*inputs)`` on the first chunk, ``forward(activation, *inputs)`` on the others;
    returns ``(activation, *inputs)``, or on the last chunk the first tensor of the model's
    output. ``parameters()`` are the chunk's own; the model is held, not registered.
    """

    def __init__(
        self,
        model: paddle.nn.Layer,
        running: _Running,
        units: list[str],
        stubs: dict[str, str],
        params: list[paddle.Tensor],
        is_first: bool,
        is_last: bool,
    ):
        super().__init__()
        self._whole = [model]  # a list, so that Layer does not register the whole model
        self._running, self.units, self.is_first, self.is_last = running, units, is_first, is_last
        self._stubs = stubs  # layer FQN -> "identity" | "activation"
        self._received: paddle.Tensor | None = None
        self.owned = paddle.nn.ParameterList(params)

    @property
    def whole(self) -> paddle.nn.Layer:
        """The user's whole model this chunk runs (checkpoints name parameters by it)."""
        return self._whole[0]

    def forward(self, *args: paddle.Tensor) -> Any:
        received, inputs = (None, args) if self.is_first else (args[0], args[1:])
        for x in inputs:
            x.stop_gradient = True  # the model's inputs travel with the activation, without gradient
        self._received = received
        try:
            with self._stubbed():
                output = self._whole[0](*inputs)
        except _HandOff as handoff:
            return (handoff.activation, *(x.detach() for x in inputs))
        finally:
            self._running.chunk, self._received = None, None
        if not self.is_last:
            raise RuntimeError(
                f"the model's forward returned without running block {self.units[-1]}; "
                "a pipeline stage must end at its last block"
            )
        return first_tensor(output)

    @contextmanager
    def _stubbed(self) -> Iterator[None]:
        layers = dict(self._whole[0].named_sublayers())
        saved = {name: layers[name].__dict__.get("forward") for name in self._stubs}
        for name, kind in self._stubs.items():
            layers[name].forward = self._identity if kind == "identity" else self._activation
        self._running.chunk = self
        try:
            yield
        finally:
            for name, forward in saved.items():
                if forward is None:
                    del layers[name].forward
                else:
                    layers[name].forward = forward

    @staticmethod
    def _identity(*args: Any, **kwargs: Any) -> paddle.Tensor | None:
        return first_input(args, kwargs)

    def _activation(self, *args: Any, **kwargs: Any) -> paddle.Tensor:
        return self._received

    def enter_hook(self, layer: paddle.nn.Layer, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        """Pre-hook on the chunk's first unit: its first input becomes the received activation."""
        if self._running.chunk is not self or self.is_first:
            return None
        return map_first_input(args, kwargs, lambda _: self._received)

    def exit_hook(self, layer: paddle.nn.Layer, args: tuple, output: Any) -> None:
        """Post-hook on the chunk's last unit: stop the forward and hand the activation on."""
        if self._running.chunk is self and not self.is_last:
            raise _HandOff(first_tensor(output))


def _build_chunks(model: paddle.nn.Layer, plan: Plan, rank_stage: int) -> list[tuple[int, StageChunk]]:
    """``[(chunk index, StageChunk), ...]`` for the chunks of stage ``rank_stage``."""
    units = stage_units(model, plan)
    chunks = chunk_units(units)
    stage_of_unit = dict(units)
    pp, last = plan.strategy.pp, len(chunks) - 1
    stage_of = name_stages(plan)
    called = called_on_last_stage(plan)
    # Layers that run before the blocks, skipped on later chunks. Not a layer whose weight the
    # last stage reads too (tied by function call): its forward may run after the blocks.
    before_first = sorted(
        {
            slot.fqn.rpartition(".")[0]
            for slots in parameter_owners(model).values()
            for slot in slots
            if stage_of.get(slot.fqn) == 0 and _unit_of(slot.fqn, units) is None and slot.fqn not in called
        }
    )
    layers = dict(model.named_sublayers())
    running = _Running()
    built = []
    for index, names in enumerate(chunks):
        if stage_of_unit[names[0]] != rank_stage:
            continue
        stubs = {layer: "identity" for layer, _ in units if layer not in names}
        if index > 0:
            stubs.update({layer: "activation" for layer in before_first})
        params = _chunk_parameters(model, stage_of, called, units, names, first=index == 0, last=index == last, pp=pp)
        chunk = StageChunk(model, running, names, stubs, params, is_first=index == 0, is_last=index == last)
        layers[names[0]].register_forward_pre_hook(chunk.enter_hook, with_kwargs=True)
        layers[names[-1]].register_forward_post_hook(chunk.exit_hook)
        built.append((index, chunk))
    return built


def _chunk_parameters(
    model, stage_of: dict[str, int], called: frozenset[str], units, names: list[str], first: bool, last: bool, pp: int
) -> list:
    """The parameter objects a chunk owns: those of its units, and outside the units the
    stage-0 ones (first chunk) and the last stage's ones (last chunk) — tied copies included
    (a name tied by function call holds its copy on the last stage's ranks: shard.py)."""
    owned, seen = [], set()
    for slots in parameter_owners(model).values():
        for slot in slots:
            param = slot.layer._parameters[slot.key]
            unit, stage = _unit_of(slot.fqn, units), stage_of.get(slot.fqn)
            outside = (first and stage == 0) or (last and (stage == pp - 1 or slot.fqn in called))
            mine = unit in names if unit is not None else outside
            if mine and id(param) not in seen:
                seen.add(id(param))
                owned.append(param)
    return owned


# -- the schedule ------------------------------------------------------------------------------------------------


class PipelineModel(paddle.nn.Layer):
    """This rank's pipeline chunks and the schedule that runs them.

    ``parameters()`` are this rank's stage parameters only. ``step(*inputs, target=labels)``
    runs forward and backward of all micro-batches and returns the per-micro-batch losses: on
    the last stage the tensors, on the other stages :class:`~autodist.applier.ranks.readable.RemoteLoss`
    handles that fetch them from the last stage when read (readable/); follow it with
    ``optimizer.step()``. Calling the
    model directly is not supported: a schedule has no single-rank forward.
    """

    def __init__(
        self,
        chunks: list[paddle.nn.Layer],
        schedule: Any,
        holds_first: bool,
        holds_last: bool,
        column: list[int],
        tied_copies: list[paddle.Tensor],
    ):
        super().__init__()
        self.chunks = paddle.nn.LayerList(chunks)
        self.schedule = schedule
        self.holds_first, self.holds_last = holds_first, holds_last
        self.last_rank = column[-1]  # the rank of this rank's pipeline that holds the last stage
        # For clipping by global norm (clip.py): the ranks of this rank's pipeline, one per
        # stage, and the later stage's copies of tied weights (their gradient is the first
        # stage's, already counted there). A tuple, so that Layer registers none of them.
        self.pipeline_mesh = dist.ProcessMesh(column, dim_names=["pp"])
        self.tied_copies = tuple(tied_copies)

    def step(self, *inputs: Any, target: Any = None) -> list[Any]:
        # Every rank may pass the whole batch; only the first stage consumes the inputs and
        # only the last the target. The others must not even split them: a tensor on another
        # stage's mesh cannot be split on this rank (segfault in GetDefaultPlace on CPU).
        losses: list[paddle.Tensor] = []
        self.schedule.step(
            *(inputs if self.holds_first else ()), target=target if self.holds_last else None, losses=losses
        )
        n = self.schedule._n_microbatches
        mine = [loss.detach() * n for loss in losses]  # undo the 1/n of _mean_over_micro_batches
        return pipeline_losses(mine, self.holds_last, self.last_rank, n)  # readable on every rank

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("a pipelined model runs whole steps: call model.step(inputs, target=labels)")


def build_pipeline(
    model: paddle.nn.Layer,
    plan: Plan,
    loss_fn: Callable,
    full_mesh: dist.ProcessMesh,
    copies: dict[tuple[str, int], paddle.Tensor],
) -> PipelineModel:
    """Build this rank's chunks of the (already sharded) model and wrap them in Paddle's
    schedule. ``copies``: the tied names' copies per stage (``shard_parameters``). Every rank
    creates every process group, in the same order (``new_group`` is collective)."""
    from paddle.distributed.auto_parallel.interface import set_mesh
    from paddle.distributed.auto_parallel.pipelining.schedules import Schedule1F1B, ScheduleVPP
    from paddle.distributed.auto_parallel.pipelining.stage import PipelineStage

    # Process groups need the collective environment, which plain auto-parallel code starts
    # lazily; every rank gets here together, having passed the same validation.
    if not dist.is_initialized():
        dist.init_parallel_env()
    # Paddle's stages find their meshes through the global mesh (pipelining/utils.py).
    set_mesh(full_mesh)
    rank = dist.get_rank()
    group = _my_group(pp_group_ranks(plan), rank)
    # The first and last stage of each pipeline column sum a tied weight's gradients; with two
    # stages that pair is the pipeline group itself.
    pairs = [[column[0], column[-1]] for column in pp_group_ranks(plan)]
    tied_group = group if plan.strategy.pp == 2 else _my_group(pairs, rank)
    built = _build_chunks(model, plan, stage_of_rank(plan, rank))
    total = len(chunk_units(stage_units(model, plan)))
    shared = _shared_parameters(model, plan, tied_group, copies)
    stages = []
    for index, chunk in built:
        holds_tied = (chunk.is_first or chunk.is_last) and shared
        stages.append(PipelineStage(chunk, index, total, group=group, shared_parameters=shared if holds_tied else None))
    chunks = [chunk for _, chunk in built]
    n = plan.strategy.micro_batches
    scaled = _mean_over_micro_batches(loss_fn, n)
    if plan.strategy.schedule == "1F1B":
        schedule = Schedule1F1B(stages[0], n_microbatches=n, loss_fn=scaled)
    else:
        schedule = ScheduleVPP(stages, n_microbatches=n, loss_fn=scaled)
    column = next(column for column in pp_group_ranks(plan) if rank in column)
    copies_elsewhere = [entry["params"][1] for entry in shared]  # the later stage's copy of each pair
    return PipelineModel(
        chunks, schedule, any(s.is_first for s in stages), any(s.is_last for s in stages), column, copies_elsewhere
    )


def _my_group(columns: list[list[int]], rank: int):
    """Create one process group per column (every rank, same order, one at a time:
    :func:`~autodist.applier.placement.mesh.new_group`); return this rank's."""
    mine = None
    for ranks in columns:
        created = new_group(ranks)
        if rank in ranks:
            mine = created
    return mine


def _shared_parameters(
    model: paddle.nn.Layer, plan: Plan, group, copies: dict[tuple[str, int], paddle.Tensor]
) -> list[dict]:
    """Paddle's ``shared_parameters`` for the weights tied across stages: the first stage's
    object and the copy the other stage holds, with this rank's group of the two stages."""
    slots_by_fqn = {slot.fqn: slot for slots in parameter_owners(model).values() for slot in slots}
    shared = []
    for fqn in sorted(plan.params):
        planned = plan.params[fqn]
        for alias in sorted(planned.tied_stages):
            if alias == fqn:  # tied by function call: one name, holding each stage's copy on its ranks
                pair = [copies[(fqn, planned.stage)], copies[(fqn, planned.tied_stages[fqn])]]
            else:
                pair = [slots_by_fqn[name].layer._parameters[slots_by_fqn[name].key] for name in (fqn, alias)]
            shared.append({"params": pair, "group": group})
    return shared


def _mean_over_micro_batches(loss_fn: Callable, n: int) -> Callable:
    """Paddle's schedules add up the micro-batches' gradients. A user's loss is a mean over
    its batch, so each micro-batch's loss is divided by ``n``: the step then trains exactly
    as the whole batch would on one device (equal-sized micro-batches)."""
    return lambda output, target: loss_fn(output, target) / n
