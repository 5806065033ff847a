"""Rank 0 hosts Paddle's TCP store and must survive its peers hanging up at the end of a job
(applier/ranks/store_host.py): the store's thread logs each hang-up, and glog sets up a log line's
call site under a lock that rank 0's C++ teardown destroys. ``apply_plan`` makes those call
sites run once, on rank 0, while the job is alive.

The crash itself is a race at process exit (about one short job in twenty under load) and
cannot be forced in a test; what can fail here is whether the call sites ran before the end."""

from __future__ import annotations

import socket
import threading
import time

import pytest
from harness.launcher import free_ports, launch_ranks

from autodist.applier.ranks.store_host import wait_for_store_host, warm_up_store_host

#: Rank 0 marks the moment it is done; its peer hangs up on the store only later (it sleeps
#: longer). With GLOG_v=5 the store's thread logs every hang-up it reads, so rank 0's stderr
#: shows whether one was read before the mark. Both leave by ``os._exit``: at level 5 glog
#: would also log the peer's real hang-up during rank 0's teardown.
RANK = """
import os, sys, time
import paddle.distributed as dist
from harness.plans import tensor_parallel_plan
from harness.workloads import WORKLOADS
from autodist.applier import apply_plan
from autodist.schemas import PlanError
if sys.argv[2] == "script":  # the store made by the script, as the README asks; else by apply_plan
    dist.init_parallel_env()
model = WORKLOADS["docstring_llama"].build(seed=7)
try:
    apply_plan(model, None, None, tensor_parallel_plan(model, dp=int(sys.argv[1])))
except PlanError:  # a plan for another world size: refused on every rank, which then leave
    pass
import socket
from autodist.applier.ranks import store_host
seen, setsockopt = [], socket.socket.setsockopt
def spy(sock, level, option, value):  # what a post does to this rank's connections to the store
    if option == socket.TCP_NODELAY:
        seen.append(value)
    return setsockopt(sock, level, option, value)
socket.socket.setsockopt = spy
store_host.post(store_host.global_store(dist.get_rank()), f"probe/{dist.get_rank()}", b"x")
socket.socket.setsockopt = setsockopt
print("NODELAY", seen, file=sys.stderr, flush=True)
time.sleep(1.0 if dist.get_rank() == 0 else 4.0)
print("DONE", file=sys.stderr, flush=True)
os._exit(0)
"""

#: What the store's thread logs (paddle/phi/core/distributed/store/tcp_store_libuv.cc, 3.3.1):
#: a connection closed cleanly, and one reset.
HANG_UPS = ("Remote peer closed the connection", "ECONNRESET")


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("dp", "store"),
    [(2, "script"), (2, "apply_plan"), (4, "script")],
    ids=["applied", "applied-store-made-by-apply_plan", "refused"],
)
def test_apply_plan_runs_the_stores_hang_up_log_lines_on_rank_0_before_the_end(tmp_path, dp, store):
    """Also when the plan is refused (a dp4 plan on 2 ranks): every rank then leaves at once.
    And when the script made no store: Paddle makes it at the first collective, which apply_plan
    makes (applier/ranks/readable/), after its first warm-up found nothing to connect to. (A refused plan
    with no store made has no store to crash.)"""
    job = launch_ranks(2, ["-c", RANK, str(dp), store], workdir=tmp_path, timeout_s=120, extra_env={"GLOG_v": "5"})
    job.raise_for_failure()
    before_done = job.processes[0].stderr.partition("DONE")[0]
    assert "DONE" in job.processes[0].stderr
    for line in HANG_UPS:
        assert line in before_done, f"rank 0's store never logged {line!r} before the job's end"
    # A post's requests go out at once, not 40 ms apart, and Paddle's own are as before (store_host.py)
    for process in job.processes:
        assert "NODELAY [1, 0]" in process.stderr.splitlines(), process.stderr[-1000:]
    if store == "apply_plan":  # rank 1 waited for rank 0's store to listen: Paddle's client never backed off 3 s
        assert "not yet listening" not in job.processes[1].stderr, job.processes[1].stderr[-2000:]


def test_only_rank_0_connects_and_a_store_nobody_serves_is_left_alone(monkeypatch):
    (port,) = free_ports(1)  # nothing listens there
    monkeypatch.setenv("PADDLE_MASTER", f"127.0.0.1:{port}")
    assert warm_up_store_host(rank=1) is False
    assert warm_up_store_host(rank=0, timeout_s=1.0) is False  # refused: no error, no wait


def test_a_rank_waits_for_the_store_host_to_listen_not_longer(monkeypatch):
    """Ranks > 0 poll rank 0's store port until it listens (store_host.wait_for_store_host):
    Paddle's own client, refused once, sleeps 3 s before it tries again."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    monkeypatch.setenv("PADDLE_TRAINER_ENDPOINTS", f"127.0.0.1:{port},127.0.0.1:1")
    assert wait_for_store_host(timeout_s=0.3) is False  # bound, not listening: refused until the deadline
    threading.Timer(0.5, listener.listen).start()
    start = time.monotonic()
    try:
        assert wait_for_store_host(timeout_s=5.0) is True
        waited = time.monotonic() - start
    finally:
        listener.close()
    assert 0.4 < waited < 1.5, f"waited {waited:.2f} s for a store that listened after 0.5 s"
