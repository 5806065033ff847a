"""Ranks that disagree or die: every rank stops with the same PlanError, none hangs.

Each rank's own checks pass in the disagreement cases below (each plan is valid for the model
it meets), so only the agreement step in ``apply_plan`` (applier/ranks/agree.py) can catch them;
without it the job hangs in a collective, dies after a backend timeout naming nothing, or trains
something else on one rank. Ranks are started by hand (no supervising launcher), and a rank
killed inside ``apply_plan`` must not leave the others waiting.
"""

from __future__ import annotations

import msgspec
import pytest

from autodist.schemas import dump_plan
from harness.jobs import BadPlanCase
from harness.plans import tensor_parallel_plan
from harness.runner import check_bad_plans
from harness.workloads import WORKLOADS

pytestmark = pytest.mark.multiprocess

NRANKS = 2
WORKLOAD = "docstring_llama"
#: The agreement timeout in these jobs; every rank must have stopped well within a minute.
AGREE_TIMEOUT_S = 20
STOP_WITHIN_S = 60
#: A killed rank never arrives, so its survivor always waits out the whole timeout: a short one.
KILLED_TIMEOUT_S = 8


def write(path, data: bytes) -> str:
    path.write_bytes(data)
    return str(path)


def disagreements(workdir) -> list[BadPlanCase]:
    model = WORKLOADS[WORKLOAD].build(seed=0)
    mp2 = tensor_parallel_plan(model, mp=NRANKS)
    dp2 = tensor_parallel_plan(model, dp=NRANKS)
    other_sharding = msgspec.structs.replace(mp2, data=msgspec.structs.replace(mp2.data, shard_axes=["mp"]))
    assert mp2.data.shard_axes != other_sharding.data.shard_axes
    a = write(workdir / "mp2.json", dump_plan(mp2))
    b = write(workdir / "dp2.json", dump_plan(dp2))
    c = write(workdir / "mp2_data_over_mp.json", dump_plan(other_sharding))
    return [
        BadPlanCase("another_plan_file", WORKLOAD, a, "different plan: rank 0 has", rank_plans=[a, b]),
        BadPlanCase("same_plan_other_data_sharding", WORKLOAD, a, "different plan", rank_plans=[a, c]),
        BadPlanCase(
            "model_of_another_size",
            WORKLOAD,
            a,
            "different model",
            rank_workloads=[WORKLOAD, "docstring_llama_3_layers"],
        ),
        BadPlanCase("rank_1_fails_after_the_agreement", WORKLOAD, a, "", fail_applying_rank=1),
    ]


