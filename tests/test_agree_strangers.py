"""A stranger against a real 2-rank job: no process outside the job can sway the agreement.

Each test starts two ranks, each its own process with the job's environment running the
agreement exactly as ``apply_plan`` does (harness/agree_rank.py: the agreement without Paddle,
so a job takes a fraction of a second), and this test process plays a stranger on the same
machine that knows everything a plan file and ``ss -tln`` tell: the ports, the protocol, rank 0's
plan digest. It does not have the job's key (applier/ranks/jobkey.py: here, the default, a key rank 0
writes where only this user can read it; the stranger simply does not read it).

Every rank runs under a hard timeout and is killed at the end of its test, whatever happened.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from contextlib import ExitStack, contextmanager

import pytest

from autodist.applier.ranks.agree import MAX_MESSAGE_BYTES
from autodist.applier.ranks.signed import MAX_PENDING
from harness.launcher import TESTS_DIR, base_env, free_ports

pytestmark = pytest.mark.multiprocess

PLAN_A, PLAN_B = "a" * 64, "b" * 64
#: Two secrets strong enough for jobkey.MIN_SECRET_BITS.
ONE, TWO = "9b1d4f7a2c8e0536" * 2, "4c2e6a8f0d1b3957" * 2
#: The agreement timeout of these jobs: short, so a test that fails fails in seconds, but long
#: enough for two ranks started one after the other to meet on a loaded machine (at 3 s, with
#: two pytest workers and other jobs on the 2 cores, rank 1 once found rank 0 gone).
TIMEOUT_S = 8.0
#: Hard limit on a rank process: the timeout, the verdict grace (agree.VERDICT_GRACE_S) and slack.
RANK_LIMIT_S = 30.0


class Job:
    """Two agreement ranks on loopback; the stranger learns their ports from here."""

    def __init__(self, stack: ExitStack):
        master, other, self.port = free_ports(3)
        self.env = {
            "PADDLE_TRAINERS_NUM": "2",
            "PADDLE_TRAINER_ENDPOINTS": f"127.0.0.1:{master},127.0.0.1:{other}",
            "AUTODIST_AGREE_PORT": str(self.port),
            "AUTODIST_AGREE_TIMEOUT": str(TIMEOUT_S),
        }
        self.stack = stack
        self.procs: dict[int, subprocess.Popen] = {}

    def start(self, rank: int, plan: str, after: str | None = None, **env: str) -> None:
        """Start ``rank`` with ``plan``; ``after``: what it does after the agreement (agree_rank.py)."""
        environment = base_env({**self.env, "PADDLE_TRAINER_ID": str(rank)})
        environment.pop("AUTODIST_AGREE_SECRET", None)  # the default: the key file
        environment.update(env)
        command = [sys.executable, "-m", "harness.agree_rank", plan, *([after] if after else [])]
        proc = subprocess.Popen(
            command, cwd=TESTS_DIR, env=environment, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        self.stack.callback(_kill, proc)
        self.procs[rank] = proc

    def result(self, rank: int, returncode: int = 0) -> dict:
        """What the rank raised, once it ended (killed and failed if it outlives RANK_LIMIT_S)."""
        proc = self.procs[rank]
        try:
            out, err = proc.communicate(timeout=RANK_LIMIT_S)
        except subprocess.TimeoutExpired:
            _kill(proc)
            pytest.fail(f"rank {rank} still running after {RANK_LIMIT_S} s")
        assert proc.returncode == returncode, f"rank {rank} exited with {proc.returncode}:\n{err[-3000:]}"
        return json.loads(out.strip().splitlines()[-1]) if returncode == 0 else {}


def _kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.communicate()


@pytest.fixture
def job():
    with ExitStack() as stack:
        yield Job(stack)


@contextmanager
def stranger(target, *args):
    """Run ``target(stop, *args)`` in a thread of this process; stop and join it at the end."""
    stop = threading.Event()
    thread = threading.Thread(target=target, args=(stop, *args), daemon=True)
    thread.start()
    try:
        yield stop
    finally:
        stop.set()
        thread.join(timeout=20)
        assert not thread.is_alive(), "the stranger did not stop"


def listen_on(stop: threading.Event, port: int, answer) -> None:
    """Hold ``port`` as a stranger: ``answer(connection, stop)`` each connection, then close it."""
    with socket.create_server(("127.0.0.1", port)) as listener:
        listener.settimeout(0.1)
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            with conn:
                answer(conn, stop)


def connect(port: int, stop: threading.Event) -> socket.socket | None:
    """A connection to ``port`` once something listens there (None when told to stop)."""
    while not stop.is_set():
        try:
            return socket.create_connection(("127.0.0.1", port), timeout=1)
        except OSError:
            time.sleep(0.005)
    return None


def greeting_of(conn: socket.socket) -> bytes:
    """What the listener on ``conn`` greets a connection with that challenges it as a rank does."""
    from autodist.applier.ranks.agree import PROTOCOL
    from autodist.applier.ranks.signed import greeting_bytes, send_challenge

    send_challenge(conn, PROTOCOL)
    return conn.recv(greeting_bytes(PROTOCOL), socket.MSG_WAITALL)


def forged_record(rank: int, plan: str) -> bytes:
    """A record as a rank sends it, but made up by the stranger: rank 0's plan, from its plan file."""
    record = {"rank": rank, "plan_source": "plan.json", "plan_digest": plan, "model_digest": "c" * 64, "problems": []}
    return json.dumps({"call": 0, "record": record}).encode() + b"\n"


