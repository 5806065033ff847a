"""Expert parallelism trains like one device: the planner's ``--ep 2`` plans of the MoE zoo
models, applied on CPU ranks under gloo, give the single-device losses and parameters.

- dp2 ep2 (2 ranks): each rank holds half the experts of every MoE layer; SGD with global-norm
  clipping, under which a clip by the wrong norm shows at once (Paddle's own clip, left in
  charge, drifts by 3.5e-4 here: docs/paddle-notes.md, "Expert parallelism");
- dp2 ep2 with AdamW (weight decay, LR schedule, clipping), and with 2 micro-batches;
- dp2 ep2 built under ``autodist.LazyGuard``: the experts a rank drops are drawn all the same, so
  the ones it keeps start from the eager build's values;
- dp4 ep2 (4 ranks): two ep groups, each expert held by two ranks whose gradients are summed;
  Switch Transformers' top-1 router leaves an expert without tokens in both groups at some
  step, which must then get no gradient at all, as on one device (AdamW would otherwise move it);
- dp2 x mp2 ep2 (4 ranks): the planner's plan with tensor parallelism,
  the attention split over mp, each MoE layer run whole on both mp ranks of its ep group;
- dp2 x mp2 ep2 with local views (4 ranks): Ling's (BailingMoe) fused ``query_key_value``
  attention run on each mp rank with only its heads (the plan's ``local_view``, one all-reduce)
  while its MoE layers are dispatched over ep, its shared expert run by one rank per group
  (with SGD, AdamW over 2 micro-batches, full recompute); Mistral's reference Mixtral likewise.

Six spellings: Mixtral (a loop over every expert), Qwen3-MoE (HF's loop over only the experts
that got tokens), Switch Transformers (a LayerDict of ``expert_N``, boolean masks), Qwen2-MoE
(a shared expert beside the routed ones, behind a sigmoid gate: run by one rank of each group,
else the combine's sum would count it ep times: step-0 loss 4.534 vs 4.493 at dp2 ep2),
DeepSeek-V3 (group-limited sigmoid router, experts guarded by ``numel() > 0``) and Mistral's
reference Mixtral (``results[batch_idx] += ...``, its MoE layer called as
``self.feed_forward.forward(h)``, which passes by forward hooks: with the dispatch and combine as
hooks it trained to NaN at dp2 ep2).

The harness also checks the layout: every rank holds exactly the experts the design gives it
(tests/harness/compare.py, written independently of the applier).
The GPU test runs the same on NCCL.
"""

from __future__ import annotations

import pytest

from autodist.planner.cost.hardware import PROFILES
from autodist.planner.cost.search import SearchRequest
from harness.planning import plan_target
from autodist.schemas import save_plan
from harness.cases import Trained, check_against_reference
from harness.jobs import TrainRun
from harness.runner import train_distributed
from harness.workloads import BATCH, WORKLOADS

pytestmark = pytest.mark.multiprocess

#: MoE zoo workloads, trained under expert parallelism.
#: Not zoo_gshard_fairscale: its gate loss leaves the MoE layer as an attribute (fairscale's
#: ``moe.l_aux``), not through the expert_combine hook, and its gradient reaches the dispatch's
#: gather as a DistTensor (``ValueError: The input should be a local tensor`` in backward).
MOE = [
    "zoo_mixtral_moe",
    "zoo_qwen3_moe_hf",
    "zoo_switch_transformers_hf",
    "zoo_qwen2_moe_hf",
    "zoo_deepseek_v3_hf",
    "zoo_mixtral_mistral_ref",
]
#: (run name suffix, ranks, ep, optimizer, micro-batches, build, mp)
CONFIGS = [
    ("dp2_ep2_sgd_clip", 2, 2, "sgd_clip", 1, "eager", 1),
    ("dp2_ep2_adamw_mb2", 2, 2, "adamw", 2, "eager", 1),
    ("dp2_ep2_sgd_lazy", 2, 2, "sgd", 1, "autodist_lazy", 1),
    ("dp4_ep2_adamw", 4, 2, "adamw", 1, "eager", 1),
    # Data parallelism without ep: the MoE layers run on each rank's own tokens between the same
    # hooks (schemas/parallel_dims.py runs_moe_locally); without them Qwen3-MoE drifts from step 0
    # (4.6956 vs 4.5455 at dp2, 4.6956 vs 4.5455 at dp2 x mp2: Paddle indexes its dp-split expert
    # mask wrongly) and Switch raises.
    ("dp2_ep1_sgd_clip", 2, 1, "sgd_clip", 1, "eager", 1),
    ("dp2_mp2_ep1_sgd_clip", 4, 1, "sgd_clip", 1, "eager", 2),
]
#: dp2 x mp2 with ep2 (4 ranks): the attention split over mp, each MoE layer run whole on both
#: mp ranks of its ep group (shared experts run by one rank per group).
WITH_MP = ("dp2_mp2_ep2_sgd_clip", 4, 2, "sgd_clip", 1, "eager", 2)
CASES = [(workload, *config) for workload in MOE for config in [*CONFIGS, WITH_MP]]
#: Local views under expert parallelism: a MoE model whose attention projects q|k|v with one fused
#: Linear (a local-view candidate), planned with local views (the default of ``autodist-plan``).
#: With AdamW (weight decay, LR schedule, clipping) and 2 micro-batches: each micro-batch's forward
#: runs the views and the dispatch, the gradients add up before the expert sums. With full
#: recompute (a 9th field: the request's ``recompute``): each decoder layer, its view's all-reduce
#: and its MoE layer's gather and sum included, runs again in its backward.
LOCAL_VIEW_CASES = [
    ("zoo_bailing_moe_hf", "dp2_mp2_ep2_local_view_sgd_clip", 4, 2, "sgd_clip", 1, "eager", 2),
    ("zoo_bailing_moe_hf", "dp2_mp2_ep2_local_view_adamw_mb2", 4, 2, "adamw", 2, "eager", 2),
    ("zoo_bailing_moe_hf", "dp2_mp2_ep2_local_view_recompute_full", 4, 2, "sgd_clip", 1, "eager", 2, "full"),
    # its as_complex rotary has no SPMD rule, so its attention is split only as a local view; it
    # and the MoE layer are both called as ``.forward(...)``, by-passing forward hooks
    ("zoo_mixtral_mistral_ref", "dp2_mp2_ep2_local_view_sgd_clip", 4, 2, "sgd_clip", 1, "eager", 2),
]


