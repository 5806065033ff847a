"""Vocabulary-parallel token lookups run on local tensors, Megatron's way (``plan.vocab_lookup``,
applier/modes/vocab_lookup.py), instead of Paddle 3.3.1's global lookup, which all-gathers the whole
table in every forward and backward.

- The planner lists the lookup where its table is split over the vocabulary and the dataflow
  allows it (the lookup reads the table itself, and nothing else in its layer reads the table),
  whatever the layer's class and whatever it does with the answer (HF MiniCPM's scaled
  ``nn.Embedding`` subclass, a layer calling ``F.embedding`` on a table of its own), under the
  strategies local views run under (tensor and data parallelism, ZeRO 1 and 2, accumulation, full
  recompute, 1F1B); elsewhere the gather stays and a note says why. apply_plan refuses a listed
  lookup the model cannot run so.
- Trained on 2 gloo ranks (mp2) and 4 (dp2 x mp2), untied (tests/models/gpt.py), tied by name
  with a ``padding_idx`` (the zoo's OPT), tied by a function call (nanoGPT) and scaled in an
  ``nn.Embedding`` subclass (HF MiniCPM), and one table looked up for the encoder's ids and the
  decoder's (T5, Switch Transformers): losses and parameters as on one device.
- The gathers are gone: under the global lookup Paddle's ``embedding`` op is handed the split
  DistTensor table, which Paddle's rule gathers whole in the forward and again in the backward
  (measured with ``GLOG_vmodule=data_transform=4``: docs/paddle-notes.md); under the local one,
  each rank's rows as a plain tensor. A probe of ``paddle._C_ops.embedding`` that runs the
  lookups alone, after the
  2-rank trainings in the same processes, shows which (the log is not the probe: with it on,
  Paddle aborted now and then with "double free or corruption", depending on the environment,
  never without it).

Launches: one per world size, made by one module fixture (``trained``): the mp2 trainings, the
global lookup's and the probe in one (2 ranks), dp2 x mp2 (4), the single-device references (1).
The tests made 6 (the global lookup and each probe apart): on a 2-core machine each costs every
rank several seconds of start-up (it imports Paddle), more than the 3 steps it trains.
"""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import numpy as np
import paddle
import pytest

from autodist.applier.placement.validate import plan_problems
from autodist.applier.modes.vocab_lookup import answering, vocab_lookup_problems
from autodist.planner.cost.hardware import PROFILES
from autodist.planner.cost.search import SearchRequest
from autodist.planner.driver import analyse, load, plan_target, trace
from autodist.planner.review.check import check_plan_for_target
from autodist.planner.review.show import show_text
from autodist.schemas import Plan, VocabLookup, save_plan
from harness.cases import Trained, check_against_reference
from harness.jobs import Job, TrainRun
from harness.launcher import launch_ranks
from harness.planning import gloo_mp2_request
from harness.runner import read_outputs, train_by_world
from harness.workloads import WORKLOADS
from models import scaled_embeddings

#: Untied, tied by name (with a padding_idx), tied by a function call, scaled in an nn.Embedding
#: subclass, one table looked up twice a step by its layer (encoder and decoder ids: T5's shared,
#: Switch Transformers', whose experts run whole on every rank).
MODELS = ["gpt", "zoo_opt_hf", "zoo_nanogpt", "zoo_minicpm_hf", "zoo_t5", "zoo_switch_transformers_hf"]
STEPS = 3


def _request(dp: int = 1, **extra) -> SearchRequest:
    return gloo_mp2_request(dp, **extra)


def _plan(workload: str, dp: int = 1, **extra) -> Plan:
    target = WORKLOADS[workload].planner_target
    return plan_target(target, None, _request(dp, **extra), {"target": target}).plan


@pytest.fixture(scope="module")
def plans() -> dict[tuple[str, int], Plan]:
    return {(workload, dp): _plan(workload, dp) for workload in MODELS for dp in (1, 2)}


def test_the_planner_lists_the_lookup_of_a_vocabulary_split_table(plans):
    expected = {
        "gpt": VocabLookup(layer="wte", weight="wte.weight"),
        "zoo_opt_hf": VocabLookup(layer="model.decoder.embed_tokens", weight="model.decoder.embed_tokens.weight"),
        "zoo_nanogpt": VocabLookup(layer="transformer.wte", weight="transformer.wte.weight"),
        "zoo_minicpm_hf": VocabLookup(layer="model.embed_tokens", weight="model.embed_tokens.weight"),
        "zoo_t5": VocabLookup(layer="shared", weight="shared.weight"),
        "zoo_switch_transformers_hf": VocabLookup(layer="shared", weight="shared.weight"),
    }
    for (workload, dp), plan in plans.items():
        assert plan.vocab_lookup == [expected[workload]], (workload, dp)
        table = plan.params[expected[workload].weight]
        assert table.style == "VocabParallelEmbedding" and table.placements[-1] == "S(0)"
        assert not [note for note in plan.notes if "looked up in the global view" in note]
    assert plans["zoo_opt_hf", 1].params["model.decoder.embed_tokens.weight"].tied_to == ["lm_head.weight"]