def read_line(conn: socket.socket) -> bytes:
    try:
        with conn.makefile("rb") as stream:
            return stream.readline(1 << 16)
    except OSError:
        return b""


def assert_both_refuse_the_plans(job: Job) -> None:
    for rank in (0, 1):
        result = job.result(rank)
        assert result["error"] == "PlanError", f"rank {rank} went on with its plan: {result}"
        assert "different plan" in result["message"], result


def test_a_forged_record_is_not_taken_for_a_rank(job):
    """The stranger claims rank 1 with rank 0's plan before the real rank 1 (another plan)
    arrives. Today rank 0 takes it and goes on; it must hear the real rank 1 and refuse."""
    sent = threading.Event()

    def claim_rank_1(stop):
        conn = connect(job.port, stop)
        if conn is None:
            return
        with conn:
            greeting_of(conn)  # whatever rank 0 greets with
            conn.sendall(forged_record(1, PLAN_A))
            sent.set()
            read_line(conn)

    job.start(0, PLAN_A)
    with stranger(claim_rank_1):
        assert sent.wait(RANK_LIMIT_S), "rank 0 never listened"
        time.sleep(0.3)
        job.start(1, PLAN_B)
        assert_both_refuse_the_plans(job)


def test_the_port_taken_over_after_rank_0_left_cannot_tell_rank_1_all_is_well(job):
    """The whole attack: claim rank 1 at rank 0 with its plan, acknowledge the verdict, then bind
    the port rank 0 just closed and tell the real rank 1 (another plan) "no problems" with rank
    0's own greeting. Today both ranks go on with different plans."""

    def take_over(stop):
        conn = connect(job.port, stop)
        if conn is None:
            return
        with conn:
            greeting = greeting_of(conn)
            conn.sendall(forged_record(1, PLAN_A))
            verdict = read_line(conn)
            if not verdict:  # rank 0 hung up on it: nothing to take over
                return
            conn.sendall(b"ack\n")
        with socket.socket() as squat:
            squat.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            while not stop.is_set():
                try:
                    squat.bind(("127.0.0.1", job.port))
                    break
                except OSError:
                    time.sleep(0.005)
            squat.listen()
            squat.settimeout(TIMEOUT_S + 2)
            try:
                victim, _ = squat.accept()
            except OSError:
                return
            with victim:
                victim.recv(4096)  # its challenge
                victim.sendall(greeting)
                read_line(victim)
                victim.sendall(json.dumps({"verdict": []}).encode() + b"\n")
                read_line(victim)

    job.start(0, PLAN_A)
    with stranger(take_over):
        time.sleep(0.5)
        job.start(1, PLAN_B)
        assert_both_refuse_the_plans(job)