def run_name(workload: str, suffix: str) -> str:
    return f"{workload}_{suffix}"


def ep_plan(
    workload: str,
    world: int,
    micro_batches: int,
    device: str,
    ep: int = 2,
    mp: int = 1,
    local_view: bool = False,
    recompute: str = "none",
):
    target = WORKLOADS[workload].planner_target
    request = SearchRequest(
        devices_per_node=world,
        dp=world // mp,
        mp=mp,
        pp=1,
        ep=ep,
        sequence_parallel=False,
        micro_batches=micro_batches,
        global_batch_size=BATCH,
        device=PROFILES[device],
        recompute=recompute,
    )
    return plan_target(target, None, request, {"target": target}, local_view=local_view).plan


def train_ep(
    tmp_path_factory, reference_runs, backend: str, device: str, cases=CASES, local_view_cases=()
) -> dict[str, Trained]:
    """Every case planned (``local_view_cases`` with local views), then trained: one job per
    world size for all of them, and one single-device job for their references."""
    workdir = tmp_path_factory.mktemp(f"experts_{backend}")
    by_world: dict[int, list[TrainRun]] = {}
    plans = {}
    planned = [(case, False) for case in cases] + [(case, True) for case in local_view_cases]
    for (workload, suffix, world, ep, optimizer, micro_batches, build, mp, *recompute), local_view in planned:
        name = run_name(workload, suffix)
        plan = ep_plan(workload, world, micro_batches, device, ep, mp, local_view, *recompute)
        assert (plan.strategy.ep, plan.strategy.mp, plan.strategy.micro_batches) == (ep, mp, micro_batches)
        assert [plan.strategy.recompute] == (recompute or ["none"])
        assert any(h.action == "expert_dispatch" for h in plan.hooks), plan.hooks
        assert bool(plan.local_view) == local_view, plan.local_view
        path = workdir / f"{name}.json"
        save_plan(plan, path)
        plans[name] = plan
        by_world.setdefault(world, []).append(
            TrainRun(name, workload, optimizer=optimizer, plan=str(path), build=build)
        )
    results = {}
    for world, runs in sorted(by_world.items()):
        outputs = train_distributed(runs, world, workdir / f"world{world}", timeout_s=600.0, backend=backend)
        results.update({run.name: Trained(run, plans[run.name], outputs[run.name]) for run in runs})
    reference_runs.prepare([t.run for t in results.values()])
    return results


@pytest.fixture(scope="module")
def trained(tmp_path_factory, reference_runs):
    """CASES and LOCAL_VIEW_CASES trained together: their 4-rank runs in one launch."""
    return train_ep(tmp_path_factory, reference_runs, "gloo", "cpu", CASES, LOCAL_VIEW_CASES)


@pytest.mark.parametrize("name", [run_name(w, suffix) for w, suffix, *_ in CASES])
def test_expert_parallel_training_equals_one_device(trained, reference_runs, name):
    check_against_reference(trained[name], reference_runs)


@pytest.mark.parametrize("name", [run_name(w, suffix) for w, suffix, *_ in LOCAL_VIEW_CASES])
def test_local_views_under_expert_parallelism_train_as_one_device(trained, reference_runs, name):
    run = trained[name]
    check_against_reference(run, reference_runs)
    for output in run.outputs:  # the views ran: each rank scored 2 of the 4 heads (gathered: all 4)
        assert output["score_shapes"] and {s[1] for s in output["score_shapes"]} == {2}, output["score_shapes"]


