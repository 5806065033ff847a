"""A tampered or hostile checkpoint is checked against the model before anything is written
into it: every saved tensor's name, shape and dtype, every shard's extent, the files it may
read (only inside its folder) and the size and nesting of its metadata. Each case is one
:class:`CheckpointError` naming the problem, with every parameter, every optimizer state and
the LR scheduler as they were (compared value by value).

The model is nanoGPT (tests/models/zoo/nanogpt.py), whose attention projects q, k and v with
one fused ``c_attn`` Linear: transposing that weight's saved shape keeps its size, so before
these checks it loaded silently into wrong values.
"""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
from click.testing import CliRunner
from harness.workloads import WORKLOADS, make_loader, make_optimizer, train

import autodist.schemas.checkpoint
from autodist import CheckpointError, load_checkpoint, save_checkpoint
from autodist.planner.cli import cli
from autodist.schemas.checkpoint import METADATA_FILE, read_checkpoint

WORKLOAD = WORKLOADS["zoo_nanogpt"]
QKV = "transformer.h.0.attn.c_attn.weight"


def trained(seed: int, steps: int):
    model = WORKLOAD.build(seed)
    optimizer, schedule = make_optimizer("adamw", model.parameters())
    train(WORKLOAD, model, optimizer, schedule, make_loader(WORKLOAD, steps, seed), steps)
    return model, optimizer, schedule


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    model, optimizer, _ = trained(1, 2)
    path = tmp_path_factory.mktemp("saved") / "ckpt"
    save_checkpoint(model, optimizer, path, step=2)
    assert QKV in read_checkpoint(path).params
    return path


@pytest.fixture
def target():
    """A model, optimizer and schedule that have trained a step (other values than the saved)."""
    return trained(5, 1)


def everything(model, optimizer, schedule) -> dict[str, bytes | str]:
    """Every parameter, optimizer state and the schedule's state, by name."""
    values: dict[str, bytes | str] = {f"param/{fqn}": p.numpy().tobytes() for fqn, p in model.named_parameters()}
    for kind, per in optimizer._accumulators.items():
        values.update({f"state/{kind}/{name}": t.numpy().tobytes() for name, t in per.items()})
    values["schedule"] = json.dumps(schedule.state_dict(), sort_keys=True)
    return values


def refused(target, path, expect: str) -> str:
    before = everything(*target)
    assert len(before) > 4 * len(list(target[0].parameters())), "the optimizer must hold states to keep"
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(target[0], target[1], path)
    message = str(info.value)
    assert expect in message and "\n" not in message, message
    after = everything(*target)
    assert after.keys() == before.keys()
    changed = [name for name in before if after[name] != before[name]]
    assert not changed, changed
    return message


def copy_with(saved, tmp_path, edit):
    """A copy of the saved checkpoint whose metadata ``edit`` changed."""
    path = tmp_path / "ckpt"
    shutil.copytree(saved, path)
    raw = json.loads((path / METADATA_FILE).read_text())
    edit(raw)
    (path / METADATA_FILE).write_text(json.dumps(raw))
    return path


def transpose(tensor):
    tensor["shape"] = tensor["shape"][::-1]
    for shard in tensor["shards"]:
        shard["shape"], shard["offset"] = shard["shape"][::-1], shard["offset"][::-1]


def test_the_saved_checkpoint_loads(saved, target):
    """The untampered copy loads (so each refusal below is the edit's doing)."""
    load_checkpoint(target[0], target[1], saved)


@pytest.mark.parametrize(
    "edit, expect",
    [
        (
            lambda raw: transpose(raw["params"][QKV]),
            f"1 of another shape or dtype, e.g. '{QKV}' (saved [96, 32] float32, here [32, 96] float32)",
        ),
        (lambda raw: raw["params"].pop(QKV), f"1 not in the checkpoint, e.g. '{QKV}'"),
        (
            lambda raw: raw["params"][QKV].update(dtype="float16"),
            f"e.g. '{QKV}' (saved [32, 96] float16, here [32, 96] float32)",
        ),
        (lambda raw: raw["params"].update(extra=raw["params"][QKV]), "1 only in the checkpoint, e.g. 'extra'"),
        (
            lambda raw: transpose(raw["optimizer"]["states"][QKV]["moment1"]),
            f"{QKV}: moment1 saved as [96, 32] float32, here [32, 96] float32",
        ),
        (
            lambda raw: raw["optimizer"]["states"][QKV]["moment2"].update(dtype="float16"),
            f"{QKV}: moment2 saved as [32, 96] float16, here [32, 96] float32",
        ),
        (
            lambda raw: raw["optimizer"]["states"][QKV].pop("moment2"),
            f"{QKV}: optimizer states ['beta1_pow_acc', 'beta2_pow_acc', 'moment1'] saved, the optimizer has",
        ),
        (
            lambda raw: raw["optimizer"]["states"].pop(QKV),
            f"has no optimizer states of 1 parameters the optimizer holds states of, e.g. '{QKV}'",
        ),
        (
            lambda raw: raw["params"][QKV]["shards"][0].update(offset=[1, 0]),
            f"param/{QKV}: the shards of dim 0 overlap or leave a gap at 0",
        ),
    ],
    ids=[
        "transposed-qkv",
        "removed-entry",
        "dtype-changed",
        "extra-entry",
        "transposed-state",
        "state-dtype",
        "removed-state",
        "removed-parameter-states",
        "shard-moved",
    ],
)
def test_a_tensor_that_does_not_match_the_model_is_refused_with_nothing_changed(saved, target, tmp_path, edit, expect):
    """Before: the transposed qkv loaded silently to wrong values; the removed entry raised
    KeyError after part of the model was overwritten; the dtype change raised AssertionError."""
    refused(target, copy_with(saved, tmp_path, edit), expect)


