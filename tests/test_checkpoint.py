"""Checkpoints in one process: resume equals uninterrupted training, refusals leave everything
untouched, the metadata is checked like a plan, a killed save leaves the previous checkpoint.

The multi-process proofs (saved under one plan, loaded under another) are in
``test_checkpoint_replan.py``.
"""

from __future__ import annotations

import doctest
import hashlib
import json
import subprocess
import sys
import textwrap

import msgspec
import numpy as np
import paddle
import pytest
from harness.jobs import Job, TrainRun
from harness.launcher import base_env
from harness.plans import tensor_parallel_plan
from harness.runner import read_outputs, start_job
from harness.workloads import DOCSTRING_LLAMA_CONFIG, WORKLOADS, load_model_file, make_loader, make_optimizer, train

import autodist.applier.placement.layout
import autodist.schemas.checkpoint
from autodist import CheckpointError, apply_plan, export_checkpoint, load_checkpoint, save_checkpoint
from autodist.applier.checkpoint.save_load import MASTER_WEIGHT
from autodist.schemas import dump_plan
from autodist.schemas.checkpoint import METADATA_FILE, read_checkpoint, tiling_problem

WORKLOAD = WORKLOADS["docstring_llama"]
SEED = 2024


def trained(steps: int, seed: int = SEED):
    """The docstring Llama with AdamW (weight decay, step LR schedule, clipping) after ``steps``."""
    model = WORKLOAD.build(seed)
    optimizer, schedule = make_optimizer("adamw", model.parameters())
    losses = train(WORKLOAD, model, optimizer, schedule, make_loader(WORKLOAD, steps, SEED), steps)
    return model, optimizer, schedule, losses


def batches(first: int, count: int):
    """Batches ``first .. first+count-1`` of the same fixed stream ``trained`` uses."""
    return list(make_loader(WORKLOAD, first + count, SEED))[first:]


def values(model) -> dict[str, np.ndarray]:
    return {fqn: p.numpy().copy() for fqn, p in model.named_parameters()}


def accumulators(optimizer) -> dict[str, np.ndarray]:
    return {
        f"{kind}/{name}": t.numpy().copy() for kind, per in optimizer._accumulators.items() for name, t in per.items()
    }


@pytest.fixture(scope="module")
def after_two_steps(tmp_path_factory):
    model, optimizer, schedule, losses = trained(2)
    path = tmp_path_factory.mktemp("ckpt") / "ckpt"
    save_checkpoint(model, optimizer, path, step=2)
    return path, model, optimizer, losses


# -- resuming ------------------------------------------------------------------------------------------


def test_resuming_from_a_checkpoint_equals_uninterrupted_training(after_two_steps):
    path, _, _, first_losses = after_two_steps
    reference, _, _, reference_losses = trained(3)

    model = WORKLOAD.build(seed=7)  # other starting weights: only the checkpoint can make them right
    optimizer, schedule = make_optimizer("adamw", model.parameters())
    meta = load_checkpoint(model, optimizer, path)
    assert meta.step == 2 and (schedule.last_epoch, schedule.last_lr) == (2, 5e-4)
    last = train(WORKLOAD, model, optimizer, schedule, batches(2, 1), 1)

    np.testing.assert_allclose(first_losses + last, reference_losses, rtol=1e-6)
    for fqn, value in values(reference).items():
        np.testing.assert_allclose(values(model)[fqn], value, atol=1e-6, err_msg=fqn)


