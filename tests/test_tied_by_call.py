"""Weights tied by a function call are ties (issue #21, item 4).

nanoGPT's head is ``paddle.matmul(x, self.transformer["wte"].weight, transpose_y=True)``; others
write ``F.linear(x, self.wte.weight.T)`` or read the head's weight for the embedding,
``F.embedding(idx, self.lm_head.weight.T)`` (tests/models/zoo/nanogpt.py, tests/models/tied_by_call.py).
There is one Parameter under one name, so only the trace shows the tie: the parameter feeds ops
in two layers. Under a pipeline the weight is read on the first and the last stage; the last
stage holds a copy and the schedule sums the two gradients, as for a tie by name. Before this,
the plan said ``"tied_stages": {}`` and the 1F1B run failed on stage 1 with ``Input
embedding_0.w_0.dist has different mesh``.
"""

from __future__ import annotations

import numpy as np
import pytest

from autodist.planner.cost.search import SearchRequest
from autodist.planner.driver import plan_target
from autodist.planner.errors import PlannerError
from harness.cases import Config, check_against_reference, train_planned
from harness.workloads import TIED_BY_CALL, WORKLOADS

#: target -> (the tied weight, the layers whose ops read it)
TIES = {
    "tests/models/zoo/nanogpt.py": ("transformer.wte.weight", ["", "transformer.wte"]),
    "tests/models/tied_by_call.py:build_linear_head": ("wte.weight", ["", "wte"]),
    "tests/models/tied_by_call.py:build_embedding_from_head": ("lm_head.weight", ["", "lm_head"]),
}


def _plan(target: str, **request):
    return plan_target(target, None, SearchRequest(devices_per_node=2, **request), {"target": target})


@pytest.mark.parametrize("target", TIED_BY_CALL)
def test_the_trace_finds_the_tie_and_a_pipeline_copies_it_to_the_last_stage(target):
    weight, layers = TIES[target]
    made = _plan(target, pp=2, schedule="1F1B", micro_batches=2, global_batch_size=4)
    owner = weight.rpartition(".")[0]
    assert sorted({owner, *made.analysis.read_by[weight]}) == layers
    assert made.plan.params[weight].stage == 0
    assert made.plan.params[weight].tied_stages == {weight: 1}
    assert any(note.startswith(f"{weight} is read before the blocks and after them") for note in made.plan.notes)


#: target -> the tied weight's vocabulary-parallel placement at mp2: ``wte.weight`` is ``[vocab,
#: hidden]`` (S(0)), ``lm_head.weight`` a Paddle Linear's ``[hidden, vocab]`` (S(1)), whichever of
#: the two layers reads the other's weight.
VOCAB_SPLIT = {
    "tests/models/tied_by_call.py:build_linear_head": ("wte.weight", "S(0)"),
    "tests/models/tied_by_call.py:build_embedding_from_head": ("lm_head.weight", "S(1)"),
}


@pytest.mark.parametrize("target", sorted(VOCAB_SPLIT))
def test_the_tied_weight_is_split_over_the_vocabulary_at_mp2(target):
    """One placement serves the lookup and the head, checked by Paddle's SPMD rules: before,
    ``F.embedding(idx, self.lm_head.weight.T)`` was no token embedding, so the vocabulary was
    unknown, the head unrecognised and its weight replicated ("layer lm_head: no pattern
    matched it")."""
    weight, placement = VOCAB_SPLIT[target]
    made = _plan(target, mp=2)
    assert made.plan.params[weight].placements == [placement]
    assert made.analysis.vocab_size == 64
    assert not [note for note in made.plan.notes if "no pattern matched" in note]
    assert not made.analysis.unmatched


def test_a_split_serving_only_one_use_is_refused_by_the_spmd_rules():
    """The check can fail: ``lm_head.weight`` split on its hidden dim leaves the lookup's output
    split on the hidden features and the head's logits a partial sum; neither is vocabulary-parallel."""
    from autodist.planner.recognise.reshards import vocab_parallel_problems

    analysis = _plan("tests/models/tied_by_call.py:build_embedding_from_head", mp=2).analysis
    assert vocab_parallel_problems(analysis, {"lm_head.weight": 1}, 2) == {"lm_head.weight": []}
    problems = vocab_parallel_problems(analysis, {"lm_head.weight": 0}, 2)["lm_head.weight"]
    assert [p.split(":")[0] for p in problems] == ["embedding in ''", "matmul in 'lm_head'"]


def test_without_a_pipeline_the_tie_needs_no_copy():
    made = _plan("tests/models/zoo/nanogpt.py", pp=1, dp=2)
    assert made.plan.params["transformer.wte.weight"].tied_stages == {}


def test_sequential_is_never_chosen_for_a_tie_by_call():
    """Only 1F1B / VPP keep the two copies equal: with one micro-batch (no pipelining schedule
    runs) pp2 is refused, with the reason, instead of falling back to sequential."""
    with pytest.raises(PlannerError) as refused:
        _plan("tests/models/tied_by_call.py:build_embedding_from_head", pp=2, micro_batches=1, global_batch_size=4)
    assert "a weight tied across stages needs the 1F1B or VPP schedule" in refused.value.detail


ONE_F_ONE_B = Config(pp=2, schedule="1F1B", micro_batches=2, p2p="blocking", plan_source="planner")


@pytest.fixture(scope="module")
def trained(tmp_path_factory, reference_runs):
    cases = [(WORKLOADS[name].name, ONE_F_ONE_B) for name in WORKLOADS if name.startswith("tied_by_call_")]
    results = train_planned(cases, tmp_path_factory.mktemp("tied_by_call"))
    reference_runs.prepare([t.run for t in results.values()])
    return results


@pytest.mark.multiprocess
@pytest.mark.parametrize("workload", [name for name in WORKLOADS if name.startswith("tied_by_call_")])
def test_a_tie_by_call_trains_under_1f1b_like_one_device(trained, reference_runs, workload):
    """pp2 1F1B on 2 gloo ranks (TEST-ONLY blocking P2P, harness/cpu_substitutes.py): losses and
    parameters equal the single device's, the copy on stage 1 included."""
    result = trained[workload]
    check_against_reference(result, reference_runs)
    weight = next(fqn for fqn, p in result.plan.params.items() if fqn in p.tied_stages)
    first, last = result.outputs
    assert first["layout"][weight]["mesh"] == [0] and last["layout"][weight]["mesh"] == [1]
    np.testing.assert_allclose(first["params"][weight], last["params"][weight], atol=1e-6)


MP2 = Config(mp=2, plan_source="planner")


@pytest.fixture(scope="module")
def trained_mp2(tmp_path_factory, reference_runs):
    cases = [(name, MP2) for name in WORKLOADS if name.startswith("tied_by_call_")]
    results = train_planned(cases, tmp_path_factory.mktemp("tied_by_call_mp2"))
    reference_runs.prepare([t.run for t in results.values()])
    return results


@pytest.mark.multiprocess
@pytest.mark.parametrize("workload", [name for name in WORKLOADS if name.startswith("tied_by_call_")])
def test_a_tie_by_call_trains_under_mp2_like_one_device(trained_mp2, reference_runs, workload):
    """The one tied weight gets one placement, which serves both its uses (the lookup and the
    head) under tensor parallelism: mp2 on 2 gloo ranks trains to the single-device losses."""
    check_against_reference(trained_mp2[workload], reference_runs)
