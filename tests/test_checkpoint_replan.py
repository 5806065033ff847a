"""Checkpoints survive re-planning, on several gloo processes (CPU): 2 AdamW steps under plan A,
save, load under plan B (other weights to start from, other world size), 1 more step — the
losses and parameters equal 3 uninterrupted single-device steps (1e-5), and every parameter
is laid out as plan B says. AdamW here has weight decay, a step LR schedule (its step falls
between saving and resuming) and global-norm clipping, so moments and schedule must come back.

ZeRO-1 runs through the harness's TEST-ONLY CPU stand-in for reduce-scatter
(``reshard="via_replicate"``, harness/cpu_substitutes.py); the checkpoint code itself does no
resharding.

Launches: the savers (1 process; 2 ranks), then the loaders (1 process; 2 ranks; 4 ranks), and
one 2-rank job whose save is killed.
"""

from __future__ import annotations

import hashlib
import shutil

import numpy as np
import paddle
import pytest
from harness.cases import Config
from harness.compare import assert_resumed_like_one_device
from harness.jobs import Job, TrainRun
from harness.plans import write_plan
from harness.runner import start_job, train_by_world
from harness.workloads import WORKLOADS

from autodist import export_checkpoint, load_checkpoint
from autodist.schemas import dump_plan, load_plan
from autodist.schemas.checkpoint import read_checkpoint

WORKLOAD = "docstring_llama"
SAVED_AT = 2

#: scenario -> (plan A, plan B); None is one device without a plan.
SCENARIOS = {
    "dp2_to_mp2": (Config(dp=2, optimizer="adamw"), Config(mp=2, optimizer="adamw")),
    "mp2_to_dp2_mp2": (Config(mp=2, optimizer="adamw"), Config(dp=2, mp=2, optimizer="adamw")),
    "zero1_to_mp2": (
        Config(dp=2, optimizer="adamw", sharding_stage=1, reshard="via_replicate"),
        Config(mp=2, optimizer="adamw"),
    ),
    "single_to_mp2": (None, Config(mp=2, optimizer="adamw")),
    # Into ZeRO-1: the loaded moments must land in states split over dp (checked by the layout).
    "mp2_to_zero1": (
        Config(mp=2, optimizer="adamw"),
        Config(dp=2, optimizer="adamw", sharding_stage=1, reshard="via_replicate"),
    ),
    "mp2_to_single": (Config(mp=2, optimizer="adamw"), None),
}


def config_name(config: Config | None) -> str:
    return "single" if config is None else config.name


def make_run(name: str, config: Config | None, plans: dict[str, str], **checkpointing) -> TrainRun:
    if config is None:
        return TrainRun(name, WORKLOAD, optimizer="adamw", method="single", **checkpointing)
    return TrainRun(name, WORKLOAD, optimizer="adamw", plan=plans[config.name], reshard=config.reshard, **checkpointing)


@pytest.fixture(scope="module")
def resumed(tmp_path_factory, reference_runs):
    """Save under every plan A, then resume under every plan B. Returns the plans, the
    checkpoint of each plan A, and each run's rank outputs."""
    workdir = tmp_path_factory.mktemp("replan")
    model = WORKLOADS[WORKLOAD].build(seed=0)
    configs = {c.name: c for pair in SCENARIOS.values() for c in pair if c is not None}
    plans = {name: write_plan(c.hand_written_plan(model), workdir / f"plan_{name}.json") for name, c in configs.items()}
    savers = {config_name(a): a for a, _ in SCENARIOS.values()}
    checkpoints = {name: str(workdir / f"ckpt_{name}") for name in savers}
    saves = [
        (make_run(f"save_{name}", a, plans, steps=SAVED_AT, save_checkpoint=checkpoints[name]), a.world if a else 1)
        for name, a in savers.items()
    ]
    loads = [
        (
            make_run(scenario, b, plans, steps=1, first_step=SAVED_AT, load_checkpoint=checkpoints[config_name(a)]),
            b.world if b else 1,
        )
        for scenario, (a, b) in SCENARIOS.items()
    ]
    outputs = train_by_world(saves, workdir / "save")
    outputs.update(train_by_world(loads, workdir / "load"))
    reference_runs.prepare([run for run, _ in saves + loads])
    return plans, checkpoints, outputs, {run.name: run for run, _ in saves + loads}


@pytest.mark.multiprocess
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_resumed_under_another_plan_trains_like_one_uninterrupted_device(resumed, reference_runs, scenario):
    plans, checkpoints, outputs, runs = resumed
    plan_a, plan_b = SCENARIOS[scenario]
    plan = None if plan_b is None else load_plan(plans[plan_b.name])
    assert_resumed_like_one_device(reference_runs, runs, outputs, f"save_{config_name(plan_a)}", scenario, plan)


