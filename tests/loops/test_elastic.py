"""Issue 35: when the cluster changes, the job goes on (``autodist-run``, autodist/run.py).

A user-style script (scripts/elastic_train.py) checkpoints every 3 steps, run by the supervisor
on 4 gloo ranks with a family of plans (dp2 x mp2 for 4 devices, mp2 for 2). A rank dies at a
step drawn at random (seeded, printed): Paddle's launcher stops the others, the supervisor drops
the dead rank's device, re-plans for the 3 left (the family's largest plan that fits: 2) and
launches again; the script resumes from the last checkpoint. With ``--grow`` the lost device is
taken back at the next checkpoint, and the job ends on 4 ranks again. Every logged loss (the
last one logged for each step: steps after a checkpoint are trained again) equals the
single-device run's within 1e-5, and so do the final parameters. The same with the rank killed
half-way through writing a checkpoint: the previous one is the one resumed from.

The script resumes its loader through the checkpoint (``loader=``), no batch skipped by hand: with
``shuffle=True`` over two epochs, killed and resumed on fewer ranks, it reads exactly the batches
of an uninterrupted run. The supervisor says how far each interrupted launch got past its last
checkpoint, and its summary the steps trained again: the steps losses.jsonl logs twice.
"""

from __future__ import annotations

import contextlib
import json
import random
import re
import shutil
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable

import numpy as np
import psutil
import pytest
from loop_runs import LOSS_RTOL, PARAM_ATOL, SCRIPTS, run_script

from harness.launcher import base_env, free_ports

pytestmark = pytest.mark.multiprocess
#: No launch may wait past this (a rank left in a collective would).
TIMEOUT_S = 400
AUTODIST_RUN = [sys.executable, "-m", "autodist.run"]


def trained_again(out) -> int:
    """How many finished steps were trained again: log lines beyond one per step."""
    lines = (out / "losses.jsonl").read_text().splitlines()
    return len(lines) - len({json.loads(line)["step"] for line in lines})


def said_trained_again(said: str) -> int:
    (total,) = re.findall(r"summary: .* (\d+) step\(s\) trained again", said)
    return int(total)


def losses(out) -> dict[int, tuple[float, int]]:
    """Step -> (the last loss logged for it, on how many ranks)."""
    logged = {}
    for line in (out / "losses.jsonl").read_text().splitlines():
        record = json.loads(line)
        logged[record["step"]] = (record["loss"], record["ranks"])
    return logged


def make_family(tmp_path, loop_plans, *names: str):
    """A folder of the gpt loop's plans ``names`` (dp2mp2, mp2): a family for autodist-run."""
    family = tmp_path / "family"
    family.mkdir()
    for name in names:
        shutil.copy(loop_plans("gpt", name)[1], family / f"gpt_{name}.json")
    return family


def supervised(tmp_path, loop_plans, *script_args: str, grow: bool) -> tuple[subprocess.CompletedProcess, float]:
    family = make_family(tmp_path, loop_plans, "dp2mp2", "mp2")
    out, ckpt = tmp_path / "run", tmp_path / "ckpt"
    out.mkdir()
    command = [
        *AUTODIST_RUN, "--nproc-per-node", "4", "--plans", str(family),
        "--checkpoint", str(ckpt), "--log-dir", str(tmp_path / "log"), *(["--grow"] if grow else []),
        str(SCRIPTS / "elastic_train.py"), "--plan", "{plan}", "--ckpt", str(ckpt), "--out", str(out), *script_args,
    ]  # fmt: skip
    start = time.monotonic()
    done = subprocess.run(command, cwd=tmp_path, env=base_env(), capture_output=True, text=True, timeout=TIMEOUT_S)
    return done, time.monotonic() - start


@pytest.fixture(scope="module")
def one_device(tmp_path_factory):
    out = tmp_path_factory.mktemp("elastic_one")
    run_script("elastic_train.py", out, 1, None, "--ckpt", str(out / "ckpt"))
    return out


