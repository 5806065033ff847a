"""A key that stays secret (issue #33 item 1). ``python -m paddle.distributed.launch`` writes its
whole environment into ./log (``backup_env.*.json``, ``envlog.*``, mode 0644) even without
``--log_dir``: a secret given as ``AUTODIST_AGREE_SECRET`` lands there, readable by every local
user. The README's way -- ``AUTODIST_AGREE_SECRET_FILE`` naming a file only the user can read --
leaves only the file's path there. A file others can read, or a weak secret, is refused in one
line; the secret in the environment still works, with a warning naming the fix.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import autodist.applier.ranks.jobkey as jobkey
from autodist.schemas import PlanError
from harness.launcher import TESTS_DIR, base_env, free_ports

SECRET = "7d2f9a4c1e8b3065" * 4  # what `secrets.token_hex(32)` makes: 256 bits


def _secret_file(folder: Path, text: str = SECRET, mode: int = 0o600) -> Path:
    path = folder / "agree.secret"
    path.write_text(text + "\n")
    path.chmod(mode)
    return path


@pytest.fixture
def no_secret(monkeypatch):
    for name in (jobkey.SECRET_ENV, jobkey.SECRET_FILE_ENV):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_the_secret_file_gives_the_key(no_secret, tmp_path):
    no_secret.setenv(jobkey.SECRET_FILE_ENV, str(_secret_file(tmp_path)))
    assert jobkey.read_key("127.0.0.1:6170") == jobkey._from_secret(SECRET)


@pytest.mark.parametrize(
    ("mode", "text", "said"),
    [
        (0o644, SECRET, r"not a file only this user can read \(owner uid \d+, mode 644\); `chmod 600"),
        (0o640, SECRET, "not a file only this user can read"),
        (0o600, "s3cret-passw0rd", r"the secret is weak \(about \d+ bits, at least 96 needed\)"),
        (0o600, "a" * 64, r"the secret is weak \(about 0 bits"),
    ],
)
def test_a_secret_file_others_can_read_or_a_weak_secret_is_one_line(no_secret, tmp_path, mode, text, said):
    no_secret.setenv(jobkey.SECRET_FILE_ENV, str(_secret_file(tmp_path, text, mode)))
    with pytest.raises(PlanError, match=said) as refused:
        jobkey.read_key("127.0.0.1:6170")
    assert len(str(refused.value).splitlines()) == 1 and SECRET not in str(refused.value)


def test_a_secret_file_of_another_user_is_refused(no_secret, tmp_path):
    if os.getuid() != 0:
        pytest.skip("giving a file to another user needs root")
    path = _secret_file(tmp_path)
    os.chown(path, 65534, 65534)
    no_secret.setenv(jobkey.SECRET_FILE_ENV, str(path))
    with pytest.raises(PlanError, match="not a file only this user can read \\(owner uid 65534"):
        jobkey.read_key("127.0.0.1:6170")


def test_a_weak_secret_in_the_environment_is_refused_and_a_strong_one_warned_about(no_secret):
    no_secret.setenv(jobkey.SECRET_ENV, "the job's secret")
    with pytest.raises(PlanError, match="AUTODIST_AGREE_SECRET: the secret is weak"):
        jobkey.read_key("127.0.0.1:6170")
    no_secret.setenv(jobkey.SECRET_ENV, SECRET)
    with pytest.warns(UserWarning, match="writes into ./log .* set AUTODIST_AGREE_SECRET_FILE"):
        assert jobkey.read_key("127.0.0.1:6170") == jobkey._from_secret(SECRET)


def test_both_ways_at_once_is_refused(no_secret, tmp_path):
    no_secret.setenv(jobkey.SECRET_FILE_ENV, str(_secret_file(tmp_path)))
    no_secret.setenv(jobkey.SECRET_ENV, SECRET)
    with pytest.raises(PlanError, match="both AUTODIST_AGREE_SECRET_FILE and AUTODIST_AGREE_SECRET are set"):
        jobkey.read_key("127.0.0.1:6170")


def _launch(workdir: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    """A 2-rank job as the README launches it: ``python -m paddle.distributed.launch
    --nproc_per_node 2 SCRIPT`` (no --log_dir: the launcher writes ./log), its ranks running the
    agreement (harness/agree_rank.py)."""
    environment = base_env(env)
    for name in (jobkey.SECRET_ENV, jobkey.SECRET_FILE_ENV, "AUTODIST_AGREE_PORT", "PADDLE_MASTER"):
        environment.pop(name, None)
    environment.update(env)
    (master,) = free_ports(1)
    command = [sys.executable, "-m", "paddle.distributed.launch", "--master", f"127.0.0.1:{master}"]
    command += ["--nproc_per_node", "2", str(TESTS_DIR / "harness" / "agree_rank.py"), "a" * 64]
    return subprocess.run(command, cwd=workdir, env=environment, capture_output=True, text=True, timeout=240)


def _holding(workdir: Path, text: str) -> list[str]:
    """The files under ``workdir`` holding ``text``, with their modes."""
    return [
        f"{path.relative_to(workdir)} ({path.stat().st_mode & 0o777:o})"
        for path in sorted(workdir.rglob("*"))
        if path.is_file() and text.encode() in path.read_bytes()
    ]


@pytest.mark.multiprocess
def test_launched_as_the_readme_says_no_log_file_holds_the_secret(tmp_path):
    """The README's way: the secret in a file of mode 0600 outside the job's folder, its path in
    AUTODIST_AGREE_SECRET_FILE. The ranks agree under it, and no file the launcher wrote (./log:
    backup_env, envlog, default and worker logs) holds the secret -- while the variable itself is
    there, so the scan does read the launcher's record of the environment."""
    keys, job = tmp_path / "keys", tmp_path / "job"
    keys.mkdir(mode=0o700)
    job.mkdir()
    path = _secret_file(keys)
    done = _launch(job, {jobkey.SECRET_FILE_ENV: str(path)})
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    logs = sorted(p.name for p in (job / "log").iterdir())
    assert _holding(job, SECRET) == [], logs
    assert _holding(job, str(path)), f"the launcher wrote no record of its environment: {logs}"
    workers = "".join(p.read_text() for p in (job / "log").glob("workerlog.*"))
    assert workers.count('"error": null') == 2, workers[-3000:]


