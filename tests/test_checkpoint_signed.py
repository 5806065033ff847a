"""Checkpoints signed with the job's key (issue #33 item 3): a job with a secret
(``AUTODIST_AGREE_SECRET_FILE``) signs the metadata, which holds every shard's checksum, and a
job with the same secret refuses a checkpoint whose signature does not hold, with model,
optimizer and scheduler unchanged (compared value by value, as tests/test_checkpoint_tampered.py
does). The editor here is deliberate: it rewrites the data or the metadata and recomputes every
sha256 with the public :func:`~autodist.schemas.checkpoint.shard_digest`.

One process: the nanoGPT checkpoint of test_checkpoint_tampered.py, signed. Several gloo
processes (``multiprocess``): a 2-rank mp2 job saves under a secret; 2-rank jobs load the
deliberately edited copy (refused on both ranks), the one without its signature (refused) and
the saved one (loads), and under another secret (refused); a rank killed between writing the
signed metadata and committing it leaves the previous checkpoint committed and verifying.

This file is also the ranks' script: ``python tests/test_checkpoint_signed.py MODE PATH...``.
"""

from __future__ import annotations

import doctest
import json
import os
import shutil
import signal
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
from harness.launcher import launch_ranks
from harness.plans import tensor_parallel_plan
from harness.workloads import WORKLOADS, make_loader, make_optimizer, train
from test_checkpoint_tampered import QKV, SAME_SHAPE, copy_with, everything, refused, rehash_shards, swap, trained

from autodist import CheckpointError, apply_plan, export_checkpoint, load_checkpoint, save_checkpoint
import autodist.applier.ranks.jobkey as jobkey
from autodist.applier.checkpoint.save_load import UNSIGNED_ENV
from autodist.applier.ranks.jobkey import SECRET_ENV, SECRET_FILE_ENV, derived_key
from autodist.schemas.checkpoint import (
    METADATA_FILE,
    SIGNING_PURPOSE,
    decode_checkpoint,
    read_checkpoint,
    signature_problem,
)

SECRETS = {"a": "3f9c1d7e5a2b8046" * 4, "b": "c4e81a0f6d2b9375" * 4}
CHANGED = "its metadata does not match its signature: it was changed after it was saved; nothing was loaded"
OTHER_KEY = "it was signed with another key than this job's"
UNSIGNED = f"it is not signed, and this job has a secret ({SECRET_FILE_ENV} or {SECRET_ENV}) to check one with"


