"""Local views and the local vocabulary lookup under sequence parallelism (issue 31), composed
as Megatron-LM composes them.

HF Falcon (a fused multi-query ``query_key_value``, its attention a local view, its tied
``word_embeddings`` a vocabulary-split lookup) planned at mp2 with sequence parallelism: the
activations between sub-layers are split over the sequence, the norms run on those shards, each
sub-layer's pre hook all-gathers the sequence before the column, and the partial sum of each
local view and of the lookup is left Partial over mp for the post hook, whose reshard to the
sequence split is a reduce-scatter (not an all-reduce and a slice); backward, each view hands
its input gradient back Partial over mp to the pre hook, whose gather's backward reduce-scatters
it. On 2 gloo ranks (alone, with full recompute, with 2 micro-batches), and at dp2 x mp2 on 4
(AdamW, ZeRO 0 and 1): losses and parameters as one device. Where memory is short the search
chooses sequence parallelism with the views (priced as they run: ``runs_local_views`` holds
under it).

gloo has no reduce-scatter: the run takes the TEST-ONLY stand-in of harness/cpu_substitutes.py
(P->R->S, forward and backward), which also records each reduce-scatter it stands in for: one per
sub-layer and one for the lookup in every forward, one per gather in every backward. On a GPU the same plan runs Paddle's own
reduce-scatter, which this CPU test cannot reach.
"""

from __future__ import annotations

import msgspec
import pytest

from autodist.planner.cost.step_time import MEMORY_USABLE
from autodist.planner.driver import plan_target
from autodist.schemas import Plan, save_plan
from harness.cases import Trained, check_against_reference
from harness.jobs import TrainRun
from harness.planning import gloo_mp2_request
from harness.runner import train_by_world
from harness.workloads import WORKLOADS

WORKLOAD = "zoo_falcon_hf"
GPT2 = "zoo_gpt2_hf"
STEPS = 3


#: The trainings at mp2 with sequence parallelism, by name: (dp, the request's other fields, optimizer).
TRAININGS = {
    "mp2": (1, {}, "sgd"),
    "mp2_recompute_full": (1, {"recompute": "full"}, "sgd"),
    "mp2_m2": (1, {"micro_batches": 2}, "sgd"),
    "dp2_mp2": (2, {}, "adamw"),
    "dp2_mp2_zero1": (2, {"sharding_stage": 1}, "adamw"),
}


@pytest.fixture(scope="module")
def trained(tmp_path_factory, reference_runs) -> dict[str, Trained]:
    """Every training, one job per world size (2 and 4 ranks)."""
    workdir = tmp_path_factory.mktemp("local_view_sequence")
    target = WORKLOADS[WORKLOAD].planner_target
    plans, runs = {}, []
    for name, (dp, fields, optimizer) in TRAININGS.items():
        request = gloo_mp2_request(dp, sequence_parallel=True, **fields)
        plans[name] = plan_target(target, None, request, {"target": target}).plan
        save_plan(plans[name], workdir / f"{name}.json")
        path = str(workdir / f"{name}.json")
        runs.append((TrainRun(name, WORKLOAD, optimizer, plan=path, reshard="via_replicate"), 2 * dp))
    # GPT-2 adds a position embedding to the token embedding's output: split before the first block
    gpt2 = WORKLOADS[GPT2].planner_target
    plans["gpt2_mp2"] = plan_target(gpt2, None, gloo_mp2_request(1, sequence_parallel=True), {"target": gpt2}).plan
    save_plan(plans["gpt2_mp2"], workdir / "gpt2_mp2.json")
    runs.append((TrainRun("gpt2_mp2", GPT2, "sgd", plan=str(workdir / "gpt2_mp2.json"), reshard="via_replicate"), 2))
    everything = [run for run, _ in runs]
    outputs = train_by_world(runs, workdir, timeout_s=600.0, references=(reference_runs, everything))
    return {run.name: Trained(run, plans[run.name], outputs[run.name]) for run in everything}


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", list(TRAININGS))
def test_local_views_and_the_lookup_train_like_one_device_under_sequence_parallelism(trained, reference_runs, name):
    run = trained[name]
    dp, fields, _ = TRAININGS[name]
    strategy = run.plan.strategy
    assert (strategy.sequence_parallel, strategy.dp, strategy.mp) == (True, dp, 2)
    assert {field: getattr(strategy, field) for field in fields} == fields
    assert [v.layer for v in run.plan.local_view] == [f"transformer.h.{i}.self_attention" for i in (0, 1)]
    assert [lookup.layer for lookup in run.plan.vocab_lookup] == ["transformer.word_embeddings"]
    check_against_reference(run, reference_runs)