def test_where_the_lookup_cannot_run_locally_the_gather_stays_with_a_note():
    # the one strategy local tensors do not run under (as for local views): the sequential pipeline
    sequential = _plan(
        "gpt", pp=2, schedule="sequential", devices_per_node=4, micro_batches=1, device=PROFILES["h100-sxm"]
    )
    assert sequential.vocab_lookup == []
    assert (
        "embedding wte.weight: split over the vocabulary, looked up in the global view, which all-gathers the "
        "whole table in every forward and backward (it does not run on local tensors with the sequential "
        "pipeline schedule)"
    ) in sequential.notes
    # with sequence parallelism it looks up locally, its partial sum reduce-scattered
    assert _plan("gpt", sequence_parallel=True).vocab_lookup == [VocabLookup(layer="wte", weight="wte.weight")]
    # with 2 micro-batches of accumulation, ZeRO 1 and full recompute it looks up locally
    composed = _plan("gpt", dp=2, micro_batches=2, sharding_stage=1, recompute="full")
    assert composed.vocab_lookup == [VocabLookup(layer="wte", weight="wte.weight")]
    # a lookup of a table read transposed: F.embedding(idx, self.lm_head.weight.T)
    target = "tests/models/tied_by_call.py:build_embedding_from_head"
    inside = plan_target(target, None, _request(), {"target": target}).plan
    assert inside.vocab_lookup == []
    assert any(
        "looked up in the global view" in note and "the lookup reads lm_head.weight through transpose" in note
        for note in inside.notes
    ), inside.notes
    # the table unsplit (mp 1): nothing to say
    unsplit = plan_target("tests/models/gpt.py", None, SearchRequest(devices_per_node=2, dp=2, mp=1, pp=1), {}).plan
    assert unsplit.vocab_lookup == [] and not [n for n in unsplit.notes if "global view" in n]


def test_the_lookup_runs_locally_as_the_dataflow_allows_whatever_the_layer():
    """Which layer's calls look up on local tensors is read from the dataflow (what the lookup
    reads, who else reads its table), not from the layer's class: a scaled nn.Embedding subclass
    (HF MiniCPM's habit; before, only an nn.Embedding running its own forward was taken, so it was
    looked up in the global view, the table gathered whole in every forward and backward), the
    caller scaling, a layer of its own calling F.embedding on its table. One layer that is the
    tied head too (its calls read the table in a matmul), or a sparse lookup, stays global."""
    expected = {
        "subclass": ("embed_tokens", ""),
        "caller_scaled": ("embed_tokens", ""),
        "own_table": ("embed_tokens", ""),
        "shared_modes": (None, "embed_tokens reads embed_tokens.weight in matmul too"),
        "sparse": (None, "embed_tokens looks embed_tokens.weight up sparse"),
    }
    for habit, decision in expected.items():
        loaded = load(f"tests/models/scaled_embeddings.py:build_{habit}")
        analysis = analyse(loaded.model, trace(loaded.model, loaded.input_specs))
        assert (analysis.local_lookup, analysis.local_lookup_refusal) == decision, habit


def test_the_layer_runs_as_written_with_its_lookup_answered():
    """apply_plan runs the listed layer's forward as written and answers Paddle's embedding op on
    the plan's table (here by a stand-in table): other tables are looked up as ever, Paddle's op
    is put back after the call, and a call that looks nothing up in the table raises (a hand-made
    plan naming the wrong layer), as does a sparse lookup."""
    subclass = scaled_embeddings.ScaledWordEmbedding(11, 4, embed_scale=3.0)
    other, stand_in = paddle.nn.Embedding(11, 4), paddle.nn.Embedding(11, 4)
    paddle_op, ids = paddle._C_ops.embedding, paddle.to_tensor([[1, 5, 7]])

    def forward(x):
        return subclass(x) + other(x)

    def answer(embedding, x, table, padding_idx):
        assert table is subclass.weight
        return embedding(x, stand_in.weight, padding_idx, False)

    run = answering(forward, VocabLookup("emb", "emb.weight"), lambda: subclass.weight, answer)
    np.testing.assert_allclose(run(ids).numpy(), (stand_in(ids) * 3.0 + other(ids)).numpy())
    assert paddle._C_ops.embedding is paddle_op
    nothing = answering(other, VocabLookup("other", "emb.weight"), lambda: subclass.weight, answer)
    with pytest.raises(RuntimeError, match="vocab_lookup other: the call looked nothing up in emb.weight"):
        nothing(ids)
    assert paddle._C_ops.embedding is paddle_op
    sparse = paddle.nn.Embedding(11, 4, sparse=True)
    with pytest.raises(RuntimeError, match="vocab_lookup emb: emb.weight is looked up sparse"):
        answering(sparse, VocabLookup("emb", "emb.weight"), lambda: sparse.weight, answer)(ids)


