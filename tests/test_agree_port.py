"""The agreement needs no port of its own (issue #32 item 6): rank 0 listens on a port the system
picks free and tells the other ranks where (its key file on one machine, the job's store across
machines), so a port someone else holds -- the master's port + 1 it once took by default -- never
stops a job; ``AUTODIST_AGREE_PORT``, when a firewall wants one, is checked before anything is made.

The jobs are real: two processes each, the job's ``PADDLE_*`` environment, the agreement exactly as
``apply_plan`` runs it (harness/agree_rank.py: without Paddle, so 20 jobs take seconds).
"""

from __future__ import annotations

import json
import tempfile

import pytest

import autodist.applier.ranks.jobkey as jobkey
from autodist.applier.ranks.agree import Record, agree
from autodist.schemas import PlanError
from harness.agree_rank import hold_silently, launch_agreement
from harness.launcher import free_ports

pytestmark = pytest.mark.multiprocess

PLAN = "a" * 64
LAUNCHES = 20


def test_back_to_back_jobs_agree_while_the_master_port_plus_one_is_taken(tmp_path):
    """20 two-rank jobs one after another, each with its master's port + 1 held by a silent
    listener: every rank of every job agrees. With the old default (that port) each job failed
    at once: "rank 0 cannot listen on port ... (Address already in use)"."""
    for launch in range(LAUNCHES):
        agreed, _, report = launch_agreement(tmp_path / str(launch))
        assert agreed, f"launch {launch}: {report}"


@pytest.mark.parametrize("port", ["70000", "0", "http"])
def test_an_agreement_port_that_is_no_port_is_one_line_and_leaves_no_key_file(monkeypatch, tmp_path, port):
    """AUTODIST_AGREE_PORT=70000 once raised a raw OverflowError from bind() and left rank 0's key
    file behind; now it is one PlanError naming the variable, and nothing is written. The key
    folder is this test's own: in the shared one, another worker's job whose master had the same
    port left its key file there (seen with 4 xdist workers)."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    (master,) = free_ports(1)
    monkeypatch.setenv("PADDLE_TRAINER_ENDPOINTS", f"127.0.0.1:{master},127.0.0.1:{master + 2}")
    monkeypatch.delenv("PADDLE_MASTER", raising=False)
    monkeypatch.delenv("AUTODIST_AGREE_SECRET", raising=False)
    monkeypatch.setenv("AUTODIST_AGREE_PORT", port)
    with pytest.raises(PlanError, match=rf"AUTODIST_AGREE_PORT='{port}': expected a port, 1 to 65535"):
        agree(Record(0, "plan.json", PLAN, PLAN), rank=0, world=2, timeout_s=1)
    assert not jobkey.key_file(f"127.0.0.1:{master}").exists()


def _two_hosts(tmp_path, secrets: tuple[str, str], awaited: tuple[int, ...] = (0, 1)):
    """A 2-rank job whose endpoints name two hosts (127.0.0.1 and 127.0.0.2: both this machine's
    loopback), so the ranks share no key file and rank 0 posts its port in the job's store; rank r
    has ``AUTODIST_AGREE_SECRET=secrets[r]``. Waits for the ``awaited`` ranks, then stops the
    others. Returns each rank's result line (a stopped rank's output lines, if any)."""
    import subprocess
    import sys

    from harness.launcher import base_env, rank_env

    master, other = free_ports(2)
    endpoints = [f"127.0.0.1:{master}", f"127.0.0.2:{other}"]
    holder = hold_silently(master + 1)
    procs = []
    try:
        for rank in range(2):
            env = base_env(
                rank_env(rank, endpoints, {"AUTODIST_AGREE_TIMEOUT": "40", "AUTODIST_AGREE_SECRET": secrets[rank]})
            )
            env.pop("AUTODIST_AGREE_PORT", None)
            out = open(tmp_path / f"rank{rank}.out", "w")
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", "harness.agree_rank", PLAN],
                    env=env,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )
        for rank in awaited:
            procs[rank].wait(timeout=120)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        if holder is not None:
            holder.close()
    lines = [(tmp_path / f"rank{rank}.out").read_text().strip().splitlines() for rank in range(2)]
    return [
        json.loads(rank_lines[-1]) if rank_lines and rank_lines[-1].startswith("{") else rank_lines
        for rank_lines in lines
    ]


def test_across_machines_rank_0_posts_its_port_in_the_jobs_store(tmp_path):
    results = _two_hosts(tmp_path, ("a1b2c3d4e5f60798" * 2, "a1b2c3d4e5f60798" * 2))
    assert [(r["rank"], r["error"]) for r in results] == [(0, None), (1, None)], results


def test_across_machines_another_secret_is_named_at_the_posted_port(tmp_path):
    """Rank 1 signs with another secret: it cannot check rank 0's posted port and says so at once
    (not at the 40 s timeout). Rank 0, which would wait that timeout out for rank 1, is stopped."""
    results = _two_hosts(tmp_path, ("a1b2c3d4e5f60798" * 2, "f0e1d2c3b4a59687" * 2), awaited=(1,))
    rank1 = results[1]
    assert rank1["error"] == "PlanError" and "AUTODIST_AGREE_SECRET set alike on every node" in rank1["message"]
    assert rank1["seconds"] < 30
