"""The agreement step in one process: what every rank is told, and that waiting has a deadline.

The multi-process proofs (two ranks on other plans, another model, a killed rank) are in
test_disagreeing_ranks.py and test_bad_plan_ranks.py; here one process plays one rank of two
against a stand-in peer (a plain socket, as the protocol is), or against nothing at all.
"""

from __future__ import annotations

import itertools
import json
import re
import socket
import tempfile
import threading
import time
from dataclasses import asdict

import pytest

import autodist.applier.ranks.agree as agree_module
import autodist.applier.ranks.signed as signed
import autodist.applier.ranks.jobkey as jobkey
from autodist.applier.ranks.agree import Record, agree, timeout_from, verdict_problems
from autodist.schemas import PlanError
from harness.launcher import free_ports

PLAN_A, PLAN_B, MODEL_A, MODEL_B = "a" * 64, "b" * 64, "c" * 64, "d" * 64


def test_agreeing_ranks_have_nothing_to_report():
    records = [Record(r, "plan.json", PLAN_A, MODEL_A) for r in range(4)]
    assert verdict_problems(records, [], 4, 60) == []


def test_the_same_local_problems_everywhere_are_reported_as_they_are():
    records = [Record(r, "plan.json", PLAN_A, MODEL_A, ["world size: ..."]) for r in range(2)]
    assert verdict_problems(records, [], 2, 60) == ["world size: ..."]


def test_each_kind_of_disagreement_is_named_with_its_ranks():
    records = [
        Record(0, "plan.json", PLAN_A, MODEL_A),
        Record(1, "plan.json", PLAN_A, MODEL_A),
        Record(2, "old.json", PLAN_B, MODEL_B, ["model: this is not the model the plan was made for"]),
        Record(3, "gone.json", "", MODEL_A, ["cannot read the plan file: No such file or directory"]),
    ]
    problems = verdict_problems(records, [4], 5, 30)
    text = "\n".join(problems)
    assert problems[0].startswith("ranks 4 of 5 did not reach the agreement step within 30 s")
    assert "different plan: ranks 0, 1 has plan.json" in text and "rank 2 has old.json" in text
    assert "rank 3 could not read gone.json" in text
    assert "different model: ranks 0, 1, 3 a model with parameter table sha256 cccccccccccc..." in text
    assert "rank 2 failed validation: model: this is not the model" in text
    assert "rank 3 failed validation: cannot read the plan file" in text


def test_timeout_from_argument_environment_or_default(monkeypatch):
    monkeypatch.delenv("AUTODIST_AGREE_TIMEOUT", raising=False)
    assert timeout_from(None) == agree_module.DEFAULT_TIMEOUT_S
    assert timeout_from(5) == 5.0
    monkeypatch.setenv("AUTODIST_AGREE_TIMEOUT", "12.5")
    assert timeout_from(None) == 12.5
    for bad in ("soon", "0", "-3", "nan", "inf"):
        monkeypatch.setenv("AUTODIST_AGREE_TIMEOUT", bad)
        with pytest.raises(PlanError, match="AUTODIST_AGREE_TIMEOUT"):
            timeout_from(None)


@pytest.fixture
def two_rank_env(monkeypatch):
    """The environment of one rank of a hand-started 2-rank job, on free loopback ports, with a
    job secret this test's stand-in peers share."""
    p0, p1, agree_port = free_ports(3)
    monkeypatch.setenv("PADDLE_TRAINER_ENDPOINTS", f"127.0.0.1:{p0},127.0.0.1:{p1}")
    monkeypatch.delenv("PADDLE_MASTER", raising=False)
    monkeypatch.setenv("AUTODIST_AGREE_PORT", str(agree_port))
    monkeypatch.setenv("AUTODIST_AGREE_SECRET", SECRET)
    monkeypatch.setattr(agree_module, "_CALLS", itertools.count())  # a first call, as the stand-ins'
    return agree_port


SECRET = "5e3c8a9d0b7f14e2a6c1d9f3b8e0a4c7"  # strong enough (jobkey.MIN_SECRET_BITS)
KEY = jobkey._from_secret(SECRET)


