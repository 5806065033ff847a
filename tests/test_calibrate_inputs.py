"""`calibrate` with a hostile or careless model, and the atomic writer under signals (issue #23,
item 8): a model that exits or raises in training is one `error:` line and a non-zero exit; `-o`
into a missing folder is refused before measuring; no temp file outlives a write that SIGTERM or
SIGHUP interrupts, and one SIGKILL left behind is removed by the next write."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from test_planner_robustness import model_file

AUTODIST_PLAN = str(Path(sys.executable).parent / "autodist-plan")


def run(*args, cwd) -> subprocess.CompletedProcess:
    return subprocess.run([AUTODIST_PLAN, *map(str, args)], capture_output=True, text=True, timeout=300, cwd=cwd)


@pytest.fixture
def planned(tmp_path):
    """A one-device plan of a model whose training step is the statement given."""

    def make(training: str) -> Path:
        # calibrate trains eagerly; the planner traces (statically, in train mode too: self.training is read)
        forward_extra = f"if self.training and paddle.in_dynamic_mode(): {training}"
        model = Path(model_file(tmp_path, forward_extra=forward_extra, module_extra="import sys"))
        made = run(model, "--nproc-per-node", 1, "--device", "cpu", "-q", "-o", tmp_path / "plan.json", cwd=tmp_path)
        assert made.returncode == 0, made.stderr
        return model

    return make


@pytest.mark.parametrize(
    "training, message",
    [
        ("sys.exit(0)", "model.py: the model's code called sys.exit(0) while autodist ran it"),
        ('raise RuntimeError("boom in forward")', "model.py: a training step under the plan raised RuntimeError: boom"),
    ],
    ids=["sys_exit", "crash"],
)
def test_a_model_that_exits_or_raises_in_training_is_one_error(tmp_path, planned, training, message):
    """sys.exit(0) in forward made `calibrate --model` exit 0 with nothing written and nothing said;
    a crash printed a traceback."""
    model = planned(training)
    result = run("calibrate", "--plan", "plan.json", "--model", model, "-o", "cluster.toml", cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith("error: ") and result.stderr.count("\n") == 1, result.stderr
    assert message in result.stderr and "Traceback" not in result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.py", "plan.json"]  # nothing else written


def test_output_into_a_missing_folder_is_refused_before_measuring(tmp_path):
    result = run("calibrate", "-o", tmp_path / "no" / "cluster.toml", cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr == f"error: cannot write {tmp_path / 'no' / 'cluster.toml'}: no folder '{tmp_path / 'no'}'\n"
    assert "paddle" not in result.stderr.lower()


# -- the writer under signals --------------------------------------------------------------------------

WRITER = """
import os, signal, sys
from autodist.schemas.io import write_atomically

def fsync_then_signal(fd, _fsync=os.fsync):
    _fsync(fd)
    os.kill(os.getpid(), signal.{signal})  # arrives mid-write, with the temp file on disk

if signal.{signal} != signal.SIGKILL:  # its default action, as a shell starts it (nohup ignores SIGHUP)
    signal.signal(signal.{signal}, signal.SIG_DFL)
os.fsync = fsync_then_signal
write_atomically(sys.argv[1], b"new")
print("not reached")
"""


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGHUP"])
def test_a_write_interrupted_by_a_catchable_signal_leaves_no_temp_and_dies_of_it(tmp_path, sig):
    target = tmp_path / "cluster.toml"
    target.write_text("old")
    result = subprocess.run(
        [sys.executable, "-c", WRITER.format(signal=sig), str(target)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == -getattr(signal, sig), (result.returncode, result.stderr)
    assert "not reached" not in result.stdout
    assert os.listdir(tmp_path) == ["cluster.toml"] and target.read_text() == "old"


def test_the_temp_file_a_sigkill_leaves_is_removed_by_the_next_write(tmp_path):
    target = tmp_path / "cluster.toml"
    killed = subprocess.run(
        [sys.executable, "-c", WRITER.format(signal="SIGKILL"), str(target)], capture_output=True, timeout=60
    )
    assert killed.returncode == -signal.SIGKILL
    (leftover,) = [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
    assert leftover.name.startswith(".cluster.toml.")
    from autodist.schemas.io import write_atomically

    write_atomically(target, b"next")
    assert os.listdir(tmp_path) == ["cluster.toml"] and target.read_bytes() == b"next"


def test_a_temp_file_of_a_live_writer_is_left_alone(tmp_path):
    from autodist.schemas.io import _HOST, write_atomically

    live = tmp_path / f".cluster.toml.{_HOST}-{os.getpid()}.abc123.tmp"  # this process: alive
    live.write_text("")
    write_atomically(tmp_path / "cluster.toml", b"x")
    assert live.exists()