def test_parameters_moments_and_schedule_come_back_bit_for_bit(after_two_steps):
    path, saved_model, saved_optimizer, _ = after_two_steps
    model = WORKLOAD.build(seed=7)
    optimizer, schedule = make_optimizer("adamw", model.parameters())
    load_checkpoint(model, optimizer, path)
    for fqn, value in values(saved_model).items():
        assert np.array_equal(values(model)[fqn], value), fqn
    # Paddle names states after parameter names, which differ between the two builds: compare by FQN.
    rename = {p.name: fqn for fqn, p in model.named_parameters()}
    saved_rename = {p.name: fqn for fqn, p in saved_model.named_parameters()}
    by_fqn = lambda opt, names: {  # noqa: E731
        f"{k.split('/')[0]}/{names[k.split('/', 1)[1]]}": v for k, v in accumulators(opt).items()
    }
    got, want = by_fqn(optimizer, rename), by_fqn(saved_optimizer, saved_rename)
    assert got.keys() == want.keys() and len(got) == 4 * len(rename)
    for key in want:
        assert np.array_equal(got[key], want[key]), key


def test_metadata_records_step_model_and_no_plan_for_a_plain_model(after_two_steps):
    path, model, _, _ = after_two_steps
    meta = read_checkpoint(path)
    assert meta.step == 2 and meta.world_size == 1 and meta.plan is None
    assert meta.model.class_name == type(model).__name__
    assert sorted(meta.params) == sorted(fqn for fqn, _ in model.named_parameters())
    assert set(meta.optimizer.states["lm_head.weight" if "lm_head.weight" in meta.params else sorted(meta.params)[0]]) == {
        "moment1", "moment2", "beta1_pow_acc", "beta2_pow_acc"
    }  # fmt: skip
    assert meta.scheduler.class_name == "StepDecay" and meta.scheduler.state["last_epoch"] == 2


def test_a_save_under_a_plan_records_its_fingerprint_mesh_and_strategy(tmp_path):
    model = WORKLOAD.build(SEED)
    optimizer, _ = make_optimizer("adamw", model.parameters())
    plan = tensor_parallel_plan(model)
    model, optimizer, _ = apply_plan(model, optimizer, None, plan)
    meta = save_checkpoint(model, optimizer, tmp_path / "ckpt", step=0)
    assert read_checkpoint(tmp_path / "ckpt") == meta
    assert meta.plan.fingerprint == hashlib.sha256(dump_plan(plan)).hexdigest()
    assert (meta.plan.mesh, meta.plan.strategy) == (plan.mesh, plan.strategy)
    assert meta.optimizer.states == {}  # not stepped yet: no states, and loading creates none


def test_version_1_metadata_naming_the_mesh_axes_dim_names_still_reads(tmp_path):
    """Checkpoint format version 1 recorded the plan's mesh with ``dim_names``; version 2 calls
    them ``axes``, and a version 1 checkpoint still reads, to the same metadata as version 2
    (version 3 only adds checksums, version 4 the loader's position, version 5 a signature)."""
    model = WORKLOAD.build(SEED)
    optimizer, _ = make_optimizer("adamw", model.parameters())
    model, optimizer, _ = apply_plan(model, optimizer, None, tensor_parallel_plan(model))
    meta = save_checkpoint(model, optimizer, tmp_path / "ckpt", step=0)
    raw = json.loads((tmp_path / "ckpt" / METADATA_FILE).read_text())
    assert raw["version"] == 5 and raw["plan"]["mesh"]["axes"] == meta.plan.mesh.axes
    raw["version"] = 1
    raw["plan"]["mesh"] = {"dim_names" if k == "axes" else k: v for k, v in raw["plan"]["mesh"].items()}
    (tmp_path / "ckpt" / METADATA_FILE).write_text(json.dumps(raw))
    assert read_checkpoint(tmp_path / "ckpt") == msgspec.structs.replace(meta, version=2)