def test_a_relay_that_rewrites_rank_1s_record_is_caught(job):
    """Rank 1 reaches rank 0 through the stranger (a relay on another port), which passes
    everything on but rewrites rank 1's plan digest into rank 0's. Today both ranks go on with
    different plans; now no rank goes on."""
    (relay_port,) = free_ports(1)
    relay = socket.create_server(("127.0.0.1", relay_port))

    def rewrite(stop):
        with relay:
            relay.settimeout(0.2)
            while not stop.is_set():
                try:
                    client, _ = relay.accept()
                except TimeoutError:
                    continue
                upstream = connect(job.port, stop)
                if upstream is None:
                    client.close()
                    return
                _pipe(client, upstream, lambda data: data.replace(PLAN_B.encode(), PLAN_A.encode()))
                _pipe(upstream, client, lambda data: data)

    job.start(0, PLAN_A)
    with stranger(rewrite):
        job.start(1, PLAN_B, AUTODIST_AGREE_PORT=str(relay_port))
        for rank in (0, 1):
            result = job.result(rank)
            assert result["error"] == "PlanError", f"rank {rank} went on with its plan: {result}"


def _pipe(source: socket.socket, sink: socket.socket, change) -> None:
    def run():
        try:
            while data := source.recv(65536):
                sink.sendall(change(data))
        except OSError:
            pass
        for end in (source, sink):
            try:
                end.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    threading.Thread(target=run, daemon=True).start()


def flood(stop, port: int, count: int, payload: bytes, held: list, ready: threading.Event) -> None:
    """Open up to ``count`` connections to ``port`` (once it listens; for at most FLOOD_S), send
    each ``payload``, set ``ready``, and hold them open until told to stop."""
    first = connect(port, stop)
    if first is None:
        return
    held.append(first)
    end = time.monotonic() + FLOOD_S
    while len(held) < count and time.monotonic() < end and not stop.is_set():
        try:
            conn = socket.create_connection(("127.0.0.1", port), timeout=0.2)
        except OSError:
            continue
        held.append(conn)
        try:
            conn.settimeout(0.5)
            conn.sendall(payload)
        except OSError:
            pass
    ready.set()
    stop.wait()
    for conn in held:
        conn.close()


#: How long a flood may take to open its connections before the real rank 1 starts.
FLOOD_S = 4.0


def test_many_connections_cost_rank_0_bounded_memory_and_keep_no_rank_out(job):
    """300 connections each sending 1 MB with no end of line, before rank 1 arrives: today rank
    0 buffers all it can read (about 1 MB each: 70 MB more than rank 1 here); now it keeps at most agree.MAX_PENDING for
    PENDING_WAIT_S each, and the real rank 1 still gets in."""
    held: list[socket.socket] = []
    ready = threading.Event()
    job.start(0, PLAN_A, AUTODIST_AGREE_TIMEOUT="15")
    with stranger(flood, job.port, 300, b"x" * ((1 << 20) - 1), held, ready):
        assert ready.wait(RANK_LIMIT_S), "rank 0 never listened"
        job.start(1, PLAN_A)
        results = [job.result(0), job.result(1)]
    assert len(held) > 50, "the flood never got going"
    for result in results:
        assert result["error"] is None, result
    # Rank 1 runs the same program without strangers; rank 0 may hold MAX_PENDING buffers more.
    bound = results[1]["maxrss_mb"] + 2 * MAX_PENDING * MAX_MESSAGE_BYTES / 2**20
    assert results[0]["maxrss_mb"] < bound, f"rank 0 buffered the strangers' bytes: {results}"