# -- files: only inside the checkpoint folder -------------------------------------------------------


def elsewhere(saved, tmp_path):
    """A copy of the checkpoint outside the one loaded (what a symlink would point at)."""
    outside = tmp_path / "outside"
    shutil.copytree(saved, outside)
    return outside


def test_a_shard_file_that_is_a_symlink_is_not_followed(saved, target, tmp_path):
    path = copy_with(saved, tmp_path, lambda raw: None)
    data = read_checkpoint(path).data
    (path / data / "rank0.bin").unlink()
    (path / data / "rank0.bin").symlink_to(elsewhere(saved, tmp_path) / data / "rank0.bin")
    refused(target, path, f"{data}/rank0.bin is a symbolic link: a checkpoint's files are read only from inside")


def test_a_data_folder_that_is_a_symlink_is_not_followed(saved, target, tmp_path):
    path = copy_with(saved, tmp_path, lambda raw: None)
    data = read_checkpoint(path).data
    shutil.rmtree(path / data)
    (path / data).symlink_to(elsewhere(saved, tmp_path) / data)
    refused(target, path, f"{data} is a symbolic link")


def test_metadata_that_is_a_symlink_is_not_followed(saved, target, tmp_path):
    path = copy_with(saved, tmp_path, lambda raw: None)
    (path / METADATA_FILE).unlink()
    (path / METADATA_FILE).symlink_to(elsewhere(saved, tmp_path) / METADATA_FILE)
    refused(target, path, f"{METADATA_FILE}: a symbolic link; give the checkpoint's metadata itself")


def test_a_fifo_in_place_of_a_file_is_refused_without_blocking(saved, target, tmp_path):
    path = copy_with(saved, tmp_path, lambda raw: None)
    data = read_checkpoint(path).data
    (path / data / "rank0.bin").unlink()
    os.mkfifo(path / data / "rank0.bin")
    refused(target, path, f"{data}/rank0.bin is not a regular file")
    (path / METADATA_FILE).unlink()
    os.mkfifo(path / METADATA_FILE)
    refused(target, path, f"{METADATA_FILE}: not a regular file (a FIFO (named pipe)); give a checkpoint's metadata")


# -- metadata size and nesting ----------------------------------------------------------------------------


def test_deeply_nested_metadata_is_one_error_in_load_and_in_ckpt_info(target, tmp_path):
    """60 MB of nested arrays: before, RecursionError in both."""
    path = tmp_path / "ckpt"
    path.mkdir()
    depth = 30 * 2**20
    (path / METADATA_FILE).write_bytes(
        b'{"format": "autodist.checkpoint", "version": 2, "step": ' + b"[" * depth + b"]" * depth + b"}"
    )
    refused(target, path, f"{METADATA_FILE} is nested too deeply to be a checkpoint's metadata")
    result = CliRunner().invoke(cli, ["ckpt", "info", str(path)])
    assert result.exit_code == 2 and result.output.count("\n") == 1, result.output
    assert "nested too deeply" in result.output


def test_metadata_larger_than_the_cap_is_not_read(saved, target, tmp_path, monkeypatch):
    path = copy_with(saved, tmp_path, lambda raw: None)
    assert (path / METADATA_FILE).stat().st_size > 1024
    monkeypatch.setattr(autodist.schemas.checkpoint, "MAX_METADATA_BYTES", 1024)
    refused(target, path, f"{METADATA_FILE}: larger than 1 KiB, the most a checkpoint's metadata may be")


def test_every_parameter_is_checked_even_when_the_fingerprint_matches(saved, target, tmp_path):
    """The fingerprint is copied from the saving model: it says nothing of the tensors listed."""
    path = copy_with(saved, tmp_path, lambda raw: transpose(raw["params"][QKV]))
    assert read_checkpoint(path).model == read_checkpoint(saved).model
    refused(target, path, "of another shape or dtype")
    np.testing.assert_equal(len(read_checkpoint(path).params), len(list(target[0].parameters())))