def test_a_run_accumulating_micro_batches_resumes_under_a_plan_without(tmp_path):
    """apply_plan wraps the optimizer for micro-batches; the checkpoint records the user's
    optimizer class and its states, so it loads where the plan does not accumulate. A save
    between an update's micro-batches, which would lose their summed gradients, is refused."""
    model = WORKLOAD.build(SEED)
    optimizer, schedule = make_optimizer("adamw", model.parameters())
    plan = tensor_parallel_plan(model)
    accumulating = msgspec.structs.replace(plan, strategy=msgspec.structs.replace(plan.strategy, micro_batches=2))
    model, optimizer, loader = apply_plan(model, optimizer, make_loader(WORKLOAD, 1, SEED), accumulating)
    for micro_batch, (inputs, labels) in enumerate(loader):  # two micro-batches: one update
        WORKLOAD.loss(model, inputs, labels).backward()
        optimizer.step()
        optimizer.clear_grad()
        if micro_batch == 0:  # half an update: its summed gradient is in no checkpoint
            with pytest.raises(CheckpointError) as refused:
                save_checkpoint(model, optimizer, tmp_path / "ckpt", step=1)
            assert "summed 1 of the 2 micro-batches of an update" in str(refused.value)
            assert not (tmp_path / "ckpt").exists()
    schedule.step()
    meta = save_checkpoint(model, optimizer, tmp_path / "ckpt", step=1)
    assert meta.optimizer.class_name == "AdamW" and len(meta.optimizer.states) == len(meta.params)

    fresh = WORKLOAD.build(seed=7)
    fresh_optimizer, fresh_schedule = make_optimizer("adamw", fresh.parameters())
    fresh, fresh_optimizer, _ = apply_plan(fresh, fresh_optimizer, None, plan)
    load_checkpoint(fresh, fresh_optimizer, tmp_path / "ckpt")
    assert (fresh_schedule.last_epoch, schedule.last_epoch) == (1, 1)
    for fqn, value in values(model).items():
        assert np.array_equal(values(fresh)[fqn], value), fqn


def test_export_writes_one_full_state_dict_that_paddle_loads(after_two_steps, tmp_path):
    path, saved_model, _, _ = after_two_steps
    export_checkpoint(path, tmp_path / "model.pdparams")
    model = WORKLOAD.build(seed=7)
    missing, unexpected = model.set_state_dict(paddle.load(str(tmp_path / "model.pdparams")))
    assert (missing, unexpected) == ([], [])
    for fqn, value in values(saved_model).items():
        assert np.array_equal(values(model)[fqn], value), fqn


def test_bfloat16_and_master_weights_round_trip(tmp_path):
    paddle.seed(1)
    model = paddle.nn.Linear(4, 6)
    model.to(dtype="bfloat16")
    optimizer = paddle.optimizer.AdamW(1e-2, parameters=model.parameters(), multi_precision=True)
    # The CPU wheel has no bfloat16 matmul: create the states as a step would, give them values.
    optimizer._create_accumulators(paddle.static.default_main_program().global_block(), model.parameters())
    for state in [*optimizer._master_weights.values(), *optimizer._accumulators["moment1"].values()]:
        state.set_value(np.random.RandomState(0).rand(*state.shape).astype("float32"))
    save_checkpoint(model, optimizer, tmp_path / "ckpt", step=1)
    assert set(read_checkpoint(tmp_path / "ckpt").optimizer.states["weight"]) >= {MASTER_WEIGHT, "moment1"}

    paddle.seed(2)
    fresh = paddle.nn.Linear(4, 6)
    fresh.to(dtype="bfloat16")
    fresh_opt = paddle.optimizer.AdamW(1e-2, parameters=fresh.parameters(), multi_precision=True)
    load_checkpoint(fresh, fresh_opt, tmp_path / "ckpt")
    assert np.array_equal(fresh.weight.numpy(), model.weight.numpy())
    master = lambda opt, m: opt._master_weights[m.weight.name].numpy()  # noqa: E731
    assert np.array_equal(master(fresh_opt, fresh), master(optimizer, model))


# -- refusals: one line, nothing changed ---------------------------------------------------------------


def untouched_state(model, optimizer):
    return (
        [(fqn, id(p), p.numpy().tobytes()) for fqn, p in model.named_parameters()],
        accumulators(optimizer),
        dict(optimizer._learning_rate.state_dict()) if hasattr(optimizer._learning_rate, "state_dict") else None,
    )


