"""Vocabulary-parallel token lookups run on local tensors, Megatron's way (``plan.vocab_lookup``,
applier/vocab_lookup.py), instead of Paddle 3.3.1's global lookup, which all-gathers the whole
table in every forward and backward.

- The planner lists the lookup where its table is split over the vocabulary and its layer is an
  ``nn.Embedding`` running its own forward, under tensor and data parallelism; elsewhere the
  gather stays and a note says why. apply_plan refuses a listed lookup the model cannot run so.
- Trained on 2 gloo ranks (mp2) and 4 (dp2 x mp2), untied (tests/models/gpt.py), tied by name
  with a ``padding_idx`` (the zoo's OPT) and tied by a function call (nanoGPT): losses and
  parameters as on one device.
- The gathers are gone: Paddle logs every input it reshards before a kernel
  (``GLOG_vmodule=data_transform=4``); the split table is resharded 2 times a step (forward and
  backward) under the global lookup, never under the local one.

Launches: mp2 with the log (2 ranks), the global lookup with the log (2), dp2 x mp2 (4), references (1).
"""

from __future__ import annotations

import re

import msgspec
import pytest

from autodist.applier.validate import plan_problems
from autodist.applier.vocab_lookup import vocab_lookup_problems
from autodist.planner.cost.search import SearchRequest
from autodist.planner.driver import load, plan_target
from autodist.planner.review.check import check_plan_for_target
from autodist.planner.review.show import show_text
from autodist.schemas import Plan, VocabLookup, save_plan
from harness.cases import Trained, check_against_reference
from harness.jobs import Job, TrainRun
from harness.runner import read_outputs, start_job
from harness.workloads import BATCH, WORKLOADS

#: Untied, tied by name (with a padding_idx), tied by a function call.
MODELS = ["gpt", "zoo_opt_hf", "zoo_nanogpt"]
STEPS = 3


def _request(dp: int = 1, micro_batches: int = 1) -> SearchRequest:
    return SearchRequest(
        devices_per_node=2 * dp,
        dp=dp,
        mp=2,
        pp=1,
        sharding_stage=0,
        sequence_parallel=False,
        micro_batches=micro_batches,
        global_batch_size=BATCH,
    )


def _plan(workload: str, dp: int = 1, micro_batches: int = 1) -> Plan:
    target = WORKLOADS[workload].planner_target
    return plan_target(target, None, _request(dp, micro_batches), {"target": target}).plan


@pytest.fixture(scope="module")
def plans() -> dict[tuple[str, int], Plan]:
    return {(workload, dp): _plan(workload, dp) for workload in MODELS for dp in (1, 2)}


def test_the_planner_lists_the_lookup_of_a_vocabulary_split_table(plans):
    expected = {
        "gpt": VocabLookup(layer="wte", weight="wte.weight"),
        "zoo_opt_hf": VocabLookup(layer="model.decoder.embed_tokens", weight="model.decoder.embed_tokens.weight"),
        "zoo_nanogpt": VocabLookup(layer="transformer.wte", weight="transformer.wte.weight"),
    }
    for (workload, dp), plan in plans.items():
        assert plan.vocab_lookup == [expected[workload]], (workload, dp)
        table = plan.params[expected[workload].weight]
        assert table.style == "VocabParallelEmbedding" and table.placements[-1] == "S(0)"
        assert not [note for note in plan.notes if "looked up in the global view" in note]
    assert plans["zoo_opt_hf", 1].params["model.decoder.embed_tokens.weight"].tied_to == ["lm_head.weight"]


def test_where_the_lookup_cannot_run_locally_the_gather_stays_with_a_note():
    # one micro-batch too many for local tensors (as for local views)
    accumulating = _plan("gpt", micro_batches=2)
    assert accumulating.vocab_lookup == []
    assert (
        "embedding wte.weight: split over the vocabulary, looked up in the global view, which all-gathers the "
        "whole table in every forward and backward (it runs on local tensors under tensor and data parallelism alone)"
    ) in accumulating.notes
    # a lookup that is one op of a layer doing more: F.embedding(idx, self.lm_head.weight.T)
    target = "tests/models/tied_by_call.py:build_embedding_from_head"
    inside = plan_target(target, None, _request(), {"target": target}).plan
    assert inside.vocab_lookup == []
    assert any(
        "looked up in the global view" in note and "the lookup is one op of a layer that does more" in note
        for note in inside.notes
    ), inside.notes
    # the table unsplit (mp 1): nothing to say
    unsplit = plan_target("tests/models/gpt.py", None, SearchRequest(devices_per_node=2, dp=2, mp=1, pp=1), {}).plan
    assert unsplit.vocab_lookup == [] and not [n for n in unsplit.notes if "global view" in n]


