"""A local view whose row projection is a layer beside it (``LocalView.output`` ``joined``).

HF DeBERTa-v2 (the zoo's ``deberta_v2_hf``) keeps q, k and v in ``attention.self`` and its row
projection in a sibling, ``attention.output.dense`` (BERT's ``SelfOutput``, which also adds the
residual and runs LayerNorm). Its disentangled attention folds the heads into the batch
(``[batch * heads, seq, head_dim]``, ``bmm``), a split no placement of Paddle's global view names,
and projects the encoder's relative-position table by the layer's own ``query_proj`` and
``key_proj`` (``share_att_key``), ``repeat``ed over the batch. Planned at mp2, ``attention.self``
is a proven local view: each rank runs it on its heads and hands back its heads of the context
(a slice of the last dim), and the row projection's ``S(0)`` weight makes Paddle's partial sum and
all-reduce in the global view. On 2 gloo ranks it trains like one device, and so it does with
micro-batches, full and selective recompute, and on 4 ranks at dp2 x mp2 (ZeRO 1 too).
"""

from __future__ import annotations

import functools

import msgspec
import pytest

from autodist.schemas import Plan, save_plan
from harness.cases import Trained, check_against_reference
from harness.jobs import TrainRun
from harness.planning import gloo_mp2_request, plan_target
from harness.runner import train_by_world
from harness.workloads import WORKLOADS

WORKLOAD = "zoo_deberta_v2_hf"
#: The model's 2 layers, each ``attention.self`` a view; its attention is 40 wide (4 heads of 10).
VIEWS = [f"deberta.encoder.layer.{i}.attention.self" for i in (0, 1)]
WIDTH = 40


#: The trainings, ``name -> (dp, request fields, run fields)``: the mp2 plan, and the views composed
#: with micro-batches, full and selective recompute (of layers returning ``(hidden, None)``; the
#: attention selective recompute lists is ``attention``, holding the view and its row projection),
#: data parallelism (the relative-position table's gradient, each dp rank's from its own rows,
#: summed over dp as well as mp) and ZeRO 1.
TRAININGS: dict[str, tuple[int, dict, dict]] = {
    "mp2": (1, {}, {}),
    "m2": (1, {"micro_batches": 2}, {}),
    "recompute_full": (1, {"recompute": "full"}, {}),
    "recompute_selective": (1, {"recompute": "selective"}, {}),
    "dp2": (2, {}, {}),
    "dp2_zero1": (2, {"sharding_stage": 1}, {"optimizer": "adamw", "reshard": "via_replicate"}),
}


@functools.cache
def _planned(name: str) -> Plan:
    dp, fields, _ = TRAININGS[name]
    target = WORKLOADS[WORKLOAD].planner_target
    return plan_target(target, None, gloo_mp2_request(dp, **fields), {"target": target}, local_view=True).plan


@pytest.fixture(scope="module")
def planned() -> Plan:
    return _planned("mp2")


@pytest.fixture(scope="module")
def trained(tmp_path_factory, reference_runs) -> dict[str, Trained]:
    """Every training of :data:`TRAININGS`, one launch per world size."""
    workdir = tmp_path_factory.mktemp("joined")
    runs = []
    for name, (dp, _, fields) in TRAININGS.items():
        save_plan(_planned(name), workdir / f"{name}.json")
        runs.append((TrainRun(f"deberta_v2_{name}", WORKLOAD, plan=str(workdir / f"{name}.json"), **fields), 2 * dp))
    outputs = train_by_world(runs, workdir, timeout_s=600.0, references=(reference_runs, [r for r, _ in runs]))
    return {name: Trained(run, _planned(name), outputs[run.name]) for name, (run, _) in zip(TRAININGS, runs)}


