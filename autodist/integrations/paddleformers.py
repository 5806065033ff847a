"""PaddleFormers ``Trainer`` under an autodist plan: one call on a constructed Trainer.

PaddleFormers' auto-parallel mode (``TrainingArguments(enable_auto_parallel=True)``) builds its
mesh from the arguments' degrees and lays the model out with a ``dist.parallelize`` config, the
Trainer's ``auto_dist_config``, which ``Trainer.train`` hands to ``parallelize_model`` and
``parallelize_optimizer``. :func:`install` checks that the arguments build the plan's mesh and
sets that attribute from the plan (:mod:`autodist.schemas.parallelize` decides what each
placement and hook becomes, as for ``autodist-plan export --to paddle-parallelize``)::

    from autodist.integrations.paddleformers import install, trainer_arguments
    args = TrainingArguments(output_dir="out", **trainer_arguments("plan.json"), ...)
    trainer = Trainer(model=model, args=args, train_dataset=..., data_collator=...)
    install(trainer, "plan.json")      # refuses, naming why, before anything is changed
    trainer.train()

What the config has no key for, ``install`` does itself: the plan's local views and token
lookups on local tensors (``autodist.apply_local_views``, apply_plan's own installers) and the
model's own parameters. The plan's ZeRO stage is what shards over dp (``dp_config``, which
``parallelize_optimizer`` applies): ``Trainer.train``'s own ``fully_shard(model, mesh=...)``, FSDP
over dp whatever the config says (and whose fused path runs on GPU, NPU and XPU only), is skipped
for the trainer ``install`` put under a plan.

The Trainer's own checkpoints need Paddle's distributed format (:data:`CHECKPOINT_ARGUMENTS`,
which ``trainer_arguments`` sets and ``install`` checks). They record where each rank's piece
sits, and one saved under another mesh (an mp2 plan's, resumed under dp2) resumes on CPU too,
read from every rank's files on this machine (:mod:`autodist.integrations.paddle_checkpoint`;
Paddle's own loader moves pieces between ranks through the GPU only, and stays the loader on GPUs).

What the Trainer's mode cannot express is refused in one message naming it: a pipeline (the
mode asserts ``pipeline_model_parallel_size == 1``), expert parallelism, sequence parallelism
(Paddle's plans for it read positional inputs; PaddleFormers passes keywords), the plan's recompute
(the Trainer has its own ``recompute`` argument), arguments that build another mesh, accumulate
another number of micro-batches or read another batch. In auto mode the data loader is
``dist.shard_dataloader``'s, unshuffled (docs/workflow.md, "PaddleFormers Trainer").

Tested with PaddleFormers 1.2. Nothing here is imported by ``import autodist``.
"""

from __future__ import annotations

import contextlib
import functools
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from autodist.schemas import Plan, PlanError, load_plan
from autodist.schemas.local_view import local_order, reordered
from autodist.schemas.parallel_dims import runtime_refusals
from autodist.schemas.parallelize import (
    HELPER_STYLES,
    ExportError,
    ParallelizeConfig,
    Style,
    entry_key,
    parallelize_config,
)

__all__ = ["install", "trainer_arguments", "argument_problems", "auto_dist_config"]


#: The ``TrainingArguments`` the Trainer's own checkpoints need under a plan: saved in Paddle's
#: distributed format, not converted to or from HF's (a local view's fused weight is held rank by
#: rank, which an HF file would present as the model's own layout), each rank's replicas written
#: to its own files, so that a checkpoint resumes under another plan's mesh (an mp2 one under dp2).
#: PaddleFormers' defaults (True, True, False) fail on CPU.
CHECKPOINT_ARGUMENTS = {"save_to_hf": False, "convert_from_hf": False, "replicate_saved_into_local": True}


def trainer_arguments(plan: Plan | str | Path) -> dict[str, Any]:
    """The ``TrainingArguments`` keywords that build ``plan``'s mesh and step: the tensor-parallel
    degree (the data-parallel degree is what the world size leaves), no pipeline, the plan's
    micro-batches as accumulation steps and, when the plan records its global batch, the batch
    per device; and the checkpoint arguments a plan's checkpoints need (:data:`CHECKPOINT_ARGUMENTS`).
    The job must have as many ranks as the plan's mesh.

    >>> trainer_arguments("plans/gpt/plan_1x4dev.json")
    {'enable_auto_parallel': True, 'tensor_model_parallel_size': 1, 'pipeline_model_parallel_size': 1, \
'gradient_accumulation_steps': 1, 'save_to_hf': False, 'convert_from_hf': False, \
'replicate_saved_into_local': True, 'per_device_train_batch_size': 2}
    """
    plan, source = _load(plan)
    _raise_if(runtime_refusals(plan.strategy, "trainer"), source)
    return _arguments_for(plan)