def test_apply_plan_refuses_a_lookup_the_model_cannot_run_locally(plans):
    plan = plans["gpt", 1]
    model = load(WORKLOADS["gpt"].planner_target).model
    assert vocab_lookup_problems(model, plan) == []

    def edited(**changes) -> Plan:
        return msgspec.structs.replace(plan, vocab_lookup=[msgspec.structs.replace(plan.vocab_lookup[0], **changes)])

    assert vocab_lookup_problems(model, edited(layer="ln_f")) == [
        "vocab_lookup ln_f: the model's layer is LayerNorm, not an nn.Embedding running its own forward"
    ]
    assert vocab_lookup_problems(model, edited(layer="wpe")) == [
        "vocab_lookup wpe: its table is not wte.weight",
    ]
    assert vocab_lookup_problems(model, edited(weight="wpe.weight")) == [
        "vocab_lookup wte: its table is not wpe.weight",
        "vocab_lookup wte: wpe.weight is placed R on mp; the lookup needs it S(0) (its vocabulary)",
    ]
    # apply_plan's check, before anything is touched
    assert "vocab_lookup ln_f: the model's layer is LayerNorm" in "\n".join(
        plan_problems(model, None, None, edited(layer="ln_f"), world_size=2)
    )
    # autodist-plan check says so too, and shows the lookup
    assert check_plan_for_target(plan, WORKLOADS["gpt"].planner_target, trace=False) == []
    assert check_plan_for_target(edited(layer="ln_f"), WORKLOADS["gpt"].planner_target, trace=False) == [
        "vocab_lookup ln_f: the model's layer is LayerNorm, not an nn.Embedding running its own forward"
    ]
    assert "vocab lookup: these lookups run on local tensors" in show_text(plan)
    assert "  wte  wte.weight" in show_text(plan)
    pipelined = msgspec.structs.replace(plan, strategy=msgspec.structs.replace(plan.strategy, micro_batches=2))
    assert any("tensor and data parallelism alone" in p for p in vocab_lookup_problems(model, pipelined))


#: The log line of an input resharded before a kernel (docs/paddle-notes.md, "SPMD rules").
RESHARDED_INPUT = re.compile(
    r"Reshard input: \S+ reshard from \{Global Shape: (\d+), (\d+), Local Shape: (\d+), (\d+),"
)


def _table_reshards(stderr: str, shape: list[int]) -> int:
    """How many times a rank's log shows the table of ``shape``, split in half over its rows,
    resharded as a kernel's input."""
    split = [str(shape[0]), str(shape[1]), str(shape[0] // 2), str(shape[1])]
    return sum(1 for found in RESHARDED_INPUT.findall(stderr) if list(found) == split)


def _job(runs: list[TrainRun], world: int, workdir, logged: bool) -> tuple[dict[str, list[dict]], list[str]]:
    """Train ``runs`` in one job; their outputs, and each rank's stderr (Paddle's reshard log when ``logged``)."""
    job = Job(out_dir=str(workdir / "out"), train=runs)
    env = {"GLOG_vmodule": "data_transform=4"} if logged else {}
    result = start_job(job, world, workdir, timeout_s=600.0, extra_env=env)
    result.raise_for_failure()
    return {run.name: read_outputs(job.out_dir, run.name, world) for run in runs}, [p.stderr for p in result.processes]


@pytest.fixture(scope="module")
def trained(plans, tmp_path_factory, reference_runs):
    """Every model at mp2 (logged) and dp2 x mp2; gpt at mp2 with the global lookup (logged)."""
    workdir = tmp_path_factory.mktemp("vocab_lookup")
    runs: dict[int, list[TrainRun]] = {1: [], 2: []}
    for (workload, dp), plan in plans.items():
        path = workdir / f"{workload}_dp{dp}.json"
        save_plan(plan, path)
        runs[dp].append(TrainRun(f"{workload}_dp{dp}_mp2", workload, plan=str(path), steps=STEPS))
    global_path = workdir / "gpt_global.json"
    save_plan(msgspec.structs.replace(plans["gpt", 1], vocab_lookup=[]), global_path)
    global_run = TrainRun("gpt_global_lookup", "gpt", plan=str(global_path), steps=STEPS)
    outputs, logs = _job(runs[1], 2, workdir / "mp2", logged=True)
    four, _ = _job(runs[2], 4, workdir / "dp2_mp2", logged=False)
    global_outputs, global_logs = _job([global_run], 2, workdir / "global", logged=True)
    outputs |= four | global_outputs
    reference_runs.prepare(runs[1] + runs[2])
    return {run.name: run for run in runs[1] + runs[2]}, outputs, {"local": logs, "global": global_logs}


@pytest.mark.multiprocess
@pytest.mark.parametrize("workload", MODELS)
@pytest.mark.parametrize("dp", [1, 2])
def test_a_local_lookup_trains_like_one_device(trained, plans, reference_runs, workload, dp):
    runs, outputs, _ = trained
    name = f"{workload}_dp{dp}_mp2"
    check_against_reference(Trained(runs[name], plans[workload, dp], outputs[name]), reference_runs)


@pytest.mark.multiprocess
def test_the_table_is_gathered_by_the_global_lookup_and_never_by_the_local_one(trained, plans):
    _, outputs, logs = trained
    # the global lookup trains the same (it is today's path), and its log shows the gathers
    assert outputs["gpt_global_lookup"][0]["losses"] == pytest.approx(outputs["gpt_dp1_mp2"][0]["losses"], rel=1e-5)
    gpt_table = plans["gpt", 1].params["wte.weight"].shape
    assert [_table_reshards(log, gpt_table) for log in logs["global"]] == [2 * STEPS] * 2
    tables = {
        workload: plans[workload, 1].params[plans[workload, 1].vocab_lookup[0].weight].shape for workload in MODELS
    }
    for workload, shape in tables.items():
        assert [_table_reshards(log, shape) for log in logs["local"]] == [0, 0], workload
    assert all("Reshard input" in log for log in logs["local"])  # the log was on (other inputs are resharded)
