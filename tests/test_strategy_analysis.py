"""One analysis per way a strategy runs the model (planner/cost/strategy_analysis.py): built once
for a whole plan run, by one owner, and the one the search priced is the one emit placed.

Falcon's fused ``query_key_value`` attention is a local-view candidate (local views run under mp
alone or with dp, not at mp 1); Qwen2-MoE's MoE layers run whole under dp (without ZeRO or sequence
parallelism) and not under ZeRO: between them every field of ``RunsAs`` takes both values in one
search. At dp2 x mp2 the MoE layers' projections would be split over mp in the traced analysis,
whole in the one emit must place.
"""

from __future__ import annotations

import pytest

from autodist.planner.cost.hardware import PROFILES
from autodist.planner.cost.search import SearchRequest
from autodist.planner.cost.strategy_analysis import RunsAs
from autodist.planner.recognise import analysis as recognise_analysis
from harness.planning import gloo_mp2_request, plan_target

FALCON = "tests/models/zoo/falcon_hf.py"
QWEN2_MOE = "tests/models/zoo/qwen2_moe_hf.py"
XLM = "tests/models/zoo/xlm_hf.py"


@pytest.mark.parametrize("target", [FALCON, QWEN2_MOE])
def test_each_way_of_running_is_analysed_once_for_a_whole_plan(target, monkeypatch):
    calls: list[str] = []
    for name in ("with_local_views", "experts_whole"):  # the two rewrites of the traced analysis
        rewrite = getattr(recognise_analysis, name)
        monkeypatch.setattr(recognise_analysis, name, lambda *args, _f=rewrite, _n=name: calls.append(_n) or _f(*args))
    request = SearchRequest(devices_per_node=4, device=PROFILES["h100-sxm"])
    made = plan_target(target, None, request, {"target": target}, local_view=True)
    priced = made.priced
    assert priced is not None and priced.analysis_for is not None
    built = priced.analysis_for.builds
    # many strategies, few ways of running them; each analysed once, and only there
    assert made.result.evaluated > len(built) > 1
    assert set(built.values()) == {1}
    assert calls.count("with_local_views") == len(built)
    assert calls.count("experts_whole") == sum(runs.moe_whole for runs in built)
    # both fields vary: Falcon's local views, Qwen2-MoE's MoE layers
    varying = {runs.local for runs in built} if target == FALCON else {runs.moe_whole for runs in built}
    assert len(varying) == 2
    assert RunsAs() in built  # the model as traced: the search's checks of the request
    best, proven = made.plan.strategy, frozenset(view.layer for view in made.plan.local_view)
    assert priced.runs_as(best, proven) == priced.runs_as(best) in built  # emit's: no build of its own


def test_emit_places_the_analysis_the_search_priced():
    # XLM masks its scores by masked_fill (no SPMD rule): the traced analysis leaves its attention
    # replicated (stopped); at dp2 x mp2 the sub-layer runs as a local view, which splits it. The
    # search priced it split, and emit places that same analysis: q, k, v by columns, o by rows.
    made = plan_target(XLM, None, gloo_mp2_request(2), {"target": XLM}, local_view=True)
    assert made.priced is not None
    views = frozenset(view.layer for view in made.plan.local_view)
    assert views == {"transformer.attentions.0", "transformer.attentions.1"}
    placed = made.priced.analysis_of(made.plan.strategy, views)
    assert placed is made.priced.analysis_for(made.priced.runs_as(made.plan.strategy))
    traced = {lin.weight for block in made.analysis.blocks for lin in block.linears}
    runs = {lin.weight for block in placed.blocks for lin in block.linears}
    split = {fqn for fqn, p in made.plan.params.items() if any(x.startswith("S(") for x in p.placements)}
    assert {w for w in runs - traced if ".attentions." in w} == {
        f"transformer.attentions.{i}.{name}.weight" for i in (0, 1) for name in ("q_lin", "k_lin", "v_lin", "out_lin")
    }
    assert runs <= split