@pytest.mark.multiprocess
@pytest.mark.parametrize("saver", sorted({config_name(a) for a, _ in SCENARIOS.values()}))
def test_a_checkpoint_records_the_plan_and_step_it_was_saved_under(resumed, saver):
    plans, checkpoints, _, _ = resumed
    meta = read_checkpoint(checkpoints[saver])
    assert meta.step == SAVED_AT
    if saver == "single":
        assert meta.plan is None and meta.world_size == 1
        return
    plan = load_plan(plans[saver])
    assert meta.plan.fingerprint == hashlib.sha256(dump_plan(plan)).hexdigest()
    assert (meta.plan.mesh, meta.plan.strategy, meta.world_size) == (
        plan.mesh,
        plan.strategy,
        len(plan.mesh.process_ids),
    )


@pytest.mark.multiprocess
def test_an_mp2_checkpoint_exports_to_one_full_state_dict(resumed, tmp_path):
    """The export equals the parameters the mp2 run held after its 2 steps, as Paddle itself
    gathers them (``dist.reshard`` to Replicate on each rank), bit for bit."""
    _, checkpoints, outputs, _ = resumed
    state = export_checkpoint(checkpoints["mp2_adamw"], tmp_path / "model.pdparams")
    reloaded = paddle.load(str(tmp_path / "model.pdparams"))
    gathered = outputs["save_mp2_adamw"][1]["params"]
    assert sorted(reloaded) == sorted(state) == sorted(gathered)
    for fqn, value in gathered.items():
        assert np.array_equal(reloaded[fqn].numpy(), np.asarray(value, dtype=np.float32)), fqn


@pytest.mark.multiprocess
def test_a_save_interrupted_by_killing_a_rank_leaves_the_previous_checkpoint_loadable(resumed, tmp_path):
    """Rank 1 of a 2-rank mp2 job dies half-way through writing its part of the step-3 save
    into the folder of the step-2 checkpoint; the step-2 checkpoint still loads, with the
    values the mp2 run held at step 2."""
    plans, checkpoints, outputs, _ = resumed
    path = tmp_path / "ckpt"
    shutil.copytree(checkpoints["mp2_adamw"], path)
    run = TrainRun(
        "killed_save", WORKLOAD, optimizer="adamw", plan=plans["mp2_adamw"], steps=1, first_step=SAVED_AT,
        load_checkpoint=str(path), save_checkpoint=str(path), save_fault="kill", save_fault_rank=1,
    )  # fmt: skip
    job = start_job(Job(out_dir=str(tmp_path / "out"), train=[run]), 2, tmp_path, timeout_s=120)
    assert not job.ok and job.processes[1].returncode == -9, job.report()
    assert len([p for p in path.iterdir() if p.name.startswith("data-")]) == 2  # the abandoned save's folder

    meta = read_checkpoint(path)
    assert meta.step == SAVED_AT
    model = WORKLOADS[WORKLOAD].build(seed=7)
    load_checkpoint(model, None, path)
    for fqn, value in outputs["save_mp2_adamw"][0]["params"].items():
        assert np.array_equal(dict(model.named_parameters())[fqn].numpy(), np.asarray(value, dtype=np.float32)), fqn


@pytest.mark.multiprocess
def test_a_write_failing_on_one_rank_fails_the_save_on_every_rank_without_a_hang(resumed, tmp_path):
    """Rank 1's write fails half-way (a full disk, TEST-ONLY hook): both ranks raise the same
    one-line CheckpointError and exit on their own (none is killed as hung), and the folder's
    step-2 checkpoint is still the one committed."""
    plans, checkpoints, _, _ = resumed
    path = tmp_path / "ckpt"
    shutil.copytree(checkpoints["mp2_adamw"], path)
    run = TrainRun(
        "full_disk", WORKLOAD, optimizer="adamw", plan=plans["mp2_adamw"], steps=1, first_step=SAVED_AT,
        load_checkpoint=str(path), save_checkpoint=str(path), save_fault="no_space", save_fault_rank=1,
    )  # fmt: skip
    job = start_job(Job(out_dir=str(tmp_path / "out"), train=[run]), 2, tmp_path, timeout_s=120)
    assert [p.returncode for p in job.processes] == [1, 1], job.report()  # None would mean killed as hung
    for process in job.processes:
        last = process.stderr.strip().splitlines()[-1]
        assert (
            last.startswith("autodist.schemas.checkpoint.CheckpointError: ")
            and "rank 1 could not write its shards: No space left on device" in last
        ), last
    assert read_checkpoint(path).step == SAVED_AT