def _arguments_for(plan: Plan) -> dict[str, Any]:
    s = plan.strategy
    arguments: dict[str, Any] = {
        "enable_auto_parallel": True,
        "tensor_model_parallel_size": s.mp,
        "pipeline_model_parallel_size": 1,
        "gradient_accumulation_steps": s.micro_batches,
        **CHECKPOINT_ARGUMENTS,
    }
    if plan.data.global_batch_size:
        arguments["per_device_train_batch_size"] = plan.data.global_batch_size // (s.dp * s.micro_batches)
    return arguments


def argument_problems(plan: Plan, args: Any, world_size: int) -> list[str]:
    """How ``args`` (a ``TrainingArguments``) on ``world_size`` ranks differ from ``plan``: one
    line per difference, naming the argument and the value the plan needs; [] when they agree.
    (What the Trainer cannot express at all is :func:`trainer_arguments`' and :func:`install`'s
    to refuse.)"""
    want = _arguments_for(plan)
    s = plan.strategy
    problems = []
    mesh_size = s.dp * s.mp
    if world_size != mesh_size:
        problems.append(f"world size {world_size}, the plan's mesh has {mesh_size} ranks ({_degrees(s.dp, s.mp)})")
    if not getattr(args, "enable_auto_parallel", False):
        problems.append("enable_auto_parallel=False; the plan needs the Trainer's auto-parallel mode (True)")
    for name, value in want.items():
        if name in ("enable_auto_parallel", "per_device_train_batch_size", *CHECKPOINT_ARGUMENTS):
            continue
        have = max(int(getattr(args, name, 1)), 1)
        if have != value:
            problems.append(f"{name}={have}, the plan needs {value}")
    for name in ("sep_parallel_size", "context_parallel_size", "expert_model_parallel_size"):
        if max(int(getattr(args, name, 1) or 1), 1) != 1:
            problems.append(f"{name}={getattr(args, name)}: the plan's mesh has no such axis (1)")
    mp = max(int(getattr(args, "tensor_model_parallel_size", 1)), 1)
    if world_size % mp == 0 and mp != s.mp:
        problems.append(
            f"these arguments build the mesh {_degrees(world_size // mp, mp)}, the plan's is {_degrees(s.dp, s.mp)}"
        )
    checkpoints = [
        f"{name}={getattr(args, name, None)}"
        for name, value in CHECKPOINT_ARGUMENTS.items()
        if getattr(args, name, None) != value
    ]
    if checkpoints:
        problems.append(
            f"{', '.join(checkpoints)}: the Trainer's checkpoints under a plan need "
            + ", ".join(f"{name}={value}" for name, value in CHECKPOINT_ARGUMENTS.items())
            + " (trainer_arguments sets them)"
        )
    batch = want.get("per_device_train_batch_size")
    if batch is not None and getattr(args, "per_device_train_batch_size", batch) != batch:
        problems.append(
            f"per_device_train_batch_size={args.per_device_train_batch_size}, the plan reads "
            f"{plan.data.global_batch_size} samples per step over dp{s.dp} x {s.micro_batches} micro-batches: {batch}"
        )
    return problems


def auto_dist_config(plan: Plan | str | Path) -> dict[str, Any]:
    """The Trainer's ``auto_dist_config`` for ``plan``: ``mp_config.parallelize_plan`` with one
    exact key per layer (or ``layer.param``) and Paddle's plan objects, and ``dp_config`` with
    the plan's ZeRO stage when the mesh has a dp axis. Needs Paddle."""
    plan, source = _load(plan)
    _raise_if(runtime_refusals(plan.strategy, "trainer"), source)
    return _trainer_config(plan, _parallelize_config(plan, source))


