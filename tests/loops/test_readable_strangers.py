"""A stranger against a real dp2 job's readable side channel (applier/ranks/readable/): it cannot
read a value, a flood of its connections grows no threads or memory in the rank, malformed
requests do not break later reads, and the job ends on time.

The job (scripts/probed_by_stranger.py) makes two losses, says where each rank's side channel
listens (what ``ss -tlnp`` tells anyone on the machine) and waits; this test plays the stranger
against rank 1, which knows the port and the protocol but not the job's key, then lets rank 0
read both losses from rank 1. And when rank 1 dies, rank 0's read is a ReadError and its wait
for the others at exit ends at the read timeout. On the old code the stranger's plain request was answered with the
value and each of its connections got a thread that buffered whatever it sent."""

from __future__ import annotations

import functools
import json
import socket
import threading
import time
from pathlib import Path

import pytest
from loop_runs import SCRIPTS

from harness.launcher import launch_ranks

pytestmark = pytest.mark.multiprocess

#: The job's read timeout: short, so a stalled read fails the test in seconds.
READ_TIMEOUT_S = 10
FLOOD = 300
FLOOD_BYTES = 256 * 1024


def _wait_for(path: Path, job: threading.Thread) -> dict:
    deadline = time.monotonic() + 240
    while not path.exists():
        assert job.is_alive() and time.monotonic() < deadline, f"the job never wrote {path.name}"
        time.sleep(0.05)
    time.sleep(0.05)
    return json.loads(path.read_text())


def _threads_and_rss(pid: int) -> tuple[int, int]:
    status = Path(f"/proc/{pid}/status").read_text()
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    return int(fields["Threads"]), int(fields["VmRSS"].split()[0]) * 1024


def _running(pid: int) -> bool:
    """Whether ``pid`` still runs (a zombie, exited but not yet reaped, does not)."""
    try:
        return "\nState:\tZ" not in Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False


def _plain_request(address) -> bytes:
    """What the stranger gets for a plain request for the first loss: all until hung up on."""
    received = b""
    with socket.create_connection(address, timeout=5) as conn:
        conn.sendall(b'{"key": ["value", 1, 0]}\n')
        try:
            while chunk := conn.recv(65536):
                received += chunk
        except OSError:
            pass
    return received


def _flood(address) -> list[socket.socket]:
    """FLOOD connections, each sending up to FLOOD_BYTES with no newline, left open."""
    conns = []
    for _ in range(FLOOD):
        conn = socket.create_connection(address, timeout=5)
        conn.settimeout(0.2)
        try:
            conn.sendall(b"x" * FLOOD_BYTES)
        except OSError:  # hung up on once past the cap, or the buffers are full
            pass
        conns.append(conn)
    return conns


def _malformed(address) -> None:
    for line in (b"garbage\n", b"\xff" * 70_000 + b"\n", b'{"key": ["value", 1e999, "x"]}\n'):
        with socket.create_connection(address, timeout=5) as conn:
            try:
                conn.sendall(line)
                conn.recv(65536)
            except OSError:
                pass


def test_a_stranger_cannot_read_flood_or_break_a_real_job(loop_plans, tmp_path):
    ranks, plan = loop_plans("gpt", "dp2")
    argv = [str(SCRIPTS / "probed_by_stranger.py"), "--out", str(tmp_path), "--plan", str(plan)]
    result: dict = {}
    extra_env = {"AUTODIST_READ_TIMEOUT": str(READ_TIMEOUT_S)}
    job = threading.Thread(
        target=lambda: result.update(job=launch_ranks(ranks, argv, tmp_path / "ranks", 240, extra_env)), daemon=True
    )
    job.start()
    conns: list[socket.socket] = []
    try:
        rank1 = _wait_for(tmp_path / "ready1.json", job)
        _wait_for(tmp_path / "ready0.json", job)
        address = (rank1["host"], rank1["port"])
        assert rank1["host"] == "127.0.0.1", "the side channel listens beyond the rank's own address"

        got = _plain_request(address)
        assert b"hex" not in got, f"a stranger read rank 1's loss: {got[:200]!r}"

        threads, rss = _threads_and_rss(rank1["pid"])
        conns = _flood(address)
        time.sleep(0.5)
        threads_after, rss_after = _threads_and_rss(rank1["pid"])
        assert threads_after - threads <= 4, f"{threads_after - threads} threads more for {FLOOD} connections"
        assert rss_after - rss < 40 << 20, f"RSS grew {(rss_after - rss) >> 20} MB for {FLOOD} connections"

        _malformed(address)
    finally:
        (tmp_path / "go").touch()
        job.join(timeout=260)
        for conn in conns:
            conn.close()
    assert not job.is_alive(), "the job did not end"
    result["job"].raise_for_failure()

    rank0 = json.loads((tmp_path / "rank0.json").read_text())
    locals_ = [json.loads((tmp_path / f"rank{r}.json").read_text())["locals"] for r in range(ranks)]
    for step, read in enumerate(rank0["reads"]):
        assert read == pytest.approx((locals_[0][step] + locals_[1][step]) / 2, rel=1e-5), step
    assert rank0["seconds"] < READ_TIMEOUT_S / 2, "rank 0's reads waited (on rank 1 stalled by the stranger?)"


