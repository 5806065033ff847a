"""Local views and the local vocabulary lookup under ZeRO stage 3 (issue 31): GPT-2 (a fused
q|k|v held rank by rank) and HF Falcon (a multi-query q|k|v held whole over mp), each with its
tied token table looked up on local tensors, planned at dp2 x mp2 with ZeRO 3.

ZeRO 3 splits every parameter over dp, the local slices too: a view's weights and the lookup's
rows are gathered over dp for the call (``applier/modes/local_calls._GatheredOverDp``), and their
gradients come back Partial over dp for the optimizer's ZeRO-3 hook to reduce-scatter, as it
does those of the parameters read in the global view (the tied LM head's, added to the
lookup's). On 4 gloo ranks with AdamW: losses and parameters as one device, the views' weight
matrices and the tables split over dp while training. gloo has no reduce-scatter: the run takes the
TEST-ONLY stand-in of harness/cpu_substitutes.py (P->R->S).
"""

from __future__ import annotations

import pytest

from autodist.planner.driver import plan_target
from autodist.schemas import save_plan
from harness.cases import Trained, check_against_reference
from harness.jobs import TrainRun
from harness.planning import gloo_mp2_request
from harness.runner import train_by_world
from harness.workloads import WORKLOADS

#: workload -> (its local-view sub-layers, its token table)
WORKLOADS_VIEWED = {
    "zoo_gpt2_hf": ([f"transformer.h.{i}.attn" for i in (0, 1)], "transformer.wte"),
    "zoo_falcon_hf": ([f"transformer.h.{i}.self_attention" for i in (0, 1)], "transformer.word_embeddings"),
}


@pytest.fixture(scope="module")
def trained(tmp_path_factory, reference_runs) -> dict[str, Trained]:
    workdir = tmp_path_factory.mktemp("local_view_zero3")
    plans, runs = {}, []
    for workload in WORKLOADS_VIEWED:
        target = WORKLOADS[workload].planner_target
        plans[workload] = plan_target(target, None, gloo_mp2_request(2, sharding_stage=3), {"target": target}).plan
        save_plan(plans[workload], workdir / f"{workload}.json")
        path = str(workdir / f"{workload}.json")
        runs.append(TrainRun(f"{workload}_zero3", workload, "adamw", plan=path, reshard="via_replicate"))
    outputs = train_by_world([(run, 4) for run in runs], workdir, timeout_s=600.0, references=(reference_runs, runs))
    return {run.workload: Trained(run, plans[run.workload], outputs[run.name]) for run in runs}


@pytest.mark.multiprocess
@pytest.mark.parametrize("workload", list(WORKLOADS_VIEWED))
def test_local_views_and_the_lookup_train_like_one_device_under_zero3(trained, reference_runs, workload):
    run = trained[workload]
    views, table = WORKLOADS_VIEWED[workload]
    assert (run.plan.strategy.dp, run.plan.strategy.mp, run.plan.strategy.sharding_stage) == (2, 2, 3)
    assert [view.layer for view in run.plan.local_view] == views
    assert [lookup.layer for lookup in run.plan.vocab_lookup] == [table]
    check_against_reference(run, reference_runs)
    dp = run.plan.mesh.axes.index("dp")
    # (a 1-D bias split over mp has no dim left for dp: Paddle's ZeRO 3 keeps it whole over dp)
    held = [w.param for view in run.plan.local_view for w in view.weights if len(run.plan.params[w.param].shape) == 2]
    held.append(f"{table}.weight")
    for output in run.outputs:
        split = {fqn: output["layout"][fqn]["placements"][dp] for fqn in held}
        assert all(p.startswith("Shard") for p in split.values()), split