def _parallelize_config(plan: Plan, source: str) -> ParallelizeConfig:
    """The plan in ``dist.parallelize`` words; what they cannot express is a :class:`PlanError`."""
    try:
        return parallelize_config(plan)
    except ExportError as err:
        raise PlanError(str(err), source) from None


def _trainer_config(plan: Plan, config: ParallelizeConfig) -> dict[str, Any]:
    """:func:`auto_dist_config` of a plan the Trainer can express, from its ``config``."""
    parallelize_plan: dict[str, list[Any]] = {}
    for entry in config.entries:
        parallelize_plan.setdefault(entry_key(config, entry.key), []).extend(
            _paddle_plan(s, list(plan.mesh.axes)) for s in entry.plans
        )
    out: dict[str, Any] = {}
    if config.sharding_level is not None:
        out["dp_config"] = {"sharding_level": config.sharding_level}
    if parallelize_plan:
        out["mp_config"] = {"parallelize_plan": {k: v[0] if len(v) == 1 else v for k, v in parallelize_plan.items()}}
    if not out:  # a one-rank plan: Paddle treats a missing config as "do nothing" with a warning
        out["dp_config"] = {"sharding_level": 0}
    return out


def install(trainer: Any, plan: Plan | str | Path) -> Any:
    """Put ``trainer`` (a constructed PaddleFormers ``Trainer``) under ``plan``: check the plan
    against its arguments, mesh and model, then set ``trainer.auto_dist_config``; ``train()``
    applies it. Raises :class:`~autodist.schemas.PlanError` naming every difference, with the
    Trainer and its model untouched. Then every rank's model takes rank 0's values (a script that
    called ``set_seed`` before building it built one model per dp rank; replicas.py), the plan's
    local views and local token lookups are installed (``apply_local_views``), and ``train()``
    runs without its own ``fully_shard`` (:func:`_plan_shards_over_dp`). Returns the Trainer."""
    import paddle.distributed as dist

    from autodist.applier.modes.exported_views import apply_local_views
    from autodist.applier.modes.local_calls import local_view_problems
    from autodist.applier.placement.replicas import equalise_dense
    from autodist.applier.ranks.store_host import warm_up_store_host
    from autodist.applier.placement.validate import parameter_problems, tie_problems
    from autodist.applier.modes.vocab_lookup import vocab_lookup_problems

    if dist.get_world_size() > 1:  # rank 0 hosts Paddle's store: its exit must survive the peers hanging up
        warm_up_store_host(dist.get_rank())
    plan, source = _load(plan)
    problems = runtime_refusals(plan.strategy, "trainer")
    if not problems:
        world = dist.get_world_size()
        problems = argument_problems(plan, trainer.args, world)
        if not problems:
            problems = _mesh_problems(plan, getattr(trainer, "global_mesh", None))
        problems += parameter_problems(trainer.model, plan) + tie_problems(trainer.model, plan)
        problems += local_view_problems(trainer.model, plan) + vocab_lookup_problems(trainer.model, plan)
    _raise_if(problems, source)
    config = _parallelize_config(plan, source)
    trainer_config = _trainer_config(plan, config)
    if dist.get_world_size() > 1:  # ranks seeded apart (set_seed: seed + dp rank) start from rank 0's model
        equalise_dense(trainer.model, dist.get_rank(), dist.get_world_size())
    # before train()'s dist.parallelize, which leaves them alone then; on the mesh it lays out on
    apply_local_views(trainer.model, plan, _parallelize_mesh(trainer.global_mesh))
    _shard_model_parameters(trainer.model, plan, config)
    _plan_shards_over_dp(trainer, plan)
    trainer.auto_dist_config = trainer_config
    return trainer


# -- internals ------------------------------------------------------------------------------------


def _parallelize_mesh(mesh: Any) -> Any:
    """The mesh ``dist.parallelize`` lays the Trainer's model out on: its global mesh without
    the pp axis (Paddle's ``ParallelModel.get_mesh``; the Trainer runs no pipeline)."""
    return mesh.get_mesh_with_dim("pp", 0) if "pp" in mesh.dim_names else mesh