@pytest.mark.multiprocess
def test_an_embedding_added_to_a_position_embedding_is_split_before_the_first_block(trained, reference_runs):
    """HF GPT-2 adds ``wpe``'s output to ``wte``'s: split over the sequence after ``wte``, the sum
    met ``wpe``'s whole output ([8, 4, 32] + [1, 8, 32] on gloo). The plan splits at the first
    block's input instead, found by dataflow (emit._embedding_combined), and trains like one device."""
    run = trained["gpt2_mp2"]
    begins = [(h.layer, h.when) for h in run.plan.hooks if h.action == "sequence_parallel_begin"]
    assert begins[0] == ("transformer.h.0", "pre"), begins
    assert not any(layer == "transformer.wte" for layer, _ in begins), begins
    check_against_reference(run, reference_runs)


def _hooks(plan, kinds: set[tuple[str, str, str]]) -> list:
    """The plan's hooks of ``kinds``: ``(when, action, mp placement)``, the placement on mp of a
    reshard, ``""`` for the others."""
    mp = plan.mesh.axes.index("mp")
    return [h for h in plan.hooks if (h.when, h.action, h.placements[mp] if h.action == "reshard" else "") in kinds]


@pytest.mark.multiprocess
def test_each_partial_sum_is_reduce_scattered_to_the_sequence_split(trained):
    """At mp2: forward, every post hook that splits the sequence again (after the lookup, each attention
    and each MLP: 5 here) reshards a partial sum, Partial -> Shard: Megatron's reduce-scatter.
    Summing the views' and the lookup's outputs first would make 3 of them an all-reduce and a
    slice, which the stand-in does not count. Backward, every hook that gathers the sequence
    (before each attention and MLP, after the final norm: 5) gets a Partial gradient back and
    reduce-scatters it; a view that summed its input gradient itself, or a gather behind the
    hook's transpose, would leave an all-reduce and a slice instead."""
    trained = trained["mp2"]
    splits = _hooks(trained.plan, {("post", "sequence_parallel_begin", ""), ("post", "reshard", "S(0)")})
    gathers = _hooks(
        trained.plan,
        {("pre", "sequence_parallel_end", ""), ("pre", "reshard", "R"), ("post", "sequence_parallel_end", "")},
    )
    assert (len(splits), len(gathers)) == (5, 5)
    for output in trained.outputs:
        stood_in = [tuple(item) for item in output["stood_in"]]
        assert stood_in.count(("forward", "reduce_scatter")) == STEPS * len(splits), stood_in
        assert stood_in.count(("backward", "reduce_scatter")) == STEPS * len(gathers), stood_in
        assert len(stood_in) == STEPS * (len(splits) + len(gathers)), stood_in


def test_the_search_chooses_sequence_parallelism_with_local_views_where_memory_is_short():
    """Falcon at mp2, one micro-batch, sequence parallelism left to the search, on a device one
    byte short of the plain plan's memory: the search chooses sequence parallelism (its
    activations between sub-layers split over mp), priced and planned with the attentions as
    local views and the lookup on local tensors."""
    target = WORKLOADS[WORKLOAD].planner_target

    def chosen(**fields) -> Plan:
        return plan_target(target, None, gloo_mp2_request(micro_batches=1, **fields), {"target": target}).plan

    plain = chosen()
    assert not plain.strategy.sequence_parallel and plain.local_view
    usable = (plain.estimate.memory.total - 1) / MEMORY_USABLE
    short = msgspec.structs.replace(gloo_mp2_request().device, memory_bytes=int(usable))
    searched = chosen(sequence_parallel=None, device=short)
    assert searched.strategy.sequence_parallel, searched.strategy
    assert [v.layer for v in searched.local_view] == [v.layer for v in plain.local_view]
    assert [lookup.layer for lookup in searched.vocab_lookup] == ["transformer.word_embeddings"]
