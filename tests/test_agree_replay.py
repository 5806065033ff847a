"""Every signed message bound to this job and this run (issue #33 item 2): two jobs under the same
``AUTODIST_AGREE_SECRET_FILE`` share no key after the agreement, so nothing recorded in one --
a greeting, a record, a posted value -- is accepted in the other.

Rank 0 draws a fresh job nonce at every agreement and sends it with its signed verdict; what the
ranks sign afterwards (the readable losses' answers, posted values and addresses) is under the
job's key bound to that nonce (``Agreement.job_key``). A record is bound to its connection (both
ends' nonces), and a greeting to the fresh challenge of the rank it answers: an earlier job's
greeting, replayed, is refused at once (tests/test_agree_strangers.py).
"""

from __future__ import annotations

import json
import time

import pytest

from autodist.applier.ranks.agree import PROTOCOL, Record, agree
from autodist.applier.ranks.jobkey import SECRET_FILE_ENV, _from_secret
from autodist.applier.ranks.readable.notes import Notes
from autodist.applier.ranks.readable.store import post_value, posted, slot
from autodist.applier.ranks.signed import seal
from autodist.schemas import PlanError
from harness.launcher import free_ports, launch_ranks

pytestmark = pytest.mark.multiprocess

SECRET = "7d2f9a4c1e8b3065" * 4


@pytest.fixture
def secret_file(tmp_path):
    path = tmp_path / "agree.secret"
    path.write_text(SECRET)
    path.chmod(0o600)
    return path


def _job(tmp_path, secret_file, name: str) -> list[dict]:
    job = launch_ranks(
        2,
        ["-m", "harness.agree_rank", "a" * 64],
        tmp_path / name,
        timeout_s=60,
        extra_env={SECRET_FILE_ENV: str(secret_file), "AUTODIST_AGREE_TIMEOUT": "30"},
    )
    job.raise_for_failure()
    return [json.loads(p.stdout.strip().splitlines()[-1]) for p in job.processes]


def test_two_jobs_under_the_same_secret_sign_with_different_keys(tmp_path, secret_file):
    first, second = _job(tmp_path, secret_file, "first"), _job(tmp_path, secret_file, "second")
    assert all(r["error"] is None for r in first + second), first + second
    assert first[0]["job"] == first[1]["job"] and second[0]["job"] == second[1]["job"]
    assert first[0]["job"] != second[0]["job"]


def test_a_value_posted_in_an_earlier_job_is_refused(tmp_path):
    """Rank 1 of an earlier job posted a loss under its run's key; a stranger copies those bytes
    into this job's store at the same slot (same secret, same slot name): rank 0 refuses it."""
    from paddle.base import core

    from autodist.applier.ranks.agree import Agreement

    earlier, now = (
        Agreement(_from_secret(SECRET), 0, 2, 1.0, "plan.json", []),
        Agreement(_from_secret(SECRET), 0, 2, 1.0, "plan.json", []),
    )
    earlier.job, now.job = b"e" * 16, b"n" * 16
    (port,) = free_ports(1)
    store = core.TCPStore("127.0.0.1", port, True, 1, 30)
    old = Notes(1, 2, earlier.job_key, 5.0)
    old.store = store
    post_value(old, ("value", 1, 0), {"hex": "00"})
    reader = Notes(0, 2, now.job_key, 5.0)
    reader.store = store
    said = posted(reader, 1, ("value", 1, 0))
    assert "not signed with the job's key" in said.get("error", ""), said
    assert slot(1, ("value", 1, 0)).startswith("autodist/readable/1/")


def test_a_record_from_an_earlier_job_is_refused(tmp_path, secret_file, monkeypatch):
    """Rank 0 of this job, its one peer played by a stranger holding an earlier job's record (the
    same secret): the record was signed over that job's greeting nonce, so rank 0 drops it and
    names the missing rank. (A greeting recorded then and replayed now answers another challenge:
    rank 1 refuses it at once, tests/test_agree_strangers.py, the greeting recorded in an earlier job.)"""
    import socket
    import threading

    from autodist.applier.ranks.signed import read_greeting, send_challenge

    p0, p1, agree_port = free_ports(3)
    monkeypatch.setenv("PADDLE_TRAINER_ENDPOINTS", f"127.0.0.1:{p0},127.0.0.1:{p1}")
    monkeypatch.delenv("PADDLE_MASTER", raising=False)
    monkeypatch.delenv("AUTODIST_AGREE_SECRET", raising=False)
    monkeypatch.setenv("AUTODIST_AGREE_PORT", str(agree_port))
    monkeypatch.setenv(SECRET_FILE_ENV, str(secret_file))
    key = _from_secret(SECRET)
    earlier_nonce = b"e" * 16
    hello = json.dumps(
        {
            "call": 0,
            "nonce": "00" * 16,
            "record": {
                "rank": 1,
                "plan_source": "plan.json",
                "plan_digest": "a" * 64,
                "model_digest": "a" * 64,
                "problems": [],
            },
        }
    ).encode()
    recorded = seal(key, PROTOCOL, "record", earlier_nonce, hello)

    def replay():
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", agree_port), timeout=1) as conn:
                    send_challenge(conn, PROTOCOL)
                    heard = read_greeting(conn, PROTOCOL, time.monotonic() + 2)
                    assert heard is not None and heard.nonce != earlier_nonce
                    conn.sendall(recorded)
                    time.sleep(1)
                    return
            except OSError:
                time.sleep(0.01)

    import autodist.applier.ranks.agree as agree_module
    import itertools

    monkeypatch.setattr(agree_module, "_CALLS", itertools.count())
    thread = threading.Thread(target=replay, daemon=True)
    thread.start()
    with pytest.raises(PlanError, match="ranks 1 of 2 did not reach the agreement step within 3 s"):
        agree(Record(0, "plan.json", "a" * 64, "a" * 64), rank=0, world=2, timeout_s=3)
    thread.join(timeout=10)