def _plan_shards_over_dp(trainer: Any, plan: Plan) -> None:
    """``trainer.train`` without PaddleFormers' ``fully_shard``: it shards the model over dp
    (FSDP) whatever ``auto_dist_config`` says, so a plan without ZeRO would not be what runs (and
    on CPU it fails: its fused path takes gpu, npu and xpu only). The plan's ZeRO stage is
    ``dp_config.sharding_level``, which the Trainer's ``parallelize_optimizer`` applies.

    The Trainer's checkpoints record where each rank's piece sits (``sharded_state_dict`` through
    :func:`~autodist.integrations.paddle_checkpoint.placed`), and one saved under another mesh
    or split resumes on CPU through
    :func:`~autodist.integrations.paddle_checkpoint.load_here` (:func:`_resumes_here`). A
    checkpoint to resume from must hold the fused weights in this plan's layout
    (:func:`_layout_problems`) and, read here, every file it names: checked before anything
    trains. Only this trainer's ``train`` calls, and only while they run; what was patched is put
    back."""
    import paddleformers.trainer.trainer as trainer_module
    from paddleformers.trainer import TrainerCallback
    from paddleformers.trainer.trainer_utils import get_last_checkpoint

    train = trainer.train
    layout = _held_layout(plan)

    class RecordLayout(TrainerCallback):
        """Writes :data:`LAYOUT_FILE` into each checkpoint the Trainer saves (rank 0)."""

        def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            import paddle.distributed as dist

            if dist.get_rank() == 0:
                folder = Path(args.output_dir, f"checkpoint-{state.global_step}")
                (folder / LAYOUT_FILE).write_text(json.dumps(layout, sort_keys=True))

    @functools.wraps(train)
    def train_as_planned(*args: Any, **kwargs: Any) -> Any:
        resume = kwargs.get("resume_from_checkpoint", args[0] if args else None)
        if resume is True:
            resume = get_last_checkpoint(trainer.args.output_dir)
        read_here = False
        if resume:
            read_here = _without_gpu() and _saved_otherwise(layout, Path(resume))
            _raise_if(_layout_problems(layout, Path(resume), read_here), str(resume))
        with _patched(trainer_module, "fully_shard", _as_planned), _placed_pieces(trainer.model):
            if not read_here:
                return train(*args, **kwargs)
            with _patched(trainer_module.dist, "load_state_dict", _load_here(trainer_module.dist.load_state_dict)):
                return train(*args, **kwargs)

    trainer.add_callback(RecordLayout())
    trainer.train = train_as_planned


@contextlib.contextmanager
def _patched(owner: Any, name: str, value: Any) -> Iterator[None]:
    """``owner.name`` is ``value`` inside the block, its own again after it."""
    own = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, own)


def _placed_pieces(model: Any) -> contextlib.AbstractContextManager[None]:
    """``model.sharded_state_dict`` (which the Trainer saves and resumes through) recording
    where each rank's piece sits (:func:`~autodist.integrations.paddle_checkpoint.placed`)."""
    from autodist.integrations.paddle_checkpoint import placed

    own = model.sharded_state_dict

    def sharded_state_dict(*args: Any, **kwargs: Any) -> Any:
        tensors = {t.name: t for t in model.state_dict().values()}
        return placed(own(*args, **kwargs), tensors)

    return _patched(model, "sharded_state_dict", sharded_state_dict)


def _load_here(paddles: Any) -> Any:
    """``paddle.distributed.load_state_dict``'s stand-in for a resume on CPU under another
    layout: :func:`~autodist.integrations.paddle_checkpoint.load_here`; ``paddles`` (Paddle's own)
    for what it alone reads (HF safetensors, an ``aoa_config``)."""
    from autodist.integrations.paddle_checkpoint import load_here

    def load_state_dict(state_dict: Any, path: str, **options: Any) -> None:
        if options.get("aoa_config") or options.get("safetensors"):
            return paddles(state_dict, path, **options)
        return load_here(state_dict, path)

    return load_state_dict


#: The file in a Trainer checkpoint saying how it holds the parameters (:func:`_held_layout`).
LAYOUT_FILE = "autodist_layout.json"

#: The folders of a Trainer checkpoint in Paddle's distributed format (``_load_flex_checkpoint``).
STATE_FOLDERS = ("model_state", "optimizer_state", "master_weight")