@pytest.mark.multiprocess
def test_launched_with_the_secret_in_the_environment_the_logs_hold_it_and_it_says_so(tmp_path):
    """What the README warns against, shown: AUTODIST_AGREE_SECRET exported before the launcher
    ends up in ./log, mode 0644, and every rank warns with the fix."""
    done = _launch(tmp_path, {jobkey.SECRET_ENV: SECRET})
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    held = _holding(tmp_path, SECRET)
    assert any(name.startswith("log/") and name.endswith("(644)") for name in held), held
    workers = "".join(p.read_text() for p in (tmp_path / "log").glob("workerlog.*"))
    assert workers.count("set AUTODIST_AGREE_SECRET_FILE to it instead") == 2, workers[-3000:]


@pytest.mark.multiprocess
def test_launched_with_a_secret_file_others_can_read_every_rank_refuses_it(tmp_path):
    """The same launch, the file left at mode 0644: every rank refuses it in one line (so the ranks
    the launcher starts do read the file, and nothing runs on a secret others could read)."""
    path = _secret_file(tmp_path, mode=0o644)
    job = tmp_path / "job"
    job.mkdir()
    done = _launch(job, {jobkey.SECRET_FILE_ENV: str(path)})
    workers = "".join(p.read_text() for p in (job / "log").glob("workerlog.*"))
    assert workers.count("not a file only this user can read") == 2, done.stderr[-2000:] + workers[-3000:]