def test_apply_plan_refuses_a_lookup_the_model_cannot_run_locally(plans):
    plan = plans["gpt", 1]
    model = load(WORKLOADS["gpt"].planner_target).model
    assert vocab_lookup_problems(model, plan) == []

    def edited(**changes) -> Plan:
        return msgspec.structs.replace(plan, vocab_lookup=[msgspec.structs.replace(plan.vocab_lookup[0], **changes)])

    assert vocab_lookup_problems(model, edited(layer="wte_")) == ["vocab_lookup wte_: the model has no layer wte_"]
    assert vocab_lookup_problems(model, edited(weight="wte.bias")) == [
        "vocab_lookup wte: the model has no parameter wte.bias",
        "vocab_lookup wte: wte.bias is placed R on mp; the lookup needs it S(0) (its vocabulary)",
    ]
    assert vocab_lookup_problems(model, edited(weight="wpe.weight")) == [
        "vocab_lookup wte: wpe.weight is placed R on mp; the lookup needs it S(0) (its vocabulary)",
    ]
    # apply_plan's check, before anything is touched
    assert "vocab_lookup wte_: the model has no layer wte_" in "\n".join(
        plan_problems(model, None, None, edited(layer="wte_"), world_size=2)
    )
    # autodist-plan check says so too, and shows the lookup
    assert check_plan_for_target(plan, WORKLOADS["gpt"].planner_target, trace=False) == []
    assert check_plan_for_target(edited(layer="wte_"), WORKLOADS["gpt"].planner_target, trace=False) == [
        "vocab_lookup wte_: the model has no layer wte_"
    ]
    assert "vocab lookup: these lookups run on local tensors" in show_text(plan)
    assert "  wte  wte.weight" in show_text(plan)
    sequential = msgspec.structs.replace(plan.strategy, pp=2, schedule="sequential")
    pipelined = msgspec.structs.replace(plan, strategy=sequential)
    assert any(
        "does not run on local tensors with the sequential pipeline schedule" in p
        for p in vocab_lookup_problems(model, pipelined)
    )


#: A rank that trains a job (``harness.rank_main``), then applies each plan given to its model and
#: runs the lookup alone, forward and backward, for STEPS steps, recording the table every call of
#: Paddle's ``embedding`` op is handed (a DistTensor, which Paddle's rule gathers whole, or a plain
#: tensor of this rank's rows), lookup by lookup, in ``looked_up.rank<R>.json`` beside the job's
#: outputs: ``python -c LOOKUPS job.json workload plan layer [workload plan layer ...]``.
LOOKUPS = f"""
import json, sys
from pathlib import Path
import paddle, paddle.distributed as dist
from autodist import apply_plan
from harness.jobs import Job
from harness.rank_main import main, rank_and_world
from harness.workloads import WORKLOADS
main(sys.argv[1])
tables, embedding = [], paddle._C_ops.embedding
def recording(x, weight, *args, **kwargs):
    tables[-1].append([weight.is_dist(), list(weight._local_shape if weight.is_dist() else weight.shape)])
    return embedding(x, weight, *args, **kwargs)
paddle._C_ops.embedding = recording
args = sys.argv[2:]
for workload, plan, layer in zip(args[0::3], args[1::3], args[2::3]):
    tables.append([])
    model, _, _ = apply_plan(WORKLOADS[workload].build(seed=0), None, None, plan)
    lookup = dict(model.named_sublayers())[layer]
    for step in range({STEPS}):
        ids = paddle.randint(0, lookup.weight.shape[0], [4, 8])
        ids = dist.shard_tensor(ids, lookup.weight.process_mesh, [dist.Replicate()])
        lookup(ids).sum().backward()
Path(Job.load(sys.argv[1]).out_dir, f"looked_up.rank{{rank_and_world()[0]}}.json").write_text(json.dumps(tables))
"""