def test_running_out_of_descriptors_does_not_shut_the_real_rank_out(job):
    """Rank 0 has only 8 descriptors to spare; 200 silent connections exhaust them before rank 1
    arrives. Today accept() then fails for ever (spinning) and rank 1 never gets in; now rank 0
    drops the oldest stranger for each connection it must accept, and the ranks agree."""
    held: list[socket.socket] = []
    ready = threading.Event()
    job.start(0, PLAN_A, AGREE_RANK_NOFILE="8", AUTODIST_AGREE_TIMEOUT="15")
    with stranger(flood, job.port, 200, b"", held, ready):
        assert ready.wait(RANK_LIMIT_S), "rank 0 never listened"
        job.start(1, PLAN_A)
        results = [job.result(0), job.result(1)]
    for result in results:
        assert result["error"] is None, result


def test_a_greeting_sent_one_byte_at_a_time_does_not_stretch_the_timeout(job):
    """A stranger holds the agreement port (rank 0 absent) and greets one byte every 0.9 s:
    today each byte restarts rank 1's wait (a 3 s timeout waited about 20 s); now rank 1 gives
    up on it after one deadline and raises."""

    def trickle(conn, stop):
        for byte in b"autodist agreement\n" + b" " * 200:
            if stop.wait(0.9):
                return
            try:
                conn.sendall(bytes([byte]))
            except OSError:
                return

    with stranger(listen_on, job.port, trickle):
        time.sleep(0.2)
        job.start(1, PLAN_A)
        result = job.result(1)
    assert result["error"] == "PlanError" and "rank 0 did not reach the agreement step" in result["message"], result
    assert result["seconds"] < TIMEOUT_S + 3, result


def test_a_rank_failing_after_the_agreement_stops_every_rank(job):
    """No launcher: rank 1 raises while applying the plan, after the ranks agreed. Rank 0 must
    raise too, naming it, within the timeout (today it goes on into the first collective)."""
    job.start(0, PLAN_A)
    job.start(1, PLAN_A, after="fail")
    zero, one = job.result(0), job.result(1)
    assert one["error"] == "RuntimeError", one
    assert zero["error"] == "PlanError", zero
    assert "rank 1 failed while applying the plan: RuntimeError: TEST-ONLY" in zero["message"], zero
    assert zero["after_agreement_s"] < TIMEOUT_S, zero


def test_rank_0_failing_after_the_agreement_stops_every_rank(job):
    job.start(0, PLAN_A, after="fail")
    job.start(1, PLAN_A)
    zero, one = job.result(0), job.result(1)
    assert zero["error"] == "RuntimeError", zero
    assert one["error"] == "PlanError" and "rank 0 failed while applying the plan" in one["message"], one


def test_the_job_key_file_is_private_and_removed(job, tmp_path):
    """The default key lives in a folder only this user can open, and is gone after the job."""
    job.start(0, PLAN_A, TMPDIR=str(tmp_path))
    job.start(1, PLAN_A, TMPDIR=str(tmp_path))
    assert job.result(0)["error"] is None and job.result(1)["error"] is None
    (folder,) = tmp_path.iterdir()
    assert folder.name == f"autodist-{os.getuid()}" and folder.stat().st_mode & 0o777 == 0o700
    assert list(folder.iterdir()) == []


@pytest.mark.parametrize(
    "secrets, said",
    [
        ((ONE, None), "AUTODIST_AGREE_SECRET is set on {0} and unset on {1}"),
        ((None, ONE), "AUTODIST_AGREE_SECRET is set on {1} and unset on {0}"),
        ((ONE, TWO), "its AUTODIST_AGREE_SECRET differs from this rank's"),
    ],
    ids=["rank-0-only", "rank-1-only", "different"],
)
def test_a_secret_set_unlike_is_named_on_both_ranks_within_seconds(job, secrets, said):
    """AUTODIST_AGREE_SECRET set on one rank only (or unlike on both), under the default timeout
    (300 s): rank 1 sees it in rank 0's greeting and tells rank 0, signed under rank 0's key file
    (only this user can read it); both raise at once, each naming the variable and the other rank.
    They once waited the whole timeout, rank 0 then blaming rank 1 for not arriving."""
    for rank, secret in enumerate(secrets):
        job.start(rank, PLAN_A, AUTODIST_AGREE_TIMEOUT="", **({"AUTODIST_AGREE_SECRET": secret} if secret else {}))
    for rank, other in ((0, 1), (1, 0)):
        result = job.result(rank, returncode=0)
        assert result["error"] == "PlanError", result
        assert f"rank {other}'s messages are not signed with this rank's key" in result["message"], result
        assert (
            said.format(*(("this rank", f"rank {other}") if rank == 0 else (f"rank {other}", "this rank")))
            in (result["message"])
        ), result
        assert result["seconds"] < RANK_LIMIT_S, result


