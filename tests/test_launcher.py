"""The test harness's launcher: a job that dies in gloo's rendezvous is started once more, only
when asked (jobs expected to succeed) and only for that death (harness/launcher.py)."""

from __future__ import annotations


from harness.launcher import _GLOO_ABORT, JobResult, ProcessResult, launch_ranks, lost_at_rendezvous

#: A rank that aborts as gloo does at its rendezvous the first time the job starts (it leaves a
#: mark in the job's folder), and succeeds the next time.
FLAKY_RANK = f"""
import os, pathlib, resource, sys
mark = pathlib.Path(sys.argv[1]) / f"started.rank{{os.environ['PADDLE_TRAINER_ID']}}"
if not mark.exists():
    mark.touch()
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # aborts as gloo does, leaving no core file
    sys.stderr.write({_GLOO_ABORT + "IoException'"!r} + "\\n  what():  pair.cc:784] connect: Connection refused\\n")
    sys.stderr.flush()
    os.abort()
"""


def test_a_job_lost_at_gloo_s_rendezvous_starts_again_when_asked(tmp_path):
    script = tmp_path / "rank.py"
    script.write_text(FLAKY_RANK)
    job = launch_ranks(2, [str(script), str(tmp_path)], tmp_path / "job", timeout_s=60, retry_rendezvous=True)
    assert job.ok, job.report()
    assert (tmp_path / "job" / "retry").is_dir()


def test_it_is_not_started_again_unless_asked(tmp_path):
    script = tmp_path / "rank.py"
    script.write_text(FLAKY_RANK)
    job = launch_ranks(2, [str(script), str(tmp_path)], tmp_path / "job", timeout_s=60)
    assert not job.ok and lost_at_rendezvous(job)
    assert not (tmp_path / "job" / "retry").exists()


def test_only_a_death_in_gloo_counts():
    aborted = ProcessResult("rank 0", -6, "", _GLOO_ABORT + "TimeoutException'\n  what(): pair.cc:584] TIMEOUT", 6.4)
    fine = ProcessResult("rank 1", 0, "", "", 6.4)
    assert lost_at_rendezvous(JobResult([aborted, fine], False, 6.4))
    raised = ProcessResult("rank 1", 1, "", "Traceback (most recent call last):\n  ...\nPlanError: ...", 6.4)
    assert not lost_at_rendezvous(JobResult([aborted, raised], False, 6.4))  # an error of ours: never retried
    assert not lost_at_rendezvous(JobResult([aborted, fine], True, 180.0))  # a hang is not a start-up death
    late = ProcessResult("rank 0", -6, "", aborted.stderr, 95.0)
    assert not lost_at_rendezvous(JobResult([late, fine], False, 95.0))  # past the start: a real failure