def test_a_dead_peer_is_a_read_error_and_no_hang_at_exit(loop_plans, tmp_path):
    """Rank 1 ends without its exit handlers (as a killed rank does): rank 0's read of the loss
    raises ReadError at once, and rank 0, done, waits for rank 1 at exit no longer than the
    read timeout (rank 1 never counts itself as exiting)."""
    ranks, plan = loop_plans("gpt", "dp2")
    argv = [str(SCRIPTS / "probed_by_stranger.py"), "--out", str(tmp_path), "--plan", str(plan), "--rank-1-dies"]
    (tmp_path / "go").touch()
    timeout_s = 4
    job = launch_ranks(ranks, argv, tmp_path / "ranks", 240, {"AUTODIST_READ_TIMEOUT": str(timeout_s)})
    ended = time.time()
    job.raise_for_failure()
    rank0 = json.loads((tmp_path / "rank0.json").read_text())
    # Refused once rank 1 is gone; closed unanswered while its process is still going (seen in a whole run)
    assert "rank 1" in rank0["error"], rank0
    assert "did not answer" in rank0["error"] or "closed the connection" in rank0["error"], rank0
    assert rank0["seconds"] < timeout_s, "the read of a dead rank's value waited"
    assert ended - rank0["done"] < timeout_s + 5, f"rank 0 exited {ended - rank0['done']:.1f} s after its work"


def test_a_rank_leaving_through_sys_exit_with_an_error_does_not_wait_at_exit(loop_plans, tmp_path):
    """Rank 1 calls ``sys.exit(3)`` while rank 0 is still at work (waiting for "go"): rank 1's
    process is gone within seconds, not held at exit for its peers until the read timeout (60 s
    here). SystemExit reaches no excepthook, so it once waited as a rank that finished does."""
    ranks, plan = loop_plans("gpt", "dp2")
    argv = [str(SCRIPTS / "probed_by_stranger.py"), "--out", str(tmp_path), "--plan", str(plan), "--rank-1-exits"]
    result: dict = {}
    extra_env = {"AUTODIST_READ_TIMEOUT": "60"}
    # Rank 0, whose end nothing asserts, is stopped 3 s after rank 1 has gone (the harness's
    # default grace is 15 s): it is alive all the while rank 1's exit is timed.
    launch = functools.partial(launch_ranks, ranks, argv, tmp_path / "ranks", 240, extra_env, failure_grace_s=3.0)
    job = threading.Thread(target=lambda: result.update(job=launch()), daemon=True)
    job.start()
    try:
        pid = _wait_for(tmp_path / "ready1.json", job)["pid"]
        exiting = _wait_for(tmp_path / "exiting1.json", job)["at"]
        while _running(pid) and time.time() < exiting + 30:
            time.sleep(0.05)
        gone = time.time()
    finally:
        (tmp_path / "go").touch()
        job.join(timeout=260)
    assert not job.is_alive(), "the job did not end"
    assert gone - exiting < 2 + 2, f"rank 1 exited {gone - exiting:.1f} s after sys.exit(3)"
    assert result["job"].processes[1].returncode == 3, result["job"].report()


def test_a_stranger_cannot_overwrite_a_ranks_posted_address():
    """Rank 1 posts where its side channel listens in Paddle's store (a real one, in this
    process); a stranger on the store -- it takes requests from anyone -- writes its own address
    over it: rank 0 refuses that address instead of sending its requests there."""
    from paddle.base import core

    from autodist.applier.ranks.readable.notes import Notes
    from autodist.applier.ranks.readable.store import PREFIX, address, post_address
    from harness.launcher import free_ports

    (port,) = free_ports(1)
    store = core.TCPStore("127.0.0.1", port, True, 1, 30)
    rank1, rank0 = Notes(1, 2, b"k" * 32, 5.0), Notes(0, 2, b"k" * 32, 5.0)
    rank1.store = rank0.store = store
    post_address(rank1, "127.0.0.1", 4242)
    assert address(rank0, 1, time.monotonic() + 5) == ("127.0.0.1", 4242)
    rank0.addresses.clear()
    store.set(f"{PREFIX}1", b"127.0.0.1:9")  # the stranger's
    said = address(rank0, 1, time.monotonic() + 5)
    assert said == "rank 1's posted address is not signed with the job's key (another process?)", said