def test_local_views_and_expert_hooks_in_one_plan(trained):
    """Written from the model (hidden 48, 4 query heads and 2 key/value heads of 12, so
    ``query_key_value`` is 48 x 96 = q 48 | k 24 | v 24; 6 experts, one shared): at dp2 x mp2 ep2
    each attention is a local view with 2 query heads and 1 key/value head per mp rank (its weight
    48 x 48 there, 24 | 12 | 12), its ``dense`` 24 rows; each MoE layer is dispatched over ep, whole
    on both mp ranks, ranks 0, 1 (dp 0) holding experts 0-2 and ranks 2, 3 (dp 1) experts 3-5."""
    run = trained[run_name(*LOCAL_VIEW_CASES[0][:2])]
    plan, attention, moe = run.plan, "model.layers.1.attention", "model.layers.1.mlp"
    view = next(v for v in plan.local_view if v.layer == attention)
    assert {(a.name, a.whole, a.local) for a in view.attributes} >= {("num_heads", 4, 2), ("num_key_value_heads", 2, 1)}
    qkv = next(w for w in view.weights if w.param == f"{attention}.query_key_value.weight")
    assert (qkv.dim, qkv.sizes) == (1, [48, 24, 24])
    hooks = {(h.action, h.layer) for h in plan.hooks}
    assert {("expert_dispatch", moe), ("expert_combine", moe)} <= hooks
    assert not any(h.layer.startswith(attention) for h in plan.hooks)  # no gather of q|k|v: the view computes locally
    for output in run.outputs:
        layout = output["layout"]
        assert layout[f"{attention}.query_key_value.weight"]["local_shape"] == [48, 48]
        assert layout[f"{attention}.dense.weight"]["local_shape"] == [24, 48]
        held = {f.split(".experts.")[1].split(".")[0] for f in layout if f.startswith(moe + ".experts.")}
        assert held == ({"0", "1", "2"} if output["rank"] < 2 else {"3", "4", "5"}), (output["rank"], held)
        assert layout[f"{moe}.shared_experts.up_proj.weight"]["local_shape"] == [48, 20]


def test_each_rank_holds_only_its_experts(trained):
    """Written from the model (4 experts per layer, ep2): dp index 0 of each group holds experts
    0-1, index 1 experts 2-3, whole (their local shapes are the full ones)."""
    run = trained[run_name("zoo_mixtral_moe", "dp4_ep2_adamw")]
    for output in run.outputs:
        held = {f.split(".")[4] for f in output["layout"] if ".experts." in f and f.startswith("layers.0.")}
        assert held == ({"0", "1"} if output["rank"] % 2 == 0 else {"2", "3"}), (output["rank"], held)
        assert output["layout"][
            "layers.0.block_sparse_moe.experts.0.w1.weight"
            if output["rank"] % 2 == 0
            else "layers.0.block_sparse_moe.experts.2.w1.weight"
        ]["local_shape"] == [32, 64]


@pytest.mark.parametrize(
    "workload, moe, attention",
    [
        ("zoo_mixtral_moe", "layers.0.block_sparse_moe", "layers.0.self_attn"),
        ("zoo_qwen2_moe_hf", "model.layers.0.mlp", "model.layers.0.self_attn"),
    ],
)
def test_with_mp_the_attention_is_split_and_the_moe_layers_run_whole(trained, workload, moe, attention):
    """Written from the models (hidden 32, q_proj 32 x 32, four experts per layer): at dp2 x mp2
    each rank holds half of q_proj's columns and o_proj's rows, and everything under the MoE
    layer whole (placements R on both mesh axes), its experts those of its dp index (ranks 0, 1:
    dp 0, experts 0-1; ranks 2, 3: dp 1, experts 2-3)."""
    run = trained[run_name(workload, WITH_MP[0])]
    plan = run.plan
    assert plan.mesh.axes == ["dp", "mp"]
    assert plan.params[f"{attention}.q_proj.weight"].placements == ["R", "S(1)"]
    assert plan.params[f"{attention}.o_proj.weight"].placements == ["R", "S(0)"]
    assert {tuple(p.placements) for fqn, p in plan.params.items() if fqn.startswith(moe + ".")} == {("R", "R")}
    for output in run.outputs:
        layout = output["layout"]
        assert layout[f"{attention}.q_proj.weight"]["local_shape"] == [32, 16]
        assert layout[f"{attention}.o_proj.weight"]["local_shape"] == [16, 32]
        held = {f.split(".experts.")[1].split(".")[0] for f in layout if f.startswith(moe + ".experts.")}
        assert held == ({"0", "1"} if output["rank"] < 2 else {"2", "3"}), (output["rank"], held)
        whole = [f for f in layout if f.startswith(moe + ".")]
        assert all(layout[f]["local_shape"] == plan.params[f].shape for f in whole), output["rank"]


@pytest.mark.gpu
def test_expert_parallel_training_on_nccl(tmp_path_factory, reference_runs):
    """The same runs with NCCL on GPUs (the plan made for an H100 profile)."""
    for name, run in train_ep(tmp_path_factory, reference_runs, backend="nccl", device="h100-sxm").items():
        check_against_reference(run, reference_runs)