def test_a_rank_that_cannot_read_rank_0s_key_file_names_another_secret_at_its_greeting(job, tmp_path):
    """As across machines (here: another TMPDIR), rank 1 cannot read rank 0's key file: rank 0's
    greeting at the endpoint the launch names for it, under another key, is all it has. It raises
    at once, naming the variable; rank 0, told nothing it could trust, names rank 1 at its deadline."""
    job.start(0, PLAN_A, AUTODIST_AGREE_SECRET=ONE)
    job.start(1, PLAN_A, AUTODIST_AGREE_SECRET=TWO, TMPDIR=str(tmp_path))
    one = job.result(1)
    assert one["error"] == "PlanError" and one["seconds"] < TIMEOUT_S / 2, one
    assert (
        "rank 0's messages are not signed with this rank's key: is AUTODIST_AGREE_SECRET set alike on every node"
        in one["message"]
    ), one
    assert "ranks 1 of 2 did not reach the agreement step" in job.result(0)["message"]


def test_ranks_with_the_same_secret_meet(job):
    job.start(0, PLAN_A, AUTODIST_AGREE_SECRET=ONE)
    job.start(1, PLAN_B, AUTODIST_AGREE_SECRET=ONE)
    assert_both_refuse_the_plans(job)


def test_a_stranger_greeting_under_another_key_is_not_taken_for_rank_0(job):
    """Without secrets, something on the agreement port greets in the protocol's form but not
    under rank 0's key file's key: rank 1 does not take it for rank 0 with another secret (it
    proves nothing) and names a stranger at the deadline."""
    from autodist.applier.ranks.agree import PROTOCOL
    from autodist.applier.ranks.signed import greeting

    def impostor(conn, stop):
        challenge = bytes.fromhex(read_line(conn).split()[-1].decode())  # it answers the rank's challenge
        conn.sendall(greeting(b"k" * 32, PROTOCOL, b"n" * 16, challenge))
        stop.wait(0.2)

    job.start(0, PLAN_A, AUTODIST_AGREE_TIMEOUT="3", AUTODIST_AGREE_PORT=str(free_ports(1)[0]))
    with stranger(listen_on, job.port, impostor):
        job.start(1, PLAN_A, AUTODIST_AGREE_TIMEOUT="3")
        one = job.result(1)
    assert one["error"] == "PlanError" and "something other than this job's rank 0 listens" in one["message"], one
    assert job.result(0)["error"] == "PlanError"


@pytest.mark.parametrize("victim", [0, 1])
def test_a_rank_dying_after_the_agreement_stops_the_other(job, victim):
    """No launcher: a rank SIGKILLed while applying the plan closes its connection; the other
    raises at once, naming it, instead of waiting in the first collective."""
    job.start(0, PLAN_A, after="die" if victim == 0 else None)
    job.start(1, PLAN_A, after="die" if victim == 1 else None)
    job.result(victim, returncode=-9)
    survivor = job.result(1 - victim)
    expected = "lost the connection to rank 0" if victim == 0 else "rank 1 lost its connection to rank 0 while applying"
    assert survivor["error"] == "PlanError" and expected in survivor["message"], survivor
    assert survivor["after_agreement_s"] < TIMEOUT_S, survivor


def test_a_rank_frozen_after_the_agreement_is_named_at_the_timeout(job):
    """Rank 1 stops while applying the plan for twice the timeout: rank 0 names it at the
    timeout, and rank 1, when it wakes, finds the same verdict waiting."""
    job.start(0, PLAN_A)
    job.start(1, PLAN_A, after="freeze")
    zero, one = job.result(0), job.result(1)
    assert zero["error"] == "PlanError", zero
    assert f"rank 1 did not finish applying the plan within {TIMEOUT_S:g} s" in zero["message"], zero
    assert one["error"] == "PlanError" and one["message"] == zero["message"], one


