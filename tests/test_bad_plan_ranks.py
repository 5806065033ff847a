"""Bad plans across ranks: every rank raises a PlanError naming the problem, before touching the
model or communicating, so nothing hangs (each job runs under a hard timeout and a rank left
blocked is reported as hung); a job whose ranks do not catch it exits non-zero on every rank.

All cases run in one 2-rank job that records each rank's error; a second 2-rank job lets one
error escape, as a user's script would.
"""

from __future__ import annotations

import dataclasses
import json

import msgspec
import pytest

from autodist.schemas import Reshard, dump_plan
from harness.jobs import BadPlanCase
from harness.launcher import launch_ranks
from harness.plans import tensor_parallel_plan
from harness.runner import check_bad_plans
from harness.workloads import WORKLOADS

pytestmark = pytest.mark.multiprocess

NRANKS = 2
WORKLOAD = "docstring_llama"
TIMEOUT_S = 120  # generous for a loaded 2-core machine; a hung rank is killed and reported


def write(path, data: bytes) -> str:
    path.write_bytes(data)
    return str(path)


def bad_plans(workdir) -> list[BadPlanCase]:
    """(name, plan file, text the PlanError must contain) for each way a plan can be wrong."""
    model = WORKLOADS[WORKLOAD].build(seed=0)
    good = tensor_parallel_plan(model, mp=NRANKS)
    q = "layers.0.self_attn.q_proj.weight"

    def with_params(**changes):
        return msgspec.structs.replace(good, params={**good.params, **changes})

    raw = json.loads(dump_plan(good))
    cases = {
        "another_model": (
            dump_plan(tensor_parallel_plan(WORKLOADS["paddleformers_llama"].build(seed=0), mp=NRANKS)),
            "not the model the plan was made for",
        ),
        "more_ranks_than_launched": (dump_plan(tensor_parallel_plan(model, dp=2, mp=NRANKS)), "world size"),
        "missing_parameter": (
            dump_plan(with_params(**{"layers.2.mlp.up_proj.weight": good.params["layers.0.mlp.up_proj.weight"]})),
            "layers.2.mlp.up_proj.weight",
        ),
        "wrong_shape": (
            dump_plan(with_params(**{q: msgspec.structs.replace(good.params[q], shape=[32, 64])})),
            f'$.params["{q}"].shape: planned [32, 64] but the model has [32, 32]',
        ),
        "unknown_hook_layer": (
            dump_plan(
                msgspec.structs.replace(
                    good, hooks=[Reshard(layer="layers.0.no_such_layer", when="post", placements=["R"])]
                )
            ),
            'no sub-layer "layers.0.no_such_layer"',
        ),
        "corrupted_file": (dump_plan(good)[:200], "not valid JSON"),
        "newer_version": (json.dumps({**raw, "version": 99}).encode(), "upgrade autodist"),
    }
    return [
        BadPlanCase(name=name, workload=WORKLOAD, plan=write(workdir / f"{name}.json", data), expect=expect)
        for name, (data, expect) in cases.items()
    ]


@pytest.fixture(scope="module")
def refusals(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("bad_plans")
    cases = bad_plans(workdir)
    job, per_rank = check_bad_plans(cases, NRANKS, workdir, TIMEOUT_S)
    job.raise_for_failure()  # every rank must have caught every case and finished
    return {case.name: (case, [results[case.name] for results in per_rank]) for case in cases}


@pytest.mark.parametrize(
    "name",
    [
        "another_model",
        "more_ranks_than_launched",
        "missing_parameter",
        "wrong_shape",
        "unknown_hook_layer",
        "corrupted_file",
        "newer_version",
    ],
)
def test_every_rank_refuses_the_plan_naming_the_problem(refusals, name):
    case, results = refusals[name]
    for rank, result in enumerate(results):
        assert result["error"] == "PlanError", f"rank {rank}: {result['error']}: {result['message']}"
        assert case.expect in result["message"], (
            f"rank {rank}: the message does not name the problem:\n{result['message']}"
        )
        assert result["untouched"], f"rank {rank}: the refused plan changed the model or optimizer"


@pytest.mark.parametrize("late_reader_rank", [None, 1], ids=["all_prompt", "rank_1_reads_the_verdict_late"])
def test_an_uncaught_plan_error_fails_the_job_on_every_rank(tmp_path, late_reader_rank):
    """Rank 0 (which decides) raising ends the job: it must not leave before every rank holds
    the verdict, or a slow rank reports a lost connection instead (TEST-ONLY late reader:
    harness/rank_main.py, read_the_verdict_late)."""
    (case,) = [c for c in bad_plans(tmp_path) if c.name == "more_ranks_than_launched"]
    case = dataclasses.replace(case, late_reader_rank=late_reader_rank)
    job, _ = check_bad_plans([case], NRANKS, tmp_path, TIMEOUT_S, let_escape=True)
    assert not job.timed_out, job.report()
    for proc in job.processes:
        assert proc.returncode not in (0, None), f"{proc.name} did not fail on its own:\n{proc.describe()}"
        assert "PlanError" in proc.stderr and "world size" in proc.stderr, proc.describe()
        assert "lost the connection" not in proc.stderr, proc.describe()


def test_under_paddles_launcher_the_job_fails_with_the_verdict(tmp_path):
    """paddle.distributed.launch stops every rank about a second after the first one exits
    non-zero (docs/paddle-notes.md, "The agreement step"): whichever rank fails first must fail
    with the verdict, never with a lost connection, and the job must end on its own."""
    (case,) = [c for c in bad_plans(tmp_path) if c.name == "more_ranks_than_launched"]
    job, _ = check_bad_plans([case], NRANKS, tmp_path, TIMEOUT_S, let_escape=True, paddle_launch=True)
    (node,) = job.processes
    assert not job.timed_out and node.returncode not in (0, None), job.report()
    assert "world size" in node.stderr and "lost the connection" not in node.stderr, node.describe()


def test_the_harness_reports_a_rank_left_hanging(tmp_path):
    """The guarantee the tests above rely on: when one rank fails and another blocks (as in a
    collective its peer never joins), the job ends, the blocked rank is killed and reported as
    hung, and the failed rank's stderr is in the report."""
    rank_program = (
        "import os, sys, time\n"
        "if os.environ['PADDLE_TRAINER_ID'] == '0':\n"
        "    sys.exit('rank 0: PlanError: simulated')\n"
        "time.sleep(600)\n"
    )
    job = launch_ranks(2, ["-c", rank_program], tmp_path, timeout_s=60, failure_grace_s=1)
    assert not job.ok and not job.timed_out
    assert [p.returncode for p in job.processes] == [1, None]
    assert "rank 0: PlanError: simulated" in job.report() and "killed (hung)" in job.report()