def _trained_and_probed(
    runs: list[TrainRun], probed: list[tuple[str, str, str]], workdir: Path
) -> tuple[dict[str, list[dict]], list[list[list]]]:
    """Train ``runs`` on 2 ranks, then probe the ``(workload, plan, layer)`` lookups (:data:`LOOKUPS`),
    in one launch: the runs' outputs, and each rank's ``[is a DistTensor, local shape]`` per call,
    lookup by lookup."""
    job = Job(out_dir=str(workdir / "out"), train=runs)
    Path(job.out_dir).mkdir(parents=True)
    args = [part for triple in probed for part in triple]
    launch_ranks(2, ["-c", LOOKUPS, str(job.save(workdir / "job.json")), *args], workdir, 600.0).raise_for_failure()
    tables = [json.loads((Path(job.out_dir) / f"looked_up.rank{r}.json").read_text()) for r in range(2)]
    return {run.name: read_outputs(job.out_dir, run.name, 2) for run in runs}, tables


@pytest.fixture(scope="module")
def trained(plans, tmp_path_factory, reference_runs):
    """Every model at mp2 and dp2 x mp2; gpt at mp2 with the global lookup; each model's lookup
    alone, probed (:data:`LOOKUPS`), under its local plan and (gpt) the global one. One launch
    per world size: the mp2 trainings with the probe, dp2 x mp2, and the references."""
    workdir = tmp_path_factory.mktemp("vocab_lookup")
    runs: dict[int, list[TrainRun]] = {1: [], 2: []}
    for (workload, dp), plan in plans.items():
        path = workdir / f"{workload}_dp{dp}.json"
        save_plan(plan, path)
        runs[dp].append(TrainRun(f"{workload}_dp{dp}_mp2", workload, plan=str(path), steps=STEPS))
    global_path = workdir / "gpt_global.json"
    save_plan(msgspec.structs.replace(plans["gpt", 1], vocab_lookup=[]), global_path)
    global_run = TrainRun("gpt_global_lookup", "gpt", plan=str(global_path), steps=STEPS)
    local = [(run.workload, str(run.plan), plans[run.workload, 1].vocab_lookup[0].layer) for run in runs[1]]
    outputs, probed = _trained_and_probed([*runs[1], global_run], [*local, ("gpt", str(global_path), "wte")], workdir)
    outputs |= train_by_world(
        [(run, 4) for run in runs[2]], workdir / "dp2_mp2", 600.0, references=(reference_runs, runs[1] + runs[2])
    )
    tables = {
        "local": [[call for lookup in rank[:-1] for call in lookup] for rank in probed],
        "global": [rank[-1] for rank in probed],
    }
    return {run.name: run for run in runs[1] + runs[2]}, outputs, tables


@pytest.mark.multiprocess
@pytest.mark.parametrize("workload", MODELS)
@pytest.mark.parametrize("dp", [1, 2])
def test_a_local_lookup_trains_like_one_device(trained, plans, reference_runs, workload, dp):
    runs, outputs, _ = trained
    name = f"{workload}_dp{dp}_mp2"
    check_against_reference(Trained(runs[name], plans[workload, dp], outputs[name]), reference_runs)


@pytest.mark.multiprocess
def test_the_table_is_gathered_by_the_global_lookup_and_never_by_the_local_one(trained, plans):
    """The global lookup hands Paddle's embedding op the split DistTensor table, which Paddle's rule gathers
    whole, forward and backward (measured with GLOG_vmodule=data_transform=4: 2 reshards of the
    [64, 32] table a step; docs/paddle-notes.md, "SPMD rules"); the local one hands it each rank's
    32 rows as a plain tensor, which no rule sees. (The log itself is not this test's probe: with
    it on, Paddle aborted now and then with "double free or corruption" or "corrupted size",
    depending on the environment, never without it.)"""
    _, outputs, tables = trained
    # the global lookup trains the same (it is today's path)
    assert outputs["gpt_global_lookup"][0]["losses"] == pytest.approx(outputs["gpt_dp1_mp2"][0]["losses"], rel=1e-5)
    assert tables["global"] == [[[True, [32, 32]]] * STEPS] * 2
    shapes = [plans[w, 1].params[plans[w, 1].vocab_lookup[0].weight].shape for w in MODELS]
    local = [[False, [rows // 2, width]] for rows, width in shapes for _ in range(STEPS)]
    assert tables["local"] == [local, local]