def test_a_rank_alone_with_rank_0_absent_stops_at_the_deadline(two_rank_env):
    start = time.monotonic()
    with pytest.raises(PlanError, match=r"rank 0 did not reach the agreement step within 1 s"):
        agree(Record(1, "plan.json", PLAN_A, MODEL_A), rank=1, world=2, timeout_s=1)
    assert time.monotonic() - start < 10


def test_rank_0_alone_names_the_missing_rank_at_the_deadline(two_rank_env):
    start = time.monotonic()
    with pytest.raises(PlanError, match=r"ranks 1 of 2 did not reach the agreement step within 1 s"):
        agree(Record(0, "plan.json", PLAN_A, MODEL_A), rank=0, world=2, timeout_s=1)
    assert time.monotonic() - start < 10


def test_a_taken_agreement_port_is_a_plan_error_naming_it(two_rank_env):
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", two_rank_env))
        holder.listen()
        with pytest.raises(PlanError, match=rf"rank 0 cannot listen on port {two_rank_env} .*AUTODIST_AGREE_PORT"):
            agree(Record(0, "plan.json", PLAN_A, MODEL_A), rank=0, world=2, timeout_s=1)


def test_rank_0_never_listens_on_all_interfaces_unasked(two_rank_env, monkeypatch):
    """The master's address is not this machine's (TEST-NET-1): rank 0 says so and names the
    setting, where it used to listen on every interface instead."""
    monkeypatch.setenv("PADDLE_TRAINER_ENDPOINTS", "192.0.2.1:6170,127.0.0.1:6171")
    with pytest.raises(PlanError, match=r"192.0.2.1 is not an address of this machine; set AUTODIST_AGREE_BIND"):
        agree(Record(0, "plan.json", PLAN_A, MODEL_A), rank=0, world=2, timeout_s=1)


def test_ranks_on_several_machines_need_the_job_secret(two_rank_env, monkeypatch):
    monkeypatch.delenv("AUTODIST_AGREE_SECRET")
    monkeypatch.setenv("PADDLE_TRAINER_ENDPOINTS", "127.0.0.1:6170,10.0.0.2:6170")
    for rank in (0, 1):
        with pytest.raises(
            PlanError,
            match="set AUTODIST_AGREE_SECRET_FILE to a file only you can read, holding the same random text on every node",
        ):
            agree(Record(rank, "plan.json", PLAN_A, MODEL_A), rank=rank, world=2, timeout_s=1)


def test_losing_rank_0_mid_agreement_is_a_plan_error_at_once(two_rank_env):
    """Rank 0 takes rank 1's record, then dies before deciding (its socket closes): rank 1
    says so at once, well before its deadline."""
    with socket.create_server(("127.0.0.1", two_rank_env)) as stand_in_rank_0:
        dies = threading.Thread(target=lambda: _read_first_line_and_close(stand_in_rank_0))
        dies.start()
        start = time.monotonic()
        with pytest.raises(PlanError, match="lost the connection to rank 0"):
            agree(Record(1, "plan.json", PLAN_A, MODEL_A), rank=1, world=2, timeout_s=60)
        assert time.monotonic() - start < 30
        dies.join()


def _read_first_line_and_close(listener: socket.socket) -> None:
    conn, _ = listener.accept()
    with conn, conn.makefile("rb") as stream:
        challenge = bytes.fromhex(stream.readline().split()[-1].decode())
        conn.sendall(signed.greeting(KEY, agree_module.PROTOCOL, b"n" * 16, challenge))
        assert b'"record"' in stream.readline()


def _hello(conn: socket.socket, record: Record, call: object = 0) -> bytes:
    """Rank ``record.rank``'s first message on ``conn``, past rank 0's greeting, signed with the
    job's key; returns the nonces every later message is signed over."""
    challenge = signed.send_challenge(conn, agree_module.PROTOCOL)
    greeting = conn.recv(signed.greeting_bytes(agree_module.PROTOCOL), socket.MSG_WAITALL)
    nonce = bytes.fromhex(greeting.split()[-3].decode())
    assert greeting == signed.greeting(KEY, agree_module.PROTOCOL, nonce, challenge), "not rank 0's greeting"
    mine = b"m" * 16
    text = f'{{"call": {call}, "nonce": "{mine.hex()}", "record": {json.dumps(asdict(record))}}}'
    conn.sendall(signed.seal(KEY, agree_module.PROTOCOL, "record", nonce, text.encode()))
    return nonce + mine