def test_the_attention_beside_its_row_projection_is_a_joined_local_view(planned):
    views = {view.layer: view for view in planned.local_view}
    assert sorted(views) == VIEWS
    view = views[VIEWS[0]]
    assert view.output == "joined"
    # its weights are q, k and v (split by columns); the row projection runs in the global view
    assert sorted(w.param.rpartition(".")[0].rpartition(".")[2] for w in view.weights) == [
        *["key_proj"] * 2,
        *["query_proj"] * 2,
        *["value_proj"] * 2,
    ]
    assert [a.name for a in view.attributes] == ["num_attention_heads"]
    # the relative-position table enters whole, its gradient summed over mp
    assert [c.gradient for c in view.call if c.keyword == "rel_embeddings"] == ["whole"]
    assert "joined along the last dim" in view.verified
    mp = planned.mesh.axes.index("mp")
    placed = {fqn: p.placements[mp] for fqn, p in planned.params.items()}
    assert placed[f"{VIEWS[0]}.query_proj.weight"] == "S(1)"
    assert placed["deberta.encoder.layer.0.attention.output.dense.weight"] == "S(0)"
    assert placed["deberta.encoder.layer.0.attention.output.dense.bias"] == "R"
    assert placed["deberta.encoder.rel_embeddings.weight"] == "R"


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", list(TRAININGS))
def test_deberta_v2_trains_like_one_device_with_half_the_heads_on_each_rank(trained, reference_runs, name):
    """Losses and parameters as one device; each rank's row projection reads half the width, the
    columns the whole input."""
    run = trained[name]
    assert [view.output for view in run.plan.local_view] == ["joined", "joined"]
    check_against_reference(run, reference_runs)
    for output in run.outputs:
        widths = output["linear_input_widths"]
        assert [widths[f"deberta.encoder.layer.{i}.attention.output.dense"] for i in (0, 1)] == [[WIDTH // 2]] * 2
        assert widths["deberta.encoder.layer.0.attention.self.query_proj"] == [WIDTH]


def test_a_joined_view_under_sequence_parallelism_is_refused_before_training(planned):
    """No sequence-parallel hooks around a view and its sibling row projection are built: the
    planner keeps such a view replicated there (priced so, one note), and a plan asking for it
    is refused in one line."""
    from autodist.applier.modes.local_calls import JOINED_UNDER_SEQUENCE_PARALLEL, local_view_problems
    from autodist.planner.cost.search import SearchRequest
    from tests.models.zoo.deberta_v2_hf import build_model

    target = WORKLOADS[WORKLOAD].planner_target
    request = SearchRequest(devices_per_node=2, dp=1, mp=2, pp=1, sequence_parallel=True)
    sequence_parallel = plan_target(target, None, request, {"target": target}, local_view=True).plan
    assert sequence_parallel.strategy.sequence_parallel and sequence_parallel.local_view == []
    assert [n for n in sequence_parallel.notes if JOINED_UNDER_SEQUENCE_PARALLEL in n]
    model = build_model()
    assert local_view_problems(model, planned) == []
    parallel = msgspec.structs.replace(
        planned, strategy=msgspec.structs.replace(planned.strategy, sequence_parallel=True)
    )
    assert local_view_problems(model, parallel) == [
        f"local_view {layer}: {JOINED_UNDER_SEQUENCE_PARALLEL}" for layer in VIEWS
    ]


def test_the_search_prices_a_joined_view_replicated_under_sequence_parallelism():
    """What is priced is what runs: the view where it runs (mp2), replicated with sequence
    parallelism (its layer's q, k and v whole), so the search weighs the two as apply_plan runs them."""
    from autodist.planner import driver
    from autodist.planner.cost.search import price
    from autodist.schemas import Strategy

    loaded = driver.load(WORKLOADS[WORKLOAD].planner_target, None)
    priced = price(driver.analyse(loaded.model, driver.trace(loaded.model, loaded.input_specs)), local_view=True)
    assert priced.assumed_local(Strategy(mp=2)) == frozenset(VIEWS)
    assert priced.assumed_local(Strategy(mp=2, sequence_parallel=True)) == frozenset()


def test_show_says_the_view_hands_its_heads_to_the_row_projection(planned):
    from autodist.planner.review.show import show_text

    assert "self.num_attention_heads 4->2; output joined: each rank's heads to the row projection beside it" in (
        show_text(planned)
    )