def _held_layout(plan: Plan) -> dict[str, Any]:
    """How the Trainer saves the model under ``plan``: ``column_order``, the fused weights held
    rank by rank (its local views'), each as the model's own column positions in the order held
    (:func:`~autodist.schemas.local_view.local_order`), every other parameter in the model's own
    layout; ``mesh``, its axes' degrees; ``split``, each parameter split over ranks, as
    ``[axis, degree, placement]`` per mesh axis that splits it (one left out is whole on every
    rank, and every rank saves it, ``replicate_saved_into_local``)."""
    axes, degrees = plan.mesh.axes, plan.mesh.shape
    return {
        "mesh": {a: int(n) for a, n in zip(axes, degrees)},
        "column_order": {
            w.param: local_order(w, plan.params[w.param].shape[w.dim], plan.strategy.mp)
            for view in plan.local_view
            for w in view.weights
            if w.dim is not None and reordered(w)
        },
        "split": {
            fqn: split
            for fqn, p in sorted(plan.params.items())
            if (split := [[a, int(n), x] for a, n, x in zip(axes, degrees, p.placements) if x != "R" and n > 1])
        },
    }


def _saved(checkpoint: Path) -> dict[str, Any]:
    """The :data:`LAYOUT_FILE` of ``checkpoint``; {} when it has none (a plain Trainer's)."""
    path = checkpoint / LAYOUT_FILE
    saved = json.loads(path.read_text()) if path.is_file() else {}
    return {"column_order": saved} if saved and "column_order" not in saved else saved  # an early one: the order


def _saved_otherwise(layout: dict[str, Any], checkpoint: Path) -> bool:
    """Whether ``checkpoint`` was saved on another mesh than ``layout``'s, or split a parameter
    otherwise (one saved whole, by every rank, loads under any split from the rank's own file):
    then a rank needs pieces another rank saved. A checkpoint that does not say is read as
    saved otherwise."""
    saved = _saved(checkpoint)
    if "split" not in saved:
        return True
    moved = [name for name, split in saved["split"].items() if split != layout["split"].get(name)]
    return saved["mesh"] != layout["mesh"] or bool(moved)


def _layout_problems(layout: dict[str, Any], checkpoint: Path, read_here: bool) -> list[str]:
    """Whether ``checkpoint`` holds the fused weights in ``layout``'s order (one without
    :data:`LAYOUT_FILE` holds them in the model's own layout: a plain Trainer's, or a plan's
    without reordered weights; resuming another order would train permuted columns silently),
    and, when it is ``read_here`` (:mod:`~autodist.integrations.paddle_checkpoint`), whether this
    machine can read it."""
    order, want = _saved(checkpoint).get("column_order", {}), layout["column_order"]
    differ = sorted(name for name in set(order) | set(want) if order.get(name) != want.get(name))
    if differ:
        return [
            f"the checkpoint holds {len(differ)} fused weights ({differ[0]} first) in another column order than "
            "this plan runs them in (local views lay them out rank by rank); resume it under the plan it was saved under"
        ]
    if not read_here:
        return []
    from autodist.integrations.paddle_checkpoint import checkpoint_problems

    return [problem for folder in STATE_FOLDERS for problem in checkpoint_problems(checkpoint / folder)]


def _without_gpu() -> bool:
    """Whether this process has no GPU, where Paddle's checkpoint loader cannot move a piece
    between ranks (flex_checkpoint's ``reshard_comm``: ``src_tensor.cuda()``)."""
    import paddle

    return paddle.device.cuda.device_count() == 0


def _as_planned(model: Any, *args: Any, **kwargs: Any) -> Any:
    """``fully_shard``'s stand-in under a plan: the model as ``dist.parallelize`` laid it out."""
    return model


def _load(plan: Plan | str | Path) -> tuple[Plan, str]:
    if isinstance(plan, Plan):
        return plan, "plan"
    return load_plan(plan), str(plan)


def _raise_if(problems: list[str], source: str) -> None:
    if problems:
        raise PlanError(problems, source)


def _degrees(dp: int, mp: int) -> str:
    return f"dp{dp} x mp{mp}"