def test_rank_0_waits_for_each_rank_to_hold_the_verdict(two_rank_env):
    """Rank 0 returns only once rank 1 acknowledged the verdict, however long rank 1 takes to
    read it (the only bound is the agreement timeout): were rank 0 to leave first, the job would
    end before rank 1 could report the problem (docs/paddle-notes.md, "The agreement step")."""
    verdict_read = threading.Event()

    def slow_rank_1():
        with _connect_when_listening(two_rank_env) as conn:
            _hello(conn, Record(1, "plan.json", PLAN_A, MODEL_A, ["world size: 2 planned, 1 launched"]))
            time.sleep(1.5)  # slow to read: rank 0 must still be there
            assert b"world size" in conn.makefile("rb").readline()
            verdict_read.set()
            conn.sendall(b"ack\n")

    rank_1 = threading.Thread(target=slow_rank_1)
    rank_1.start()
    with pytest.raises(PlanError, match="rank 1 failed validation: world size"):
        agree(Record(0, "plan.json", PLAN_A, MODEL_A), rank=0, world=2, timeout_s=60)
    assert verdict_read.is_set(), "rank 0 left before rank 1 held the verdict"
    rank_1.join()


def _connect_when_listening(port: int) -> socket.socket:
    """A connection to rank 0 on ``port`` once it listens."""
    deadline = time.monotonic() + 30
    while True:
        try:
            return socket.create_connection(("127.0.0.1", port), timeout=30)
        except ConnectionRefusedError:
            assert time.monotonic() < deadline, "rank 0 never listened"
            time.sleep(0.01)


@pytest.mark.parametrize("key", [KEY, b"another job's key"], ids=["malformed", "unsigned"])
def test_rank_0_ignores_a_stranger_on_its_port(two_rank_env, key):
    """Anything that connects and sends something other than a rank's signed record is hung up
    on, not trusted: rank 0 still names rank 1 missing. A record signed with the job's key but
    malformed (its problems not text) is reported as such."""

    def stranger():
        with _connect_when_listening(two_rank_env) as conn:
            signed.send_challenge(conn, agree_module.PROTOCOL)
            greeting = conn.recv(signed.greeting_bytes(agree_module.PROTOCOL), socket.MSG_WAITALL)
            nonce = bytes.fromhex(greeting.split()[-3].decode())
            bogus = {"rank": 1, "plan_source": "x", "plan_digest": "", "model_digest": "", "problems": [1]}
            text = json.dumps({"call": 0, "nonce": "ab" * 16, "record": bogus}).encode()
            conn.sendall(signed.seal(key, agree_module.PROTOCOL, "record", nonce, text))
            assert conn.recv(100) == b""  # hung up on

    thread = threading.Thread(target=stranger)
    thread.start()
    expected = "malformed record" if key == KEY else r"ranks 1 of 2 did not reach the agreement step within 2 s"
    with pytest.raises(PlanError, match=expected):
        agree(Record(0, "plan.json", PLAN_A, MODEL_A), rank=0, world=2, timeout_s=2)
    thread.join()


def test_an_infinite_call_number_is_a_malformed_record(two_rank_env):
    """``"call": Infinity`` used to escape as OverflowError; now it is one more malformed record."""

    def rank_1():
        with _connect_when_listening(two_rank_env) as conn:
            _hello(conn, Record(1, "plan.json", PLAN_A, MODEL_A), call="Infinity")
            conn.recv(100)

    thread = threading.Thread(target=rank_1)
    thread.start()
    with pytest.raises(PlanError, match=r"malformed record \(ValueError: Infinity is not a number here\)"):
        agree(Record(0, "plan.json", PLAN_A, MODEL_A), rank=0, world=2, timeout_s=10)
    thread.join()