def secret_files(folder: Path) -> dict[str, Path]:
    """Each secret in a file only this user can read, as the README asks."""
    folder.mkdir(exist_ok=True)
    files = {}
    for name, text in SECRETS.items():
        files[name] = folder / f"{name}.secret"
        with open(os.open(files[name], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
            f.write(text)
    return files


@pytest.fixture(scope="module")
def secrets(tmp_path_factory) -> dict[str, Path]:
    return secret_files(tmp_path_factory.mktemp("secrets"))


@pytest.fixture
def job_secret(monkeypatch, secrets):
    """``job_secret("a")``: this process is a job with secret a; ``job_secret(None)``: with none."""
    monkeypatch.delenv(SECRET_ENV, raising=False)

    def use(name: str | None) -> None:
        if name is None:
            monkeypatch.delenv(SECRET_FILE_ENV, raising=False)
        else:
            monkeypatch.setenv(SECRET_FILE_ENV, str(secrets[name]))

    return use


@pytest.fixture(scope="module")
def signed(tmp_path_factory, secrets):
    """nanoGPT after 2 AdamW steps, saved by a job with secret a."""
    with pytest.MonkeyPatch.context() as patch:
        patch.delenv(SECRET_ENV, raising=False)
        patch.setenv(SECRET_FILE_ENV, str(secrets["a"]))
        model, optimizer, _ = trained(1, 2)
        path = tmp_path_factory.mktemp("signed") / "ckpt"
        meta = save_checkpoint(model, optimizer, path, step=2)
        key = derived_key(SIGNING_PURPOSE)
    assert meta.signature is not None and read_checkpoint(path) == meta
    assert key is not None and signature_problem(meta, key) is None
    return path


@pytest.fixture
def target():
    return trained(5, 1)


def overwrite_values(raw: dict, path: Path, name: str = QKV) -> None:
    """The deliberate editor: the first row of parameter ``name``'s first shard set to 7.0 in
    the data file, then every checksum recomputed."""
    shard = raw["params"][name]["shards"][0]
    with open(path / raw["data"] / shard["file"], "r+b") as f:
        f.seek(shard["byte_offset"])
        f.write(np.full(shard["shape"][-1], 7.0, np.float32).tobytes())
    rehash_shards(raw, path)


def swap_same_shape(raw: dict, path: Path) -> None:
    """The deliberate editor: two same-shape parameters' bytes swapped, checksums recomputed."""
    swap(*(raw["params"][name]["shards"][0] for name in SAME_SHAPE), "byte_offset")
    rehash_shards(raw, path)


def edited(signed: Path, tmp_path: Path, edit) -> Path:
    """A copy of ``signed`` the deliberate editor changed (its signature left as it was)."""
    return copy_with(signed, tmp_path, lambda raw: edit(raw, tmp_path / "ckpt"))


EDITS = {"values-rewritten": overwrite_values, "same-shape-swapped": swap_same_shape}


def test_the_signed_checkpoint_loads_under_its_secret_and_without_one(signed, target, job_secret):
    job_secret("a")
    assert load_checkpoint(target[0], target[1], signed).step == 2
    job_secret(None)  # as before signing: checksums only
    assert load_checkpoint(*trained(5, 1)[:2], signed).step == 2


@pytest.mark.parametrize("edit", EDITS.values(), ids=EDITS.keys())
def test_a_deliberate_editor_is_refused_under_the_secret(signed, target, tmp_path, job_secret, edit):
    path = edited(signed, tmp_path, edit)
    job_secret(None)
    read_checkpoint(path)  # every checksum holds: without a key nothing tells the edit
    job_secret("a")
    refused(target, path, CHANGED)


@pytest.mark.parametrize("edit", EDITS.values(), ids=EDITS.keys())
def test_without_a_secret_the_same_edit_loads_the_documented_limit(signed, target, tmp_path, job_secret, edit):
    """docs/checkpoints.md, "Integrity": checksums alone do not stop a deliberate editor."""
    path = edited(signed, tmp_path, edit)
    job_secret(None)
    load_checkpoint(target[0], target[1], path)
    params = dict(target[0].named_parameters())
    if edit is overwrite_values:
        assert (params[QKV].numpy()[0] == 7.0).all()
    else:
        saved = dict(trained(1, 2)[0].named_parameters())
        np.testing.assert_array_equal(params[SAME_SHAPE[0]].numpy(), saved[SAME_SHAPE[1]].numpy())


def test_another_secret_is_refused_naming_the_key(signed, target, job_secret):
    job_secret("b")
    message = refused(target, signed, OTHER_KEY)
    assert "the job's secret differs from the saving job's" in message


def test_an_unsigned_checkpoint_under_a_secret_is_refused_unless_accepted(
    signed, target, tmp_path, job_secret, monkeypatch
):
    """The editor who removes the signature (and says version 4, before signing) gains nothing;
    a checkpoint truly from before signing loads once with AUTODIST_CHECKPOINT_UNSIGNED=accept."""
    path = copy_with(signed, tmp_path, lambda raw: (raw.pop("signature"), raw.update(version=4)))
    job_secret("a")
    message = refused(target, path, UNSIGNED)
    assert f"set {UNSIGNED_ENV}=accept once (the next save signs it)" in message
    monkeypatch.setenv(UNSIGNED_ENV, "yes")
    refused(target, path, f"{UNSIGNED_ENV}='yes': the only value is 'accept'")
    monkeypatch.setenv(UNSIGNED_ENV, "accept")
    refused(target, edited(signed, tmp_path / "edited", overwrite_values), CHANGED)  # accept is for unsigned only
    with pytest.warns(UserWarning, match=f"loading a checkpoint that is not signed \\({UNSIGNED_ENV}=accept\\)"):
        assert load_checkpoint(target[0], target[1], path).step == 2


def test_export_checks_the_signature_too(signed, tmp_path, job_secret):
    path = edited(signed, tmp_path, overwrite_values)
    job_secret("a")
    with pytest.raises(CheckpointError, match=CHANGED):
        export_checkpoint(path, tmp_path / "model.pdparams")
    assert not (tmp_path / "model.pdparams").exists()


def test_a_weak_secret_is_refused_at_save_with_nothing_written_and_at_load(
    signed, target, tmp_path, job_secret, monkeypatch
):
    job_secret(None)
    model, optimizer, _ = trained(1, 1)
    weak = tmp_path / "weak.secret"
    with open(os.open(weak, os.O_WRONLY | os.O_CREAT, 0o600), "w") as f:
        f.write("summer2024")
    monkeypatch.setenv(SECRET_FILE_ENV, str(weak))
    with pytest.raises(CheckpointError, match="the secret is weak") as info:
        save_checkpoint(model, optimizer, tmp_path / "ckpt", step=1)
    assert "\n" not in str(info.value) and not (tmp_path / "ckpt").exists()
    assert refused(target, signed, f"{SECRET_FILE_ENV}={weak}: the secret is weak").startswith(f"{signed}: ")


def test_a_signature_in_metadata_older_than_signing_is_refused(signed):
    raw = json.loads((signed / METADATA_FILE).read_text())
    raw["version"] = 4
    with pytest.raises(CheckpointError, match="a signature in version 4 metadata"):
        decode_checkpoint(json.dumps(raw).encode())


def test_ckpt_info_says_whether_it_is_signed_and_that_it_cannot_check(signed, tmp_path):
    from click.testing import CliRunner

    from autodist.planner.cli import cli

    key_id = read_checkpoint(signed).signature.key_id
    shown = CliRunner().invoke(cli, ["ckpt", "info", str(signed)])
    assert shown.exit_code == 0, shown.output
    assert f"signed      yes, key id {key_id} (not checked here, which needs the job's secret" in shown.output
    assert json.loads(CliRunner().invoke(cli, ["ckpt", "info", str(signed), "--json"]).output)["signature"] == {
        "key_id": key_id
    }
    unsigned = copy_with(signed, tmp_path, lambda raw: raw.pop("signature"))
    assert (
        "signed      no (saved by a job without a secret"
        in CliRunner().invoke(cli, ["ckpt", "info", str(unsigned)]).output
    )


def test_jobkey_examples(job_secret):
    """derived_key's example: keys for two purposes differ, and there is none without a secret."""
    job_secret(None)
    failed, _ = doctest.testmod(jobkey)
    assert failed == 0


# -- 2 gloo ranks ----------------------------------------------------------------------------------------

LLAMA = WORKLOADS["docstring_llama"]
SEED = 2024
#: Split over mp by the plan: each rank writes half of it.
LLAMA_WEIGHT = "layers.0.self_attn.q_proj.weight"


def rank_main(mode: str, path: str, *loads: str) -> None:
    """TEST-ONLY, each rank of a 2-rank mp2 job of the docstring Llama with AdamW:

    - ``save PATH``: 2 steps, save at step 2;
    - ``save-killed PATH``: load PATH, 1 step, then rank 0 SIGKILLs itself when it renames the
      signed metadata over ``checkpoint.json`` (everything written and signed, nothing committed);
    - ``load _ PATH...``: other weights, 1 step (so the optimizer holds states), then each PATH
      loaded in turn; prints, per PATH, the error (or None) and whether everything held stayed.
    """
    model = LLAMA.build(SEED if mode != "load" else SEED + 1)
    optimizer, schedule = make_optimizer("adamw", model.parameters())
    plan = tensor_parallel_plan(model, mp=2)
    model, optimizer, loader = apply_plan(model, optimizer, make_loader(LLAMA, 2, SEED), plan)
    if mode == "save":
        train(LLAMA, model, optimizer, schedule, loader, 2)
        save_checkpoint(model, optimizer, path, step=2)
        return
    if mode == "save-killed":
        load_checkpoint(model, optimizer, path)
        train(LLAMA, model, optimizer, schedule, loader, 1)
        if int(os.environ["PADDLE_TRAINER_ID"]) == 0:
            rename = os.replace

            def killed_at_commit(src, dst, *args, **kwargs):
                if Path(dst).name == METADATA_FILE:
                    os.kill(os.getpid(), signal.SIGKILL)
                rename(src, dst, *args, **kwargs)

            os.replace = killed_at_commit
        save_checkpoint(model, optimizer, path, step=3)
        return
    train(LLAMA, model, optimizer, schedule, loader, 1)
    results = []
    for each in loads:
        before = everything(model, optimizer, schedule)
        try:
            error = None
            load_checkpoint(model, optimizer, each)
        except CheckpointError as exc:
            error = str(exc)
        results.append({"error": error, "unchanged": everything(model, optimizer, schedule) == before})
    print(json.dumps(results))


def job(tmp_path: Path, name: str, secret: Path, *args: str, expect_ok: bool = True):
    done = launch_ranks(
        2, [__file__, *args], tmp_path / name, timeout_s=240, extra_env={SECRET_FILE_ENV: str(secret)},
        failure_grace_s=5, retry_rendezvous=expect_ok,
    )  # fmt: skip
    if expect_ok:
        done.raise_for_failure()
        return [json.loads(p.stdout.strip().splitlines()[-1]) for p in done.processes if p.stdout.strip()]
    return done


@pytest.fixture(scope="module")
def saved_by_two_ranks(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("two_ranks")
    files = secret_files(workdir / "secrets")
    path = workdir / "ckpt"
    job(workdir, "save", files["a"], "save", str(path))
    assert read_checkpoint(path).signature is not None and read_checkpoint(path).world_size == 2
    return workdir, files, path


@pytest.mark.multiprocess
def test_two_ranks_refuse_a_deliberate_edit_and_load_the_signed_checkpoint(saved_by_two_ranks, tmp_path):
    workdir, files, path = saved_by_two_ranks
    changed = edited(path, tmp_path / "changed", lambda raw, copy: overwrite_values(raw, copy, LLAMA_WEIGHT))
    assert len(read_checkpoint(changed).params[LLAMA_WEIGHT].shards) == 2
    stripped = copy_with(path, tmp_path / "stripped", lambda raw: raw.pop("signature"))
    same = job(workdir, "load_same", files["a"], "load", "_", str(changed), str(stripped), str(path))
    other = job(workdir, "load_other", files["b"], "load", "_", str(path))
    for rank, (same_results, other_results) in enumerate(zip(same, other, strict=True)):
        (edit, unsigned, good), (foreign,) = same_results, other_results
        assert edit["error"].endswith(CHANGED) and edit["unchanged"], (rank, edit)
        assert UNSIGNED in unsigned["error"] and unsigned["unchanged"], (rank, unsigned)
        assert good["error"] is None and not good["unchanged"], (rank, good)
        assert OTHER_KEY in foreign["error"] and foreign["unchanged"], (rank, foreign)


@pytest.mark.multiprocess
def test_a_rank_killed_between_signing_and_committing_leaves_the_previous_checkpoint(
    saved_by_two_ranks, tmp_path, job_secret
):
    """The signature is inside checkpoint.json, so the one rename commits data and signature
    together: killed just before it, the step-2 checkpoint is still the one committed, signed
    and verifying, and the step-3 metadata (signed) was only a temp file the next save removes."""
    workdir, files, saved = saved_by_two_ranks
    path = tmp_path / "ckpt"
    shutil.copytree(saved, path)
    done = job(workdir, "killed", files["a"], "save-killed", str(path), expect_ok=False)
    assert done.processes[0].returncode == -9, done.report()
    (pending,) = [p for p in path.iterdir() if p.name.startswith(f".{METADATA_FILE}.data-3-")]
    assert decode_checkpoint(pending.read_bytes()).signature is not None  # killed after signing
    job_secret("a")
    model = LLAMA.build(SEED + 1)
    assert load_checkpoint(model, None, path).step == 2
    optimizer, _ = make_optimizer("adamw", model.parameters())
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a secret from a file: no warning
        save_checkpoint(model, optimizer, path, step=2)
    assert not pending.exists() and len([p for p in path.iterdir() if p.name.startswith("data-")]) == 1


if __name__ == "__main__":
    rank_main(*sys.argv[1:])