def refused(model, optimizer, path, expect: str) -> str:
    before = untouched_state(model, optimizer)
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(model, optimizer, path)
    message = str(info.value)
    assert expect in message and "\n" not in message, message
    assert untouched_state(model, optimizer) == before
    return message


def test_a_checkpoint_of_another_model_is_refused_in_one_line(after_two_steps):
    path, _, _, _ = after_two_steps
    module = load_model_file("plans/llama_docstring/model.py", "llama_docstring_model")
    paddle.seed(0)
    other = module.build_model(**{**DOCSTRING_LLAMA_CONFIG, "num_layers": 3})
    optimizer, _ = make_optimizer("adamw", other.parameters())
    message = refused(other, optimizer, path, "saved from a different model")
    assert "not in the checkpoint, e.g. 'llama.layers.2." in message or "layers.2." in message, message


def test_a_checkpoint_under_a_plan_for_another_model_is_refused_before_anything_changes(after_two_steps):
    path, _, _, _ = after_two_steps
    module = load_model_file("plans/llama_docstring/model.py", "llama_docstring_model")
    paddle.seed(0)
    other = module.build_model(**{**DOCSTRING_LLAMA_CONFIG, "hidden_size": 64})
    optimizer, _ = make_optimizer("adamw", other.parameters())
    other, optimizer, _ = apply_plan(other, optimizer, None, tensor_parallel_plan(other))
    refused(other, optimizer, path, "of another shape or dtype")


def test_another_optimizer_or_scheduler_is_refused(after_two_steps):
    path, _, _, _ = after_two_steps
    model = WORKLOAD.build(seed=7)
    sgd, _ = make_optimizer("sgd", model.parameters())
    refused(model, sgd, path, "optimizer states of AdamW, but the optimizer is SGD")
    plain_lr = paddle.optimizer.AdamW(1e-3, parameters=model.parameters())
    refused(model, plain_lr, path, "the checkpoint has an LR scheduler StepDecay, the optimizer has none")


def test_a_truncated_shard_file_is_refused_before_anything_changes(after_two_steps, tmp_path):
    path, _, _, _ = after_two_steps
    meta = read_checkpoint(path)
    copy = tmp_path / "copy"
    subprocess.run(["cp", "-r", str(path), str(copy)], check=True)
    data = copy / meta.data / "rank0.bin"
    data.write_bytes(data.read_bytes()[:-4])
    model = WORKLOAD.build(seed=7)
    optimizer, _ = make_optimizer("adamw", model.parameters())
    refused(model, optimizer, copy, "rank0.bin is missing or shorter than")


@pytest.mark.parametrize(
    "edit, expect",
    [
        (lambda raw: raw.update(data="../elsewhere"), "checkpoint.json: Expected `str` matching regex"),
        (lambda raw: raw.update(version=99), "format version 99"),
        (lambda raw: raw.update(format="autodist.plan"), "not an autodist checkpoint"),
        (lambda raw: next(iter(raw["params"].values()))["shards"].pop(), "the shards"),
        (lambda raw: next(iter(raw["params"].values()))["shards"][0].update(byte_offset=10**9), "ends at byte"),
        (lambda raw: raw.update(surprise=1), "unknown field"),
    ],
    ids=["path-escape", "newer-version", "not-a-checkpoint", "missing-shard", "outside-file", "unknown-field"],
)
def test_bad_metadata_is_refused_in_one_line(after_two_steps, tmp_path, edit, expect):
    path, _, _, _ = after_two_steps
    raw = json.loads((path / METADATA_FILE).read_text())
    edit(raw)
    (tmp_path / METADATA_FILE).write_text(json.dumps(raw))
    with pytest.raises(CheckpointError) as info:
        read_checkpoint(tmp_path)
    assert expect in str(info.value) and "\n" not in str(info.value), str(info.value)