def test_a_greeting_recorded_in_an_earlier_job_is_refused_at_once(job):
    """An earlier job under the same secret: the stranger connects to its rank 0 as a rank does and
    records the greeting it answers with (the job then runs as usual). In this job the stranger
    holds the agreement port and replays those bytes to rank 1, same secret: rank 1 refuses them
    at once, in one line, having sent nothing but its fresh challenge -- the greeting answers the
    earlier connection's challenge. It once took them for rank 0's, sent its record and waited for
    a verdict until T + 10 s (2T + 10 s before that), while saying "within T"."""
    from autodist.applier.ranks.agree import PROTOCOL
    from autodist.applier.ranks.jobkey import _from_secret
    from autodist.applier.ranks.signed import Heard, signed_greeting

    with ExitStack() as stack:
        earlier = Job(stack)
        earlier.start(0, PLAN_A, AUTODIST_AGREE_SECRET=ONE)
        give_up = threading.Event()
        timer = threading.Timer(RANK_LIMIT_S, give_up.set)
        timer.start()
        stack.callback(timer.cancel)
        conn = connect(earlier.port, give_up)
        assert conn is not None, "the earlier job's rank 0 never listened"
        with conn:
            old = greeting_of(conn)
        earlier.start(1, PLAN_A, AUTODIST_AGREE_SECRET=ONE)
        assert earlier.result(0)["error"] is None and earlier.result(1)["error"] is None
    _, nonce, challenge, _ = old.rsplit(maxsplit=3)
    heard = Heard(bytes.fromhex(nonce.decode()), bytes.fromhex(challenge.decode()), old)
    assert signed_greeting(heard, _from_secret(ONE), PROTOCOL), "not a greeting of rank 0 under the secret"

    sent: list[bytes] = []

    def replay(conn, stop):
        conn.sendall(old)
        conn.settimeout(RANK_LIMIT_S)
        while chunk := conn.recv(4096):
            sent.append(chunk)

    with stranger(listen_on, job.port, replay):
        job.start(1, PLAN_A, AUTODIST_AGREE_SECRET=ONE, AUTODIST_AGREE_TIMEOUT="60")
        one = job.result(1)
    assert one["error"] == "PlanError", one
    assert "answers another connection's challenge" in one["message"] and "\n" not in one["message"], one
    assert one["seconds"] < 5, one
    assert sent and all(chunk.startswith(PROTOCOL + b" ") and b"record" not in chunk for chunk in sent), sent


@pytest.mark.parametrize("squatter", ["open to others", "another user's"])
def test_a_key_folder_someone_else_made_first_is_skipped_with_a_warning(job, tmp_path, squatter):
    """``$TMPDIR/autodist-<uid>`` exists but is not private (another local user made it first, or
    it is open to others): both ranks skip it alike, warning, and meet through
    ``~/.cache/autodist/keys``. It once stopped every job without a secret."""
    if squatter == "another user's" and os.getuid() != 0:
        pytest.skip("making a folder another user's needs root")
    squatted = tmp_path / f"autodist-{os.getuid()}"
    squatted.mkdir(mode=0o755)
    squatted.chmod(0o755)
    if squatter == "another user's":
        os.chown(squatted, 65534, 65534)
        squatted.chmod(0o700)
    home = tmp_path / "home"
    env = {"TMPDIR": str(tmp_path), "HOME": str(home), "PYTHONWARNINGS": "default"}
    job.start(0, PLAN_A, **env)
    job.start(1, PLAN_A, **env)
    stderr = []
    for rank in (0, 1):
        out, err = job.procs[rank].communicate(timeout=RANK_LIMIT_S)
        assert json.loads(out.strip().splitlines()[-1])["error"] is None, (out, err)
        stderr.append(err)
    assert f"skipped {squatted} ({squatter})" in stderr[0], stderr[0]
    assert (home / ".cache" / "autodist" / "keys").stat().st_mode & 0o777 == 0o700
