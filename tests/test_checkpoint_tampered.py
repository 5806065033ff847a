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
from autodist.schemas.checkpoint import METADATA_FILE, Shard, read_checkpoint, shard_digest

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
    """Every parameter, optimizer state and the schedule's state this rank holds, by name (a
    distributed tensor by its local value; the optimizer by the states apply_plan's wrapper holds)."""
    values: dict[str, bytes | str] = {f"param/{fqn}": held(p) for fqn, p in model.named_parameters()}
    for kind, per in optimizer.__dict__.get("_inner_opt", optimizer)._accumulators.items():
        values.update({f"state/{kind}/{name}": held(t) for name, t in per.items()})
    values["schedule"] = json.dumps(schedule.state_dict(), sort_keys=True)
    return values


def held(tensor) -> bytes:
    return (tensor._local_value() if tensor.is_dist() else tensor).numpy().tobytes()


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


def copy_with(saved, tmp_path, edit, rehash: bool = False):
    """A copy of the saved checkpoint whose metadata ``edit`` changed; with ``rehash``, every
    shard's checksum made anew for what the metadata now says (as if another run saved it)."""
    path = tmp_path / "ckpt"
    shutil.copytree(saved, path)
    raw = json.loads((path / METADATA_FILE).read_text())
    edit(raw)
    if rehash:
        rehash_shards(raw, path)
    (path / METADATA_FILE).write_text(json.dumps(raw))
    return path


def rehash_shards(raw: dict, path) -> None:
    """Every shard's checksum in the metadata ``raw`` made anew, with the public function, for
    what the metadata says and the data files in ``path`` hold now."""
    data = {file: (path / raw["data"] / file).read_bytes() for file in raw["files"]}
    tensors = {f"param/{fqn}": t for fqn, t in raw["params"].items()}
    tensors.update({f"optimizer/{fqn}/{kind}": t for fqn, kinds in raw["optimizer"]["states"].items()
                    for kind, t in kinds.items()})  # fmt: skip
    for name, tensor in tensors.items():
        for one in tensor["shards"]:
            shard = Shard(**one)
            size = int(np.prod(shard.shape)) * np.dtype(tensor["dtype"]).itemsize
            one["sha256"] = shard_digest(name, tensor["dtype"], shard, data[shard.file][shard.byte_offset :][:size])


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
        (
            lambda raw: raw["params"].update(extra=raw["params"][QKV]),
            f"param/{QKV}: its bytes 218488..230776 in 'rank0.bin' are also param/extra's",
        ),
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
    """Checksums made anew, as another model's checkpoint would have them. Before: the transposed
    qkv loaded silently to wrong values; the removed entry raised
    KeyError after part of the model was overwritten; the dtype change raised AssertionError."""
    refused(target, copy_with(saved, tmp_path, edit, rehash=True), expect)


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


# -- integrity: edits that keep every shape, caught by the shards' checksums -----------------------------
# Before checksums, each of these loaded silently into wrong values (an outside audit's nine cases).

SAME_SHAPE = ("transformer.h.0.ln_1.weight", "transformer.h.0.ln_2.weight")


def swap(a: dict, b: dict, *keys: str) -> None:
    for key in keys:
        a[key], b[key] = b[key], a[key]