def test_saving_into_a_folder_that_is_not_a_checkpoint_is_refused(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    model = WORKLOAD.build(SEED)
    with pytest.raises(CheckpointError, match="is not an autodist checkpoint"):
        save_checkpoint(model, None, tmp_path, step=0)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


# -- atomic saves -----------------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_save_killed_half_way_leaves_the_previous_checkpoint_loadable(tmp_path):
    """One process saves at step 1, trains a step, and is killed half-way through saving step 2
    into the same folder (TEST-ONLY hook of harness/rank_main.py)."""
    path = tmp_path / "ckpt"
    common = dict(workload="docstring_llama", optimizer="adamw", method="single", steps=1, save_checkpoint=str(path))
    runs = [
        TrainRun("first", **common),
        TrainRun("killed", **common, first_step=1, load_checkpoint=str(path), save_fault="kill"),
    ]
    job = start_job(Job(out_dir=str(tmp_path / "out"), train=runs), 1, tmp_path, timeout_s=120)
    assert job.processes[0].returncode == -9, job.report()
    assert len([p for p in path.iterdir() if p.name.startswith("data-")]) == 2  # the abandoned one is there

    model = WORKLOAD.build(seed=7)
    optimizer, _ = make_optimizer("adamw", model.parameters())
    assert load_checkpoint(model, optimizer, path).step == 1
    (saved,) = read_outputs(tmp_path / "out", "first", 1)
    for fqn, value in saved["params"].items():
        assert np.array_equal(values(model)[fqn], np.asarray(value, dtype=np.float32)), fqn

    save_checkpoint(model, optimizer, path, step=3)  # the next save clears what the killed one left
    assert [p.name for p in path.iterdir() if p.name.startswith("data-")] == [read_checkpoint(path).data]


# -- pieces of the format ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "module", [autodist.applier.placement.layout, autodist.schemas.checkpoint], ids=lambda m: m.__name__
)
def test_docstring_examples(module):
    failed, _ = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert failed == 0


def test_uneven_splits_tile_the_tensor():
    from autodist.applier.placement.layout import distinct_shards

    ids = np.arange(4).reshape(1, 4)
    shards = distinct_shards([10, 3], ids, [None, 0])
    assert [(off, shape) for _, off, shape in shards] == [
        ([0, 0], [3, 3]),
        ([3, 0], [3, 3]),
        ([6, 0], [3, 3]),
        ([9, 0], [1, 3]),
    ]
    assert tiling_problem([10, 3], [(off, shape) for _, off, shape in shards]) is None


@pytest.mark.parametrize(
    "boxes, problem",
    [
        ([([0, 0], [2, 4]), ([1, 0], [3, 4])], "overlap or leave a gap"),
        ([([0, 0], [2, 4]), ([2, 0], [1, 4])], "cover rows 0..3 of dim 0, not all 4"),
        ([([0, 0], [2, 4]), ([0, 0], [2, 4]), ([2, 0], [2, 4])], "do not form one grid"),
        ([([0, 0], [2, 2]), ([2, 2], [2, 2])], "do not form one grid"),
    ],
)
def test_tilings_with_gaps_overlaps_or_holes_are_named(boxes, problem):
    assert problem in tiling_problem([4, 4], boxes)


def test_reading_the_metadata_needs_no_paddle():
    code = textwrap.dedent("""
        import sys, autodist.schemas.checkpoint
        assert "paddle" not in sys.modules and "numpy" not in sys.modules, sorted(sys.modules)
    """)
    subprocess.run([sys.executable, "-c", code], check=True, env=base_env())


def test_a_tensor_dim_split_by_two_mesh_axes_is_refused_not_saved_misplaced(tmp_path):
    import paddle.distributed as dist

    layer = paddle.nn.Linear(4, 4)
    mesh = dist.ProcessMesh([[0]], dim_names=["dp", "mp"])
    layer.weight = dist.shard_tensor(layer.weight, mesh, [dist.Shard(0), dist.Shard(0)])
    with pytest.raises(CheckpointError, match="weight is split along one tensor dim by several mesh axes"):
        save_checkpoint(layer, None, tmp_path / "ckpt", step=0)
    assert not (tmp_path / "ckpt").exists()
