"""PaddleFormers' ``Trainer`` under autodist plans (:mod:`autodist.integrations.paddleformers`).

Llama and Gemma3 trained by ``Trainer.train()`` at mp2 and dp2 on gloo ranks, under the plans
docs/workflow.md's command makes (the default: Llama's token lookup and Gemma3's fused
``up_gate_proj`` MLPs run on local tensors at mp2, Gemma3's fused ``qkv_proj`` gathered by the
planner's reshard hooks), lose what the plain single-process ``Trainer`` loses, each rank holds
the plan's share of the parameters, and arguments that build another mesh are refused, naming
the difference, before training; dp2 x mp2 on 4 gloo ranks too (Llama's tied table looked up on
local tensors under the Trainer's data parallelism). ZeRO runs on 4 GPUs only. The Trainer's own
checkpoint saved under the mp2 plan resumes there, and under the dp2 plan (on CPU read from every
rank's files), losing what the plain Trainer loses after it; one missing a shard file is refused
in one line before training.

The script is PaddleFormers' own (``TrainingArguments``, ``Trainer``, ``train()``) plus
``trainer_arguments`` and ``install``: no patch of PaddleFormers (``install`` keeps the Trainer's
``fully_shard`` out of a planned run). The Trainer's ``fleet.init`` makes its hybrid groups back
to back, which gloo does not survive on 4 ranks: there (dp and mp both above 1) the ranks make
them through :func:`new_group_then_barrier_TEST_ONLY`. Other CPU facts:
``amp_master_grad`` off, ``fuse_rms_norm=False`` (the tiny models' configs), single-process auto
mode is refused (world size > 1), and ``dataloader_shuffle=False`` so the reference reads the
batches the ranks read.

This file is also the rank program: ``python tests/test_trainer_paddleformers.py JOB.json``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from harness.launcher import launch_ranks

#: The families trained, and the layouts (dp, mp, ZeRO stage) per world size. ZeRO needs the
#: Trainer's real ``fully_shard`` (GPU only): it carries the ``gpu`` marker.
#: (PaddleFormers' Phi3 segfaults in backward under DistTensors on the CPU wheel, with the
#: exported config as with apply_plan: tests/test_train_zoo.py SKIP.)
FAMILIES = ["llama", "gemma3"]
LAYOUTS = {2: [(1, 2, 0), (2, 1, 0)], 4: [(2, 2, 0), (4, 1, 1)]}
STEPS, BATCH, SEQ, SAMPLES = 3, 4, 8, 12
TOLERANCE = 1e-5


# -- the rank program ---------------------------------------------------------------------------------


def new_group_then_barrier_TEST_ONLY(new_group):
    """TEST-ONLY stand-in for ``paddle.distributed.new_group`` while the Trainer's
    ``TrainingArguments`` runs ``fleet.init``: the real one, then a ``dist.barrier()``. On gloo,
    groups made back to back fail (``Connection refused`` / a TIMEOUT in
    ``ProcessGroupGloo.create``, docs/paddle-notes.md, "gloo: process groups made back to back
    fail"), and ``fleet.init``'s ``HybridCommunicateGroup`` makes its pipe, data, model, sharding
    ... groups in a row; a barrier after each is what makes them on CPU. NCCL needs none."""
    import paddle.distributed as dist

    def made_then_barrier(*args, **kwargs):
        group = new_group(*args, **kwargs)
        dist.barrier()
        return group

    return made_then_barrier


def _dataset():
    """``SAMPLES`` (input_ids, labels) pairs of ``SEQ`` tokens, as a causal-LM collator yields them."""
    import numpy as np

    rng = np.random.default_rng(0)
    return [
        {"input_ids": rng.integers(0, 64, SEQ).astype("int64"), "labels": rng.integers(0, 64, SEQ).astype("int64")}
        for _ in range(SAMPLES)
    ]


def _build(family: str, seeded_per_rank: bool = False):
    """``family``'s tiny model from seed 1234; ``seeded_per_rank``: from ``paddle.seed(1234 + rank)``.
    (PaddleFormers' ``set_seed(1234)`` gives every rank the global seed 1234 in the Trainer's auto
    mode, measured: it seeds dp ranks apart only under fleet's hybrid groups, loop (g)'s case.)"""
    import paddle

    from models.paddleformers_models import build_gemma3, build_llama

    paddle.seed(1234 + (paddle.distributed.get_rank() if seeded_per_rank else 0))
    return {"llama": build_llama, "gemma3": build_gemma3}[family]()


def _arguments(out_dir: str, **extra):
    from paddleformers.trainer import TrainingArguments

    extra = {"save_strategy": "no", **extra}
    return TrainingArguments(
        output_dir=out_dir, max_steps=STEPS, logging_steps=1, learning_rate=1e-2, seed=1234,
        dataloader_shuffle=False, amp_master_grad=False, report_to=[], disable_tqdm=True,
        **extra,
    )  # fmt: skip


#: The Trainer's own checkpoints, every step (``trainer_arguments`` gives the format arguments).
CHECKPOINTS = dict(save_strategy="steps", save_steps=1)


def _train(
    family: str, out_dir: str, plan: str | None, seeded_per_rank: bool = False, resume: str | None = None
) -> dict:
    """Train ``family`` with the Trainer (under ``plan``, or plain); losses and local parameter
    bytes. With a plan, every step is checkpointed; ``resume``: from that checkpoint."""
    import numpy as np
    import paddle
    from paddleformers.trainer import Trainer, TrainerCallback

    from autodist.integrations.paddleformers import install, trainer_arguments
    from autodist.schemas import load_plan

    losses: list[float] = []

    class RecordLoss(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                losses.append(float(logs["loss"]))

    extra = {**trainer_arguments(plan), **CHECKPOINTS} if plan else {"per_device_train_batch_size": BATCH}
    new_group = paddle.distributed.new_group
    strategy = load_plan(plan).strategy if plan else None
    if strategy and strategy.dp > 1 and strategy.mp > 1 and not paddle.is_compiled_with_cuda():
        paddle.distributed.new_group = new_group_then_barrier_TEST_ONLY(new_group)
    try:
        arguments = _arguments(out_dir, **extra)  # fleet.init: the hybrid groups
    finally:
        paddle.distributed.new_group = new_group
    model = _build(family, seeded_per_rank)
    trainer = Trainer(model=model, args=arguments, train_dataset=_dataset(), callbacks=[RecordLoss()])
    if plan:
        install(trainer, plan)
    trainer.train(resume_from_checkpoint=resume)
    local = [p._local_value() if p.is_dist() else p for p in trainer.model.parameters()]
    return {"losses": losses, "param_bytes": sum(int(np.prod(t.shape)) * t.element_size() for t in local)}


def _mismatch(family: str, out_dir: str, plan: str) -> dict:
    """A Trainer whose arguments build a dp2 mesh, and an mp2 plan: what install says, and
    whether the Trainer was left alone."""
    from paddleformers.trainer import Trainer

    from autodist.integrations.paddleformers import install
    from autodist.schemas import PlanError

    args = _arguments(out_dir, enable_auto_parallel=True, tensor_model_parallel_size=1, per_device_train_batch_size=2)
    trainer = Trainer(model=_build(family), args=args, train_dataset=_dataset())
    try:
        install(trainer, plan)
    except PlanError as err:
        return {"error": str(err), "config_untouched": getattr(trainer, "auto_dist_config", None) is None}
    return {"error": None}


#: The shard file taken out of a copy of a checkpoint: rank 1's optimizer state.
DAMAGED = "optimizer_state/1_0.distcp"


def _damaged_copy(checkpoint: str, copy: str) -> str:
    """``checkpoint`` copied to ``copy`` by rank 0 without :data:`DAMAGED`; every rank waits."""
    import shutil

    import paddle.distributed as dist

    if dist.get_rank() == 0:
        shutil.copytree(checkpoint, copy)
        Path(copy, DAMAGED).unlink()
    dist.barrier()
    return copy


def rank_main(job_path: str) -> None:
    import paddle.distributed as dist

    job = json.loads(Path(job_path).read_text())
    results = {}
    from autodist.schemas import PlanError

    for run in job["runs"]:
        out = str(Path(job["out"], run["name"]))
        resume = str(Path(job["out"], run["resume"])) if run.get("resume") else None
        if run.get("damaged"):
            resume = _damaged_copy(resume, str(Path(job["out"], run["name"], "checkpoint")))
        try:
            results[run["name"]] = _train(
                run["family"], out, run.get("plan"), run.get("seeded_per_rank", False), resume
            )
        except PlanError as err:
            if not run.get("refused"):
                raise
            results[run["name"]] = {"error": str(err)}
    if job.get("mismatch"):
        results["mismatch"] = _mismatch("llama", job["out"], job["mismatch"])
    Path(job["out"], f"rank{dist.get_rank()}.json").write_text(json.dumps(results))


# -- the tests --------------------------------------------------------------------------------------------


def _plans(workdir: Path, world: int, layouts: list[tuple[int, int, int]]) -> dict[tuple[str, int, int, int], str]:
    """autodist-plan's plans (in-process, ``autodist.plan``) for every family and ``layouts`` of
    ``world`` ranks, on the cpu profile, for what the Trainer passes the model per step: the
    collator's input_ids and labels of the whole batch; docs/workflow.md's options (``--pp 1
    --no-sequence-parallel``, local views by default), the layout and step fixed."""
    import autodist

    from models.paddleformers_models import build_gemma3, build_llama

    plans = {}
    for family, build in (("llama", build_llama), ("gemma3", build_gemma3)):
        for dp, mp, zero in layouts:
            plan = autodist.plan(
                build(), [f"input_ids:int64:{BATCH}x{SEQ}", f"labels:int64:{BATCH}x{SEQ}"], devices=dp * mp, device="cpu",
                dp=dp, mp=mp, pp=1, sequence_parallel=False, sharding_stage=zero, micro_batches=1,
            )  # fmt: skip
            path = workdir / f"{family}_dp{dp}_mp{mp}_zero{zero}.json"
            autodist.save_plan(plan, path)
            plans[family, dp, mp, zero] = str(path)
    return plans


def _launch(nranks: int, workdir: Path, runs: list[dict], mismatch: str | None = None) -> list[dict]:
    """Run the rank program on ``nranks`` ranks (1: a plain process); each rank's results."""
    workdir.mkdir(parents=True, exist_ok=True)
    job = workdir / "job.json"
    job.write_text(json.dumps({"out": str(workdir), "runs": runs, "mismatch": mismatch}))
    backend = "nccl" if nranks > 1 and _has_gpu() else "gloo"
    launch_ranks(nranks, [__file__, str(job)], workdir, timeout_s=240, backend=backend).raise_for_failure()
    return [json.loads((workdir / f"rank{r}.json").read_text()) for r in range(nranks)]


def _has_gpu() -> bool:
    import paddle

    return paddle.device.cuda.device_count() > 0


def _runnable(layouts: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    """The layouts this machine trains: ZeRO needs the Trainer's real ``fully_shard``, GPU only."""
    return layouts if _has_gpu() else [layout for layout in layouts if not layout[2]]


def _train_world(workdir: Path, world: int, reference: dict) -> dict:
    """Every layout of ``world`` ranks this machine runs, in one launch; on 2 ranks also the
    mismatched arguments."""
    layouts = _runnable(LAYOUTS[world])
    plans = _plans(workdir, world, layouts)
    runs = [
        {"name": f"{family}_dp{dp}_mp{mp}_zero{zero}", "family": family, "plan": plans[family, dp, mp, zero]}
        for family in FAMILIES
        for dp, mp, zero in layouts
    ]
    mismatch = plans["llama", 1, 2, 0] if world == 2 else None
    if world == 2:  # the dp2 plan again, each rank's model built from its own seed (replicas.py)
        runs.append(
            {
                "name": "llama_seeded_per_rank",
                "family": "llama",
                "plan": plans["llama", 2, 1, 0],
                "seeded_per_rank": True,
            }
        )
        for family in FAMILIES:  # the mp2 run's checkpoint after step 1 (local views), resumed
            saved = f"{family}_dp1_mp2_zero0/checkpoint-1"
            runs.append(
                {"name": f"{family}_resumed", "family": family, "plan": plans[family, 1, 2, 0], "resume": saved}
            )
        # Llama's mp2 checkpoint (no fused weight: the model's own layout) resumed under dp2, on
        # CPU read from both ranks' files (paddle_checkpoint.py); then with a shard file missing
        for name, damaged in (("llama_resumed_dp2", None), ("llama_resumed_damaged", DAMAGED)):
            runs.append(
                {
                    "name": name,
                    "family": "llama",
                    "plan": plans["llama", 2, 1, 0],
                    "resume": "llama_dp1_mp2_zero0/checkpoint-1",
                    "damaged": damaged,
                    "refused": damaged is not None,
                }
            )
        # Gemma3's fused up_gate_proj, saved rank by rank under mp2, resumed under dp2: refused
        saved = "gemma3_dp1_mp2_zero0/checkpoint-1"
        runs.append(
            {
                "name": "gemma3_resumed_dp2",
                "family": "gemma3",
                "plan": plans["gemma3", 2, 1, 0],
                "resume": saved,
                "refused": True,
            }
        )
    return {"reference": reference, "plans": plans, "ranks": _launch(world, workdir / "ranks", runs, mismatch)}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The plain single-process Trainer, every family: what every layout must lose."""
    workdir = tmp_path_factory.mktemp("trainer_pf1")
    return _launch(1, workdir, [{"name": f, "family": f} for f in FAMILIES])[0]


@pytest.fixture(scope="module")
def trained_two(tmp_path_factory, reference):
    return _train_world(tmp_path_factory.mktemp("trainer_pf2"), 2, reference)


@pytest.fixture(scope="module")
def trained_four(tmp_path_factory, reference):
    return _train_world(tmp_path_factory.mktemp("trainer_pf4"), 4, reference)


def _check_run(trained: dict, family: str, dp: int, mp: int, zero: int) -> None:
    """Losses equal the plain Trainer's; each rank holds the plan's share of the parameters
    (mp-split ones halved, the rest whole, the tied LM head counted once) -- without ZeRO, which
    the Trainer's fully_shard replaces by its own FSDP layout."""
    from autodist.schemas import load_plan
    from autodist.schemas.plan import DTYPE_BYTES

    reference = trained["reference"][family]
    assert len(reference["losses"]) == STEPS
    plan = load_plan(trained["plans"][family, dp, mp, zero])
    want = sum(
        _numel(p.shape) * DTYPE_BYTES[p.dtype] // (mp if "S(" in p.placements[-1] and mp > 1 else 1)
        for p in plan.params.values()
    )
    if family == "llama" and mp > 1:  # the default plan looks the table tied to lm_head up on local tensors
        assert [lookup.layer for lookup in plan.vocab_lookup] == ["model.embed_tokens"]
        assert plan.params["model.embed_tokens.weight"].tied_to == ["lm_head.weight"]
    for rank, result in enumerate(trained["ranks"]):
        run = result[f"{family}_dp{dp}_mp{mp}_zero{zero}"]
        drift = max(abs(a - b) for a, b in zip(run["losses"], reference["losses"]))
        assert len(run["losses"]) == STEPS and drift <= TOLERANCE, (rank, run["losses"], reference["losses"])
        if not zero:
            assert run["param_bytes"] == want, (rank, run["param_bytes"], want)
        if mp > 1:
            assert run["param_bytes"] < reference["param_bytes"]


#: Every (world, dp, mp, ZeRO) run; the ZeRO ones need GPUs (``LAYOUTS``).
RUNS = [
    pytest.param(world, *layout, marks=[pytest.mark.gpu] if layout[2] else [])
    for world, layouts in LAYOUTS.items()
    for layout in layouts
]


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("world,dp,mp,zero", RUNS)
def test_trainer_under_plan_loses_what_the_plain_trainer_loses(request, family, world, dp, mp, zero):
    trained = request.getfixturevalue("trained_two" if world == 2 else "trained_four")
    _check_run(trained, family, dp, mp, zero)


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.slow
def test_a_model_built_from_seed_plus_rank_trains_as_the_plain_trainer(trained_two):
    """Rank 1 built its model from seed 1235: install gives every rank rank 0's values before
    ``train()`` shards them (without it the dp2 run's losses left the plain Trainer's)."""
    reference = trained_two["reference"]["llama"]["losses"]
    for rank, result in enumerate(trained_two["ranks"]):
        losses = result["llama_seeded_per_rank"]["losses"]
        assert len(losses) == STEPS and max(abs(a - b) for a, b in zip(losses, reference)) <= TOLERANCE, (rank, losses)


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_the_trainers_checkpoint_under_a_plan_resumes_as_the_plain_trainer(trained_two, family):
    """The mp2 run saved a checkpoint each step (the Trainer's own, CPU arguments: ``CHECKPOINTS``);
    a new Trainer under the same plan resumed from the one after step 1 and lost, in steps 2 and
    3, what the plain Trainer lost there."""
    plan = load_plan_of(trained_two, family)
    assert plan.local_view or plan.vocab_lookup, "the default plan runs sub-layers on local tensors"
    reference = trained_two["reference"][family]["losses"]
    for rank, result in enumerate(trained_two["ranks"]):
        losses = result[f"{family}_resumed"]["losses"]
        assert len(losses) == STEPS - 1, (rank, losses)
        assert max(abs(a - b) for a, b in zip(losses, reference[1:])) <= TOLERANCE, (rank, losses, reference)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_an_mp2_checkpoint_resumes_under_a_dp2_plan_as_the_plain_trainer(trained_two):
    """Llama's mp2 run saved its checkpoint after step 1 with ``trainer_arguments``' checkpoint
    arguments (its table and projections split over mp, every fused weight in the model's own
    layout); a Trainer under the dp2 plan resumes it and loses, in steps 2 and 3, what the plain
    Trainer lost there. On CPU each rank reads both mp ranks' pieces from their files
    (paddle_checkpoint.py; Paddle's loader would move them through the GPU: "No available device
    found"), on GPUs Paddle's loader reshards it."""
    assert not load_plan_of(trained_two, "llama").local_view  # no weight held rank by rank
    assert any("S(" in p.placements[-1] for p in load_plan_of(trained_two, "llama").params.values())
    reference = trained_two["reference"]["llama"]["losses"]
    for rank, result in enumerate(trained_two["ranks"]):
        losses = result["llama_resumed_dp2"]["losses"]
        assert len(losses) == STEPS - 1, (rank, losses)
        assert max(abs(a - b) for a, b in zip(losses, reference[1:])) <= TOLERANCE, (rank, losses, reference)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_a_checkpoint_missing_a_shard_file_is_refused_in_one_line_before_training(trained_two):
    """The same checkpoint without rank 1's optimizer file, resumed under the dp2 plan: refused
    before ``train()`` runs, in one line naming the file."""
    if _has_gpu():
        pytest.skip("on GPUs Paddle's own loader reads the checkpoint")
    for result in trained_two["ranks"]:
        error = result["llama_resumed_damaged"].get("error")
        assert error is not None and "\n" not in error, error
        assert "optimizer_state: 1_0.distcp, which holds" in error and "is not on this machine" in error, error


@pytest.mark.multiprocess
@pytest.mark.slow
def test_a_checkpoint_holding_fused_weights_rank_by_rank_resumes_under_its_plan_only(trained_two):
    """Gemma3's mp2 checkpoint holds its fused ``up_gate_proj`` rank by rank (its local view):
    resumed under the dp2 plan, which holds it in the model's own order, it is refused before
    training, naming the weight, instead of training permuted columns."""
    for result in trained_two["ranks"]:
        error = result["gemma3_resumed_dp2"].get("error")
        assert error is not None and "in another column order than this plan runs them in" in error, error
        assert "model.layers.0.mlp.up_gate_proj.weight first" in error, error


def load_plan_of(trained: dict, family: str):
    from autodist.schemas import load_plan

    return load_plan(trained["plans"][family, 1, 2, 0])


def test_arguments_that_build_another_mesh_are_refused_naming_the_difference(trained_two):
    for result in trained_two["ranks"]:
        refused = result["mismatch"]
        assert refused["error"] is not None, "install accepted dp2 arguments for an mp2 plan"
        assert "tensor_model_parallel_size=1, the plan needs 2" in refused["error"], refused["error"]
        assert "build the mesh dp2 x mp1, the plan's is dp1 x mp2" in refused["error"], refused["error"]
        assert refused["config_untouched"]


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


# -- no ranks needed -----------------------------------------------------------------------------------


def test_a_pipeline_plan_is_refused_naming_it():
    from autodist.integrations.paddleformers import trainer_arguments
    from autodist.schemas import PlanError

    with pytest.raises(PlanError, match=r"a pipeline \(pp=2, schedule .*\): PaddleFormers' auto-parallel Trainer"):
        trainer_arguments("plans/paddleformers_llama/plan_4x8dev_mp8_pp2.json")


def test_arguments_are_checked_against_the_plan_before_any_rank_starts(tmp_path):
    """A plain one-process ``TrainingArguments`` against a dp4 x mp4 plan: every difference named."""
    from paddleformers.trainer import TrainingArguments

    from autodist.integrations.paddleformers import argument_problems
    from autodist.schemas import load_plan

    plan = load_plan("plans/gpt/plan_2x8dev_mp4.json")
    assert (plan.strategy.dp, plan.strategy.mp, plan.strategy.micro_batches) == (4, 4, 1)
    args = TrainingArguments(
        output_dir=str(tmp_path), gradient_accumulation_steps=2, amp_master_grad=False, report_to=[]
    )
    assert argument_problems(plan, args, world_size=1) == [
        "world size 1, the plan's mesh has 16 ranks (dp4 x mp4)",
        "enable_auto_parallel=False; the plan needs the Trainer's auto-parallel mode (True)",
        "tensor_model_parallel_size=1, the plan needs 4",
        "gradient_accumulation_steps=2, the plan needs 1",
        "these arguments build the mesh dp1 x mp1, the plan's is dp4 x mp4",
        "save_to_hf=True, convert_from_hf=True, replicate_saved_into_local=False: the Trainer's checkpoints under "
        "a plan need save_to_hf=False, convert_from_hf=False, replicate_saved_into_local=True "
        "(trainer_arguments sets them)",
        "per_device_train_batch_size=8, the plan reads 8 samples per step over dp4 x 1 micro-batches: 2",
    ]


def test_what_the_trainer_cannot_express_is_refused_in_one_message():
    import msgspec

    from autodist.integrations.paddleformers import auto_dist_config
    from autodist.schemas import PlanError, load_plan

    plan = load_plan("plans/paddleformers_llama/plan_1x8dev.json")
    layers = [b.layer for b in plan.blocks]
    strategy = msgspec.structs.replace(plan.strategy, ep=2, recompute="full", sequence_parallel=True)
    with pytest.raises(PlanError) as refused:
        auto_dist_config(msgspec.structs.replace(plan, strategy=strategy, recompute=layers))
    assert "3 problems" in str(refused.value)
    assert "sequence parallelism: Paddle's SequenceParallel plans read a layer's first positional input" in str(
        refused.value
    )
    assert "expert parallelism (ep=2): the Trainer's dist.parallelize config has no key for it" in str(refused.value)
    assert "recompute (full): the Trainer's config has no key for it" in str(refused.value)


def test_trainer_arguments_build_the_plans_mesh():
    from autodist.integrations.paddleformers import trainer_arguments

    arguments = trainer_arguments("plans/paddleformers_llama/plan_1x8dev.json")
    assert arguments["enable_auto_parallel"] and arguments["pipeline_model_parallel_size"] == 1


def test_the_planner_traces_the_model_as_the_trainer_calls_it():
    """The Trainer calls ``model(input_ids=..., labels=...)``: the planner traces that call, loss
    included. Should a model not trace whole, its decoder gets only the inputs its ``forward``
    takes, by name: ``labels`` passed on positionally would be traced as its ``attention_mask``."""
    import paddle

    from autodist.planner.trace import _specs_for, trace_model
    from models.paddleformers_models import build_llama

    tokens = paddle.static.InputSpec([BATCH, SEQ], "int64", "input_ids")
    labels = paddle.static.InputSpec([BATCH, SEQ], "int64", "labels")
    model = build_llama()
    traced = trace_model(model, [tokens, labels])
    assert traced.traced_layer == "" and traced.unused_inputs == []
    assert [op.attrs()["name"] for op in traced.ops if op.name() == "pd_op.data"] == ["input_ids", "labels"]
    assert _specs_for(model.model, [tokens, labels]) == [tokens]
    position_ids = paddle.static.InputSpec([BATCH, SEQ], "int64", "position_ids")
    assert _specs_for(model.model, [tokens, position_ids]) is None  # not its second parameter


def test_the_checkpoint_reader_fills_a_box_and_refuses_another_dtype_or_shape_changing_nothing(tmp_path):
    """``load_here`` on one process: rows 2-3 of a tensor saved whole fill a piece holding them;
    a tensor held with another dtype, or another shape, is refused in one line, and a tensor
    before it in the same state dict is left as it was."""
    import numpy as np
    import paddle
    import paddle.distributed as dist
    from paddle.distributed.flex_checkpoint.dcp.sharded_weight import ShardedWeight

    from autodist.integrations.paddle_checkpoint import load_here
    from autodist.schemas import PlanError

    saved = np.arange(24, dtype="float32").reshape(4, 6)
    dist.save_state_dict({"model": {"a": paddle.to_tensor(saved), "w": paddle.to_tensor(saved)}}, str(tmp_path))
    rows = paddle.zeros([2, 6])
    load_here({"model": {"w": ShardedWeight("model.w", rows, (2, 6), (4, 6), (2, 0))}}, tmp_path)
    assert np.array_equal(rows.numpy(), saved[2:])
    for bad, said in ((paddle.zeros([4, 6], "float64"), "float64 [4, 6]"), (paddle.zeros([6, 4]), "float32 [6, 4]")):
        first = paddle.zeros([4, 6])
        with pytest.raises(PlanError) as refused:
            load_here({"model": {"a": first, "w": bad}}, tmp_path)
        assert str(refused.value).endswith(f"model.w is saved as float32 [4, 6], this run holds it as {said}")
        assert "\n" not in str(refused.value) and not first.numpy().any()


def test_importing_autodist_does_not_load_the_integration():
    import subprocess

    code = "import autodist, autodist.applier, sys; print('autodist.integrations' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


if __name__ == "__main__":
    rank_main(sys.argv[1])