def assert_same_training(out, reference_run):
    """The same loss at every step, and the same final parameters."""
    from autodist import export_checkpoint

    reference, got = losses(reference_run), losses(out)
    assert sorted(got) == sorted(reference) == list(range(1, max(reference) + 1))
    for step, (loss, _) in reference.items():
        assert got[step][0] == pytest.approx(loss, rel=LOSS_RTOL), step
    final = export_checkpoint(out / "final", out / "final.pdparams")
    for name, value in export_checkpoint(reference_run / "final", reference_run / "final.pdparams").items():
        got, want = np.asarray(final[name]), np.asarray(value)
        if name.endswith("attn.qkv_proj.bias"):
            # The key bias's gradient is zero in exact arithmetic (softmax ignores what a query adds
            # to every score), so AdamW's normalised update turns rounding noise into steps of up to
            # the learning rate, whatever the plan: compared to that bound; q and v exactly.
            keys = slice(len(want) // 3, 2 * len(want) // 3)
            assert np.abs(got[keys] - want[keys]).max() <= 1e-2 * max(reference), name
            got[keys] = want[keys]
        np.testing.assert_allclose(got, want, atol=PARAM_ATOL, err_msg=name)


def test_a_rank_lost_then_grown_back_trains_as_one_device(tmp_path, loop_plans, one_device):
    seed = random.randrange(1 << 16)
    kill_at = random.Random(seed).randint(4, 8)
    print(f"rank 1 killed after step {kill_at} (seed {seed})")
    done, _ = supervised(tmp_path, loop_plans, "--kill-at", str(kill_at), "--seconds-per-step", "0.3", grow=True)
    assert done.returncode == 0, done.stderr[-4000:]
    said = done.stderr
    assert "launch 1: 4 ranks under gpt_dp2mp2.json" in said, said
    # Paddle's launcher names the first rank it sees fail: rank 1, killed (-9), or a peer that
    # raised first on the dead connection (exit code 1); the supervisor drops the device it names
    lost = re.search(r"lost rank (\d+) \(exit code (-?\d+)\): dropping device\(s\) \[(\d+)\]", said)
    assert lost and lost[1] == lost[3] and (lost[1], lost[2]) in {("1", "-9")} | {(r, "1") for r in "023"}, said
    assert "3 devices, but the family's largest plan that fits is for 2: running 2" in said, said
    last = (kill_at - 1) // 3 * 3  # the kill comes before that step's own checkpoint
    assert "launch 2: 2 ranks under gpt_mp2.json (dp1 mp2" in said and f"resuming at step {last}" in said, said
    # rank 0 reaches the killed rank's step, or is stopped one step short of it (the launcher's stop
    # races its last step): how far it got is what the supervisor counts
    gone = re.search(
        r"launch 1 reached step (\d+), its last checkpoint is at step (\d+): (\d+) step\(s\) to train", said
    )
    assert gone and int(gone[2]) == last and last <= int(gone[1]) <= kill_at, said
    assert int(gone[3]) == int(gone[1]) - last, said
    per_launch = [int(n) for n in re.findall(r"launch \d+ reached step \d+, .*: (\d+) step\(s\) to train again", said)]
    assert said_trained_again(said) == sum(per_launch), said
    assert f"taking back device(s) [{lost[1]}]" in said and "launch 3: 4 ranks under gpt_dp2mp2.json" in said, said
    assert "summary: 3 launch(es) on 4 -> 2 -> 4 devices" in said, said
    got = losses(tmp_path / "run")
    assert got[12][1] == 4 and any(ranks == 2 for _, ranks in got.values()), got  # ended grown back
    assert_same_training(tmp_path / "run", one_device)


def test_a_rank_killed_while_saving_resumes_from_the_previous_checkpoint(tmp_path, loop_plans, one_device):
    """Killed half-way through writing step 6's checkpoint: step 3's is resumed from, and no
    rank waits in the save's collective past the launcher's stop."""
    done, seconds = supervised(tmp_path, loop_plans, "--kill-at", "6", "--kill-in-save", grow=False)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "lost rank 1 (exit code -9)" in done.stderr and "resuming at step 3" in done.stderr, done.stderr
    assert "launch 1 reached step 6, its last checkpoint is at step 3: 3 step(s) to train again" in done.stderr
    assert said_trained_again(done.stderr) == trained_again(tmp_path / "run") == 3, done.stderr
    assert_same_training(tmp_path / "run", one_device)
    assert seconds < 200, seconds


def test_a_shuffled_loader_resumes_at_the_batch_it_stood_at(tmp_path, loop_plans):
    """``DataLoader(dataset, batch_size=4, shuffle=True)`` over two epochs of 6 steps, rank 1
    killed at a random step: the job goes on on 2 ranks from the last checkpoint, its loader
    starting at the first batch not trained on (in the second epoch too: the shuffle's seed is
    saved). Every logged loss and the final parameters equal an uninterrupted 2-rank run's, which
    reads the same batches; a batch skipped or repeated, or another order, would change them."""
    seed = random.randrange(1 << 16)
    kill_at = random.Random(seed).randint(4, 8)
    print(f"rank 1 killed after step {kill_at} (seed {seed})")
    shuffled = ("--shuffle", "--epochs", "2")
    done, _ = supervised(tmp_path, loop_plans, *shuffled, "--kill-at", str(kill_at), grow=False)
    assert done.returncode == 0, done.stderr[-4000:]
    last = (kill_at - 1) // 3 * 3
    assert f"resuming at step {last}" in done.stderr, done.stderr
    # at most the steps since the checkpoint: rank 0 may be stopped before it logs the killed step
    assert said_trained_again(done.stderr) == trained_again(tmp_path / "run") <= kill_at - last, done.stderr
    uninterrupted = tmp_path / "uninterrupted"
    uninterrupted.mkdir()
    run_script(
        "elastic_train.py", uninterrupted, 2, loop_plans("gpt", "mp2")[1], *shuffled, "--ckpt", str(tmp_path / "c2")
    )
    assert_same_training(tmp_path / "run", uninterrupted)


def test_two_nodes_on_loopback_run_as_one_job_through_paddles_launcher(tmp_path, loop_plans, one_device):
    """Two ``autodist-run --nnodes 2 --master 127.0.0.1:PORT`` processes stand for two machines,
    one rank each: Paddle's launcher makes them one job (its own rendezvous, not ours), each rank
    takes the family's plan for the job's 2 devices, and the job trains as one device. Elastic
    membership (``--nnodes MIN:MAX``): the next test."""
    family = make_family(tmp_path, loop_plans, "mp2")
    out = tmp_path / "run"
    out.mkdir()
    (master,) = free_ports(1)
    script = [
        str(SCRIPTS / "elastic_train.py"),
        "--plan",
        "{plan}",
        "--ckpt",
        str(tmp_path / "ckpt"),
        "--out",
        str(out),
    ]
    nodes = [
        subprocess.Popen(
            [
                *AUTODIST_RUN,
                "--nproc-per-node",
                "1",
                "--nnodes",
                "2",
                "--master",
                f"127.0.0.1:{master}",
                "--plans",
                str(family),
                "--log-dir",
                str(tmp_path / f"log{node}"),
                *script,
            ],
            cwd=tmp_path,
            env=base_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for node in (0, 1)
    ]
    try:
        ends = [node.communicate(timeout=TIMEOUT_S) for node in nodes]
    finally:
        for node in nodes:
            node.kill()
    for node, (_, err) in zip(nodes, ends):
        assert node.returncode == 0, err[-4000:]
    assert {ranks for _, ranks in losses(out).values()} == {2}
    assert_same_training(out, one_device)


def test_a_node_count_the_family_has_no_plan_for_is_refused_before_launching(tmp_path, loop_plans):
    family = make_family(tmp_path, loop_plans, "mp2")
    command = [*AUTODIST_RUN, "--nproc-per-node", "1", "--nnodes", "3", "--master", "127.0.0.1:1"]
    done = subprocess.run([*command, "--plans", str(family), "train.py"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and done.stderr.count("\n") == 1, done.stderr
    assert "the family has no plan for [3] devices" in done.stderr, done.stderr


@pytest.fixture
def etcd(tmp_path):
    """A private etcd on a free loopback port (``etcd://127.0.0.1:PORT``), stopped after the test."""
    binary = shutil.which("etcd")
    if binary is None:
        pytest.skip("no `etcd` binary on PATH (Debian: apt-get install etcd-server)")
    client, peer = free_ports(2)
    client_url, peer_url = f"http://127.0.0.1:{client}", f"http://127.0.0.1:{peer}"
    with open(tmp_path / "etcd.log", "w") as log:
        server = subprocess.Popen(
            [
                binary, "--name", "test", "--data-dir", str(tmp_path / "etcd"),
                "--listen-client-urls", client_url, "--advertise-client-urls", client_url, "--listen-peer-urls", peer_url,
                "--initial-advertise-peer-urls", peer_url, "--initial-cluster", f"test={peer_url}",
            ],
            stdout=log, stderr=log,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(f"{client_url}/health", timeout=2) as answer:
                    if json.load(answer).get("health") == "true":
                        break
            except OSError:
                pass
            assert server.poll() is None and time.monotonic() < deadline, (tmp_path / "etcd.log").read_text()[-2000:]
            time.sleep(0.2)
        yield f"etcd://127.0.0.1:{client}"
    finally:
        server.terminate()
        server.wait(timeout=30)


def stop_machine(node: subprocess.Popen) -> None:
    """SIGKILL a machine's autodist-run, its launcher and the ranks (in sessions of their own)."""
    try:
        tree = [psutil.Process(node.pid)]
        tree += tree[0].children(recursive=True)
    except psutil.NoSuchProcess:
        return
    for process in tree:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.kill()
    psutil.wait_procs(tree, timeout=30)


def wait_for_loss(out, ranks: int, after_step: int, deadline: float, machine: subprocess.Popen, after_line: int = 0):
    """The first step after ``after_step`` logged on ``ranks`` ranks past the first ``after_line``
    lines, and its line's index, waited for until ``deadline`` while ``machine`` runs."""
    while time.monotonic() < deadline:
        assert machine.poll() is None, f"autodist-run ended early (exit code {machine.returncode})"
        if (out / "losses.jsonl").exists():
            lines = (out / "losses.jsonl").read_text().splitlines()
            for index, line in enumerate(lines[after_line:], start=after_line):
                record = json.loads(line)
                if record["ranks"] == ranks and record["step"] > after_step:
                    return record["step"], index
        time.sleep(0.2)
    raise AssertionError(f"no step after {after_step} logged on {ranks} ranks in time")


def said_launches(said: str) -> list[tuple[int, str, int]]:
    """Each launch autodist-run said: (ranks, plan file, the step it resumed at, 0 from the start)."""
    found = re.findall(r"launch \d+: (\d+) ranks under (\S+) \([^)]*\)(?:, resuming at step (\d+))?", said)
    return [(int(ranks), plan, int(step or 0)) for ranks, plan, step in found]


#: The launchers' ``--elastic_timeout`` (Paddle's default 30 s), which they read from this
#: variable: how long a launcher that lost a machine waits for it before it starts its ranks on
#: the machines left, and how long one waits for its peers at a start. 10 s still covers both
#: machines' launchers starting together and Paddle's heartbeat (each launcher puts its key back
#: in etcd every 5 s after a restart deleted it); the same restarts happen, 20 s sooner.
ELASTIC_TIMEOUT = {"PADDLE_ELASTIC_TIMEOUT": "10"}


def elastic_machines(tmp_path, loop_plans, etcd: str, *script_args: str) -> Callable[[str], subprocess.Popen]:
    """``machine(name)`` starts one machine of an elastic job (``--nnodes 1:2``, one rank) on
    ``etcd``: autodist-run in a session of its own, its stderr in ``NAME.err``, the script logging
    in ``tmp_path/run``, with a family of the gpt loop's 1- and 2-device plans, the launchers
    waiting :data:`ELASTIC_TIMEOUT` for missing peers."""
    family = make_family(tmp_path, loop_plans, "one", "mp2")
    out, ckpt = tmp_path / "run", tmp_path / "ckpt"
    out.mkdir()

    def machine(name: str) -> subprocess.Popen:
        command = [
            *AUTODIST_RUN, "--nproc-per-node", "1", "--nnodes", "1:2", "--master", etcd, "--job-id", "elastic-test",
            "--plans", str(family), "--checkpoint", str(ckpt), "--log-dir", str(tmp_path / f"log_{name}"),
            str(SCRIPTS / "elastic_train.py"), "--plan", "{plan}", "--ckpt", str(ckpt), "--out", str(out),
            *script_args,
        ]  # fmt: skip
        with open(tmp_path / f"{name}.err", "w") as said:
            return subprocess.Popen(
                command, cwd=tmp_path, env=base_env(ELASTIC_TIMEOUT), stdout=said, stderr=said, start_new_session=True
            )

    return machine


def test_elastic_mode_a_machine_lost_then_back_trains_as_one_device(tmp_path, loop_plans, etcd):
    """Paddle 3.3's elastic mode, as ``autodist-run --nnodes 1:2 --master etcd://...`` runs it on
    two "machines" (two autodist-run processes on loopback, one rank each, a private etcd). The
    second machine is killed whole (autodist-run, launcher, rank) after step 4: the launcher on
    the first stops its rank, waits for the machines left (``--elastic_timeout``,
    :data:`ELASTIC_TIMEOUT`) and starts it again alone, which takes the family's 1-device plan and
    resumes from the last checkpoint.
    Then the second machine comes back: both launchers stop their ranks and start them again on 2,
    under the 2-device plan, from the checkpoint the lone rank left (its steps then run without the
    script's stand-in time: nothing is waited for after them). autodist-run on the first
    machine says each start and why, and the summary; every logged loss (the last one for each
    step) and the final parameters equal the single-device run's."""
    steps = ["--steps", "36"]
    stand_in = ["--seconds-per-step", "1"]  # the lone rank trains on while the second machine comes back
    reference = tmp_path / "one_device"
    reference.mkdir()
    run_script("elastic_train.py", reference, 1, None, *steps, "--ckpt", str(reference / "ckpt"))
    out = tmp_path / "run"
    machine = elastic_machines(tmp_path, loop_plans, etcd, *steps, *stand_in)
    nodes = [machine("first"), machine("second")]
    try:
        deadline = time.monotonic() + TIMEOUT_S
        wait_for_loss(out, 2, 3, deadline, nodes[0])
        stop_machine(nodes[1])
        alone, line = wait_for_loss(out, 1, 0, deadline, nodes[0])
        nodes.append(machine("back"))
        wait_for_loss(out, 2, 0, deadline, nodes[0], after_line=line)
        (out / "quick").touch()  # back on 2 ranks: the steps left need no stand-in time
        for node in (nodes[0], nodes[2]):
            node.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for node in nodes:
            stop_machine(node)
    said = (tmp_path / "first.err").read_text()
    assert nodes[0].returncode == 0 and nodes[2].returncode == 0, said[-4000:]
    launches = said_launches(said)
    # 2 ranks, then 1, then 2 again; the launcher may also start the ranks again at the same size
    # (said as "a rank failed"), which resumes as any start does
    sizes = [ranks for ranks, _, _ in launches]
    assert [size for i, size in enumerate(sizes) if i == 0 or sizes[i - 1] != size] == [2, 1, 2], said
    assert {(ranks, plan) for ranks, plan, _ in launches} == {(2, "gpt_mp2.json"), (1, "gpt_one.json")}, said
    assert "machines left, 2 -> 1 ranks" in said and "machines joined, 1 -> 2 ranks" in said, said
    assert said.count("the launcher started the ranks again:") == len(launches) - 1, said
    # the first start on 1 rank and the first on 2 after it resumed from the checkpoint the ranks
    # before them left: their first logged step follows it
    shrunk = sizes.index(1)
    regrown = sizes.index(2, shrunk)
    assert launches[shrunk][2] % 3 == 0 and alone == launches[shrunk][2] + 1, said
    logged = [json.loads(line) for line in (out / "losses.jsonl").read_text().splitlines()]
    first_on_2 = next(
        i for i, record in enumerate(logged) if record["ranks"] == 2 and i and logged[i - 1]["ranks"] == 1
    )
    assert launches[regrown][2] % 3 == 0 and logged[first_on_2]["step"] == launches[regrown][2] + 1, said
    per_launch = [int(n) for n in re.findall(r"launch \d+ reached step \d+, .*: (\d+) step\(s\) to train again", said)]
    assert said_trained_again(said) == sum(per_launch), said
    assert f"summary: {len(launches)} launch(es) on {' -> '.join(map(str, sizes))} devices" in said, said
    assert losses(out)[36][1] == 2
    assert_same_training(out, reference)


def test_elastic_mode_a_rank_killed_restarts_both_machines_at_the_same_size(tmp_path, loop_plans, etcd, one_device):
    """Rank 1 (on the machine the launchers ranked second) dies of SIGKILL after step 4, its
    launcher alive: both launchers start their ranks again on 2 under the same plan, from step 3's
    checkpoint, and the job trains as one device. autodist-run on the first machine says it was
    a rank, not a machine."""
    out = tmp_path / "run"
    # 0.3 s a step, as the one-machine tests: each start is seen before its first checkpoint
    killed = ("--kill-at", "4", "--kill-rank", "1", "--seconds-per-step", "0.3")
    machine = elastic_machines(tmp_path, loop_plans, etcd, *killed)
    nodes = [machine("first"), machine("second")]
    try:
        for node in nodes:
            node.wait(timeout=TIMEOUT_S)
    finally:
        for node in nodes:
            stop_machine(node)
    said = (tmp_path / "first.err").read_text()
    assert [node.returncode for node in nodes] == [0, 0], said[-4000:]
    launches = said_launches(said)
    assert {(ranks, plan) for ranks, plan, _ in launches} == {(2, "gpt_mp2.json")} and len(launches) >= 2, said
    restarts = said.count("the launcher started the ranks again: a rank failed, 2 ranks again")
    assert restarts == len(launches) - 1, said
    assert 3 in [step for _, _, step in launches] and f"summary: {len(launches)} launch(es) on 2 -> 2" in said, said
    assert {ranks for _, ranks in losses(out).values()} == {2}
    assert_same_training(out, one_device)