@pytest.fixture(scope="module")
def refusals(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("disagree")
    cases = disagreements(workdir)
    job, per_rank = check_bad_plans(
        cases, NRANKS, workdir, 180, extra_env={"AUTODIST_AGREE_TIMEOUT": str(AGREE_TIMEOUT_S)}
    )
    job.raise_for_failure()
    return {case.name: (case, [results[case.name] for results in per_rank]) for case in cases}


@pytest.mark.parametrize("name", ["another_plan_file", "same_plan_other_data_sharding", "model_of_another_size"])
def test_every_rank_raises_the_same_plan_error_naming_the_ranks(refusals, name):
    case, results = refusals[name]
    for rank, result in enumerate(results):
        assert result["error"] == "PlanError", f"rank {rank}: {result['error']}: {result['message']}"
        assert case.expect in result["message"], f"rank {rank}:\n{result['message']}"
        assert "rank 0" in result["message"] and "rank 1" in result["message"], result["message"]
        assert result["untouched"], f"rank {rank}: the refused plan changed the model or optimizer"
    # the same error everywhere, but for the file name each rank read
    assert results[0]["message"].partition(":")[2] == results[1]["message"].partition(":")[2]


def test_a_model_of_another_size_also_names_the_failed_validation(refusals):
    _, results = refusals["model_of_another_size"]
    assert "rank 1 failed validation: model: this is not the model the plan was made for" in results[0]["message"]


def test_a_rank_failing_after_the_agreement_stops_the_others(refusals):
    """Hand-started ranks, no launcher: rank 1 raises when it starts sharding, after the ranks
    agreed. Rank 0 raises a PlanError naming it, well within the timeout (it used to go on, into
    the first collective, and wait there for ever)."""
    _, (zero, one) = refusals["rank_1_fails_after_the_agreement"]
    assert one["error"] == "RuntimeError" and "TEST-ONLY" in one["message"], one
    assert zero["error"] == "PlanError", zero
    assert "rank 1 failed while applying the plan: RuntimeError: TEST-ONLY" in zero["message"], zero
    assert zero["seconds"] < AGREE_TIMEOUT_S, zero


@pytest.mark.parametrize("victim", [0, 1])
def test_a_rank_killed_during_apply_plan_stops_the_others(tmp_path, victim):
    """Hand-started ranks, no launcher: the survivor raises a PlanError naming the dead rank
    within a minute (today it waits for ever)."""
    plan = write(tmp_path / "mp2.json", dump_plan(tensor_parallel_plan(WORKLOADS[WORKLOAD].build(seed=0), mp=NRANKS)))
    case = BadPlanCase("killed", WORKLOAD, plan, "", die_on_rank=victim)
    job, per_rank = check_bad_plans(
        [case], NRANKS, tmp_path, 150, failure_grace_s=120, extra_env={"AUTODIST_AGREE_TIMEOUT": str(KILLED_TIMEOUT_S)}
    )
    assert not job.timed_out, job.report()
    survivor = 1 - victim
    assert job.processes[victim].returncode == -9, job.report()
    assert job.processes[survivor].returncode == 0, job.report()
    result = per_rank[survivor]["killed"]
    assert result["error"] == "PlanError", result
    assert (
        f"rank{'s' if victim else ''} {victim}" in result["message"]
        and "did not reach the agreement step" in result["message"]
    ), result
    assert result["seconds"] < STOP_WITHIN_S, result
    assert result["untouched"]


#: One rank of a real job that applies a plan (no harness around apply_plan: its PlanError is the
#: process's non-zero exit, as in a user's script).
APPLYING_RANK = """
import sys
import paddle.distributed as dist
from autodist.applier import apply_plan
from harness.workloads import WORKLOADS
dist.init_parallel_env()
apply_plan(WORKLOADS[sys.argv[1]].build(seed=0), None, None, sys.argv[2])
"""


@pytest.mark.parametrize("holder", [0, 1])
def test_a_secret_on_one_rank_only_stops_both_within_seconds(tmp_path, holder):
    """AUTODIST_AGREE_SECRET on one rank only, the default timeout (300 s): both ranks exit
    non-zero within 30 s, each naming the variable and where it is set. Both once waited the
    whole timeout, and rank 0 then told to set AUTODIST_AGREE_TIMEOUT."""
    import subprocess
    import sys
    import time

    from harness.launcher import AGREE_PORT_ENV, TESTS_DIR, free_ports, rank_env

    plan = write(tmp_path / "mp2.json", dump_plan(tensor_parallel_plan(WORKLOADS[WORKLOAD].build(seed=0), mp=NRANKS)))
    *ports, agree_port = free_ports(NRANKS + 1)
    endpoints = [f"127.0.0.1:{port}" for port in ports]
    start, procs = time.monotonic(), []
    for rank in range(NRANKS):
        env = rank_env(rank, endpoints, {AGREE_PORT_ENV: str(agree_port)})
        for name in ("AUTODIST_AGREE_SECRET", "AUTODIST_AGREE_TIMEOUT"):
            env.pop(name, None)
        if rank == holder:
            env["AUTODIST_AGREE_SECRET"] = "3e7a9c1f5b2d8064" * 2  # strong enough (jobkey.MIN_SECRET_BITS)
        command = [sys.executable, "-c", APPLYING_RANK, WORKLOAD, plan]
        procs.append(subprocess.Popen(command, cwd=TESTS_DIR, env=env, stderr=subprocess.PIPE, text=True))
    try:
        errors = [proc.communicate(timeout=120)[1] for proc in procs]
    finally:
        for proc in procs:
            proc.kill()
    took = time.monotonic() - start
    for rank, (proc, err) in enumerate(zip(procs, errors)):
        other = f"rank {1 - rank}"
        where = ("this rank", other) if rank == holder else (other, "this rank")
        assert proc.returncode not in (0, None), f"rank {rank} went on:\n{err[-2000:]}"
        assert f"{other}'s messages are not signed with this rank's key" in err, err[-2000:]
        assert f"AUTODIST_AGREE_SECRET is set on {where[0]} and unset on {where[1]}" in err, err[-2000:]
    assert took < 30, f"{took:.1f} s"