def test_a_rank_that_reaches_another_program_sends_it_nothing_and_says_so(two_rank_env):
    """Another program holds the agreement port and never answers (as a foreign server may):
    rank 1 waits for rank 0's greeting, sends the stranger nothing but its fresh challenge, and
    names the port."""
    received, done = [], threading.Event()

    def silent_stranger(listener):
        listener.settimeout(0.1)
        while not done.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            with conn:
                conn.settimeout(5)
                try:
                    received.append(conn.recv(100))
                except OSError:
                    received.append(b"")

    with socket.create_server(("127.0.0.1", two_rank_env)) as listener:
        thread = threading.Thread(target=silent_stranger, args=(listener,))
        thread.start()
        start = time.monotonic()
        with pytest.raises(
            PlanError, match=rf"something other than this job's rank 0 listens on 127.0.0.1:{two_rank_env}"
        ):
            agree(Record(1, "plan.json", PLAN_A, MODEL_A), rank=1, world=2, timeout_s=3)
        assert time.monotonic() - start < 10
        done.set()
        thread.join()
    challenge = rb"autodist agreement \d+ [0-9a-f]{32}\n"
    assert received and all(re.fullmatch(challenge, r) for r in received), f"rank 1 sent the stranger {received}"


def test_an_ack_and_the_next_report_in_one_read_are_both_heard(two_rank_env):
    """A fast rank 1 acknowledges the verdict and reports it applied the plan in one send: rank
    0 reads both while it waits for the ack, and must keep the report for the next round (else
    it waits for it until the timeout)."""

    def fast_rank_1():
        with _connect_when_listening(two_rank_env) as conn:
            nonces = _hello(conn, Record(1, "plan.json", PLAN_A, MODEL_A))
            stream = conn.makefile("rb")
            first = nonces + (0).to_bytes(4, "big")
            verdict = json.loads(signed.unseal(KEY, agree_module.PROTOCOL, "verdict", first, stream.readline()) or b"")
            assert verdict["verdict"] == [] and len(bytes.fromhex(verdict["job"])) == 16  # and the job nonce
            second = nonces + (1).to_bytes(4, "big")
            conn.sendall(
                signed.seal(KEY, agree_module.PROTOCOL, "ack", first, b"{}")
                + signed.seal(KEY, agree_module.PROTOCOL, "report", second, b'{"problems": []}')
            )
            again = json.loads(signed.unseal(KEY, agree_module.PROTOCOL, "verdict", second, stream.readline()) or b"")
            assert again == verdict

    thread = threading.Thread(target=fast_rank_1)
    thread.start()
    agreement = agree(Record(0, "plan.json", PLAN_A, MODEL_A), rank=0, world=2, timeout_s=5)
    agreement.settle()  # rank 1's report came with its ack, in one read
    thread.join()


def test_a_rank_that_never_finds_rank_0s_key_says_where_it_looked(two_rank_env, monkeypatch, tmp_path):
    """No secret set, one machine: rank 0 would write the key file; with rank 0 absent (or
    under another TMPDIR), rank 1 names the file it waited for."""
    monkeypatch.delenv("AUTODIST_AGREE_SECRET")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with pytest.raises(PlanError, match=rf"it wrote no key to {tmp_path}/autodist-\d+/agree-127.0.0.1_\d+.key"):
        agree(Record(1, "plan.json", PLAN_A, MODEL_A), rank=1, world=2, timeout_s=1)


def test_without_a_secret_the_key_file_needs_every_rank_on_one_named_host(monkeypatch):
    """No AUTODIST_AGREE_SECRET: ranks on several hosts are told so; with PADDLE_MASTER alone
    (no PADDLE_TRAINER_ENDPOINTS) the error says the endpoints are not set, not 'several machines'."""
    monkeypatch.delenv("AUTODIST_AGREE_SECRET", raising=False)
    monkeypatch.setenv("PADDLE_MASTER", "127.0.0.1:6170")
    monkeypatch.delenv("PADDLE_TRAINER_ENDPOINTS", raising=False)
    with pytest.raises(PlanError) as unset:
        jobkey.new_key("127.0.0.1:6170", 6171)
    assert "PADDLE_TRAINER_ENDPOINTS is not set, so nothing says the job's ranks run on one machine" in str(unset.value)
    assert "several machines" not in str(unset.value) and "AUTODIST_AGREE_SECRET" in str(unset.value)
    monkeypatch.setenv("PADDLE_TRAINER_ENDPOINTS", "10.0.0.1:6170,10.0.0.2:6170")
    with pytest.raises(PlanError, match=r"ranks run on several machines \(PADDLE_TRAINER_ENDPOINTS\)"):
        jobkey.read_key("10.0.0.1:6170")