def rows_split(raw: dict, name: str, path) -> None:
    """``name``'s one shard as two row shards over the same bytes, each with the checksum a
    save would give it: a legitimate layout (a save under mp2 writes rows so)."""
    tensor = raw["params"][name]
    (one,) = tensor["shards"]
    rows, cols = tensor["shape"]
    data = (path / raw["data"] / one["file"]).read_bytes()
    half = rows // 2 * cols * 4
    shards = []
    for i, (start, count) in enumerate([(0, rows // 2), (rows // 2, rows - rows // 2)]):
        shard = Shard(
            file=one["file"], byte_offset=one["byte_offset"] + i * half, offset=[start, 0], shape=[count, cols]
        )
        shard.sha256 = shard_digest(
            f"param/{name}", "float32", shard, data[shard.byte_offset : shard.byte_offset + count * cols * 4]
        )
        shards.append({f: getattr(shard, f) for f in shard.__struct_fields__})
    tensor["shards"] = shards


def test_a_legitimate_row_split_loads(saved, target, tmp_path):
    """The row split the cases below tamper with loads, to the saved values."""
    path = copy_with(saved, tmp_path, lambda raw: rows_split(raw, QKV, saved))
    load_checkpoint(target[0], target[1], path)
    np.testing.assert_array_equal(
        dict(target[0].named_parameters())[QKV].numpy(), trained(1, 2)[0].state_dict()[QKV].numpy()
    )


@pytest.mark.parametrize(
    "edit, expect",
    [
        (
            lambda raw, _: swap(*(raw["params"][n]["shards"][0] for n in SAME_SHAPE), "byte_offset"),
            f"param/{SAME_SHAPE[0]}: the bytes of its shard at [0] (",
        ),
        (
            lambda raw, _: raw["params"][SAME_SHAPE[0]]["shards"][0].update(
                byte_offset=raw["params"][SAME_SHAPE[1]]["shards"][0]["byte_offset"]
            ),
            f"param/{SAME_SHAPE[1]}: its bytes",
        ),
        (
            lambda raw, saved: (
                rows_split(raw, QKV, saved),
                raw["params"][QKV]["shards"][1].update(byte_offset=raw["params"][QKV]["shards"][0]["byte_offset"]),
            ),
            f"param/{QKV}: its bytes",
        ),
        (
            lambda raw, _: swap(
                raw["optimizer"]["states"][QKV]["moment1"], raw["optimizer"]["states"][QKV]["moment2"], "shards"
            ),
            "do not match its sha256: the checkpoint was changed or corrupted",
        ),
        (
            lambda raw, saved: (rows_split(raw, QKV, saved), swap(*raw["params"][QKV]["shards"], "offset")),
            f"param/{QKV}: the bytes of its shard at [16, 0] (",
        ),
    ],
    ids=["same-shape-offsets-swapped", "aliased", "all-shards-one-place", "moments-swapped", "row-offsets-swapped"],
)
def test_an_edit_that_keeps_every_shape_is_refused_with_nothing_changed(saved, target, tmp_path, edit, expect):
    refused(target, copy_with(saved, tmp_path, lambda raw: edit(raw, saved)), expect)


def test_overwritten_bytes_are_refused(saved, target, tmp_path):
    path = copy_with(saved, tmp_path, lambda raw: None)
    meta = read_checkpoint(path)
    shard = meta.params[QKV].shards[0]
    with open(path / meta.data / shard.file, "r+b") as f:
        f.seek(shard.byte_offset + 40)
        f.write(b"\x00\x00\x80\x7f")
    refused(target, path, f"param/{QKV}: the bytes of its shard at [0, 0] ({meta.data}/rank0.bin, byte")


def test_a_shard_file_hard_linked_elsewhere_is_refused(saved, target, tmp_path):
    path = copy_with(saved, tmp_path, lambda raw: None)
    data = read_checkpoint(path).data
    os.link(path / data / "rank0.bin", tmp_path / "outside.bin")
    refused(target, path, f"{data}/rank0.bin has 2 hard links: a checkpoint's shard files must be its own")


def test_a_learning_rate_of_1e308_is_refused(saved, target, tmp_path):
    """Before: accepted, and the next step made every parameter NaN."""
    path = copy_with(saved, tmp_path, lambda raw: raw["scheduler"]["state"].update(last_lr=1e308))
    refused(target, path, "LR scheduler StepDecay's saved last_lr 1e+308 is beyond ±1000.0")


def test_an_optimizer_state_out_of_its_range_is_refused(saved, target, tmp_path):
    """A beta power above 1 (checksum recomputed, as a careless tool that rewrites a state would)."""
    path = copy_with(saved, tmp_path, lambda raw: None)
    meta = read_checkpoint(path)
    saved_state = meta.optimizer.states[QKV]["beta1_pow_acc"]
    shard = saved_state.shards[0]
    file = path / meta.data / shard.file
    data = bytearray(file.read_bytes())
    data[shard.byte_offset : shard.byte_offset + 4] = np.float32(1.5).tobytes()
    file.write_bytes(bytes(data))
    digest = shard_digest(
        f"optimizer/{QKV}/beta1_pow_acc", "float32", shard, data[shard.byte_offset : shard.byte_offset + 4]
    )
    raw = json.loads((path / METADATA_FILE).read_text())
    raw["optimizer"]["states"][QKV]["beta1_pow_acc"]["shards"][0]["sha256"] = digest
    (path / METADATA_FILE).write_text(json.dumps(raw))
    refused(target, path, f"optimizer/{QKV}/beta1_pow_acc: holds values outside [0.0, 1.0]")


def test_duplicate_keys_in_the_metadata_are_refused(saved, target, tmp_path):
    path = copy_with(saved, tmp_path, lambda raw: None)
    text = (path / METADATA_FILE).read_text()
    (path / METADATA_FILE).write_text(text.replace('"step":', '"step": 0, "step":', 1))
    refused(target, path, 'the key "step" appears more than once')