def _mesh_problems(plan: Plan, mesh: Any) -> list[str]:
    """The Trainer's mesh (``fleet.auto.get_mesh()``, axes of size one dropped) against the plan's."""
    if mesh is None:
        return [
            "the Trainer has no auto-parallel mesh (TrainingArguments(enable_auto_parallel=True) on more than one rank builds it)"
        ]
    kept = [(name, size) for name, size in zip(mesh.dim_names, mesh.shape) if size > 1]
    names, shape = [n for n, _ in kept] or list(mesh.dim_names[-1:]), [s for _, s in kept] or [1]
    ids = [int(i) for i in mesh.process_ids]
    if (names, shape, ids) == (list(plan.mesh.axes), list(plan.mesh.shape), [int(i) for i in plan.mesh.process_ids]):
        return []
    return [
        f"the Trainer's mesh is {names} {shape} over ranks {ids}, the plan's {list(plan.mesh.axes)} "
        f"{list(plan.mesh.shape)} over ranks {list(plan.mesh.process_ids)}"
    ]


def _paddle_plan(style: Style, plan_axes: list[str]) -> Any:
    """Paddle's plan object for ``style`` (``plan_axes``: the plan's mesh axes, which its
    placements follow)."""
    import paddle.distributed as dist

    if style.name not in HELPER_STYLES:
        return getattr(dist, style.name)()
    prepare = getattr(dist, HELPER_STYLES[style.name])
    if style.name.startswith("reshard"):
        by_axis = dict(zip(plan_axes, style.placements))
        return prepare((_reshard_input if style.name == "reshard_input" else _reshard_output)(by_axis))
    return prepare(_split_sequence_input if style.name == "split_sequence_input" else _gather_sequence_output)


def _split_sequence_input(process_mesh):
    """A PrepareLayerInput function: [b, s, h] -> [s/mp, b, h], as SequenceParallelEnable does."""
    from paddle.distributed.auto_parallel.intermediate.tensor_parallel import c_split

    return lambda layer, args: c_split(args, process_mesh, True)


def _gather_sequence_output(process_mesh):
    """A PrepareLayerOutput function: [s/mp, b, h] -> [b, s, h], as SequenceParallelEnable does."""
    from paddle.distributed.auto_parallel.intermediate.tensor_parallel import c_concat

    return lambda layer, args, output: c_concat(output, process_mesh, True)


def _reshard_input(placements: dict[str, str]):
    """A PrepareLayerInput function: reshard the layer's first input to ``placements`` (by axis)."""
    import paddle.distributed as dist

    def make(process_mesh):
        return lambda layer, args: (
            dist.reshard(args[0], process_mesh, _on_mesh(placements, process_mesh, args[0])),
            *args[1:],
        )

    return make


def _reshard_output(placements: dict[str, str]):
    """A PrepareLayerOutput function: reshard the layer's output to ``placements`` (by axis)."""
    import paddle.distributed as dist

    def make(process_mesh):
        return lambda layer, args, output: dist.reshard(
            output, process_mesh, _on_mesh(placements, process_mesh, output)
        )

    return make


def _on_mesh(placements: dict[str, str], process_mesh: Any, tensor: Any) -> list[Any]:
    """Paddle placements for every axis of ``process_mesh``, the Trainer's mesh (it keeps axes of
    size one that the plan's leaves out): the plan's on mp, ``tensor``'s own on the others
    (Replicate where the plan names none, should ``tensor`` not be on that mesh).

    Only the mp axis is the plan's to change: on the others ``tensor`` keeps its placement. The
    Trainer's activations carry each dp rank's own batch as a tensor Replicate over dp, so the
    plan's ``S(0)`` over dp would keep half of that rank's batch (Gemma3 at dp2 x mp2: first loss
    0.135 off the plain Trainer's; tests/test_trainer_paddleformers.py)."""
    from autodist.applier.placement.mesh import to_paddle_placement

    own = list(tensor.placements) if tensor.is_dist() and tensor.process_mesh == process_mesh else None
    return [
        to_paddle_placement(placements.get(name, "R")) if name == "mp" or own is None else own[axis]
        for axis, name in enumerate(process_mesh.dim_names)
    ]


def _shard_model_parameters(model: Any, plan: Plan, config: ParallelizeConfig) -> None:
    """The model's own parameters (no dot in the name), which ``dist.parallelize`` does not visit,
    sharded as the plan says on the mesh (a plan here has no pp axis)."""
    import paddle.distributed as dist

    from autodist.applier.placement.mesh import stage_mesh, to_paddle_placement

    for name, (_, placements) in config.model_params.items():
        paddle_placements = [to_paddle_placement(p) for p in placements]
        setattr(model, name, dist.shard_tensor(getattr(model, name), stage_mesh(plan, 0), paddle_placements))
