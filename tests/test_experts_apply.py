"""Expert parallelism in apply_plan, in one process: who holds what, and what is refused before
anything changes. Training under it is tests/test_train_experts.py."""

from __future__ import annotations

import msgspec
import pytest

from autodist.applier.modes.expert_dispatch import ExpertLayout, dropped_parameters, expert_holders, held_experts
from autodist.applier.placement.validate import plan_problems
from autodist.planner.cost.hardware import PROFILES
from autodist.planner.cost.search import SearchRequest
from harness.planning import plan_target
from autodist.schemas import check_plan
from harness.workloads import WORKLOADS

MIXTRAL = "tests/models/zoo/mixtral_moe.py"


@pytest.fixture(scope="module")
def ep_plan():
    request = SearchRequest(devices_per_node=2, dp=2, mp=1, pp=1, ep=2, device=PROFILES["cpu"])
    return plan_target(MIXTRAL, None, request, {"target": MIXTRAL}).plan


def test_ep_groups_are_neighbouring_dp_ranks_at_one_mp_coordinate():
    # A dp4 x mp2 mesh: ranks [[0, 1], [2, 3], [4, 5], [6, 7]]; rank 5 is dp index 2, mp index 1.
    ids = [[0, 1], [2, 3], [4, 5], [6, 7]]
    layout = ExpertLayout.of(ids, ["dp", "mp"], rank=5, ep=2)
    assert layout == ExpertLayout(ep=2, index=0, group=[5, 7], replicas=[1, 5], dp=[1, 3, 5, 7])
    assert ExpertLayout.of(ids, ["dp", "mp"], rank=2, ep=4) == ExpertLayout(
        ep=4, index=1, group=[0, 2, 4, 6], replicas=[2], dp=[0, 2, 4, 6]
    )
    assert [held_experts(8, 4, i) for i in range(4)] == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]


def test_each_rank_drops_the_other_half_of_the_experts(ep_plan):
    # Written from the model: 2 layers x 4 experts x (w1, w2, w3); rank 0 keeps experts 0-1.
    dropped = dropped_parameters(ep_plan, rank=0)
    assert dropped == {
        f"layers.{layer}.block_sparse_moe.experts.{e}.{w}.weight"
        for layer in (0, 1)
        for e in (2, 3)
        for w in ("w1", "w2", "w3")
    }
    assert len(dropped_parameters(ep_plan, rank=1)) == 12 and not dropped & dropped_parameters(ep_plan, rank=1)


@pytest.mark.parametrize(
    "change, message",
    [
        (
            {"pp": 2, "schedule": "1F1B"},
            "strategy: ep=2 with pp=2: expert parallelism inside a pipeline is not built",
        ),
        (
            {"sharding_stage": 1},
            "strategy: ep=2 with sharding_stage=1: ZeRO over the dp group with expert parallelism is not built",
        ),
        (
            {"sequence_parallel": True},
            "strategy: ep=2 with sequence parallelism: sequence parallelism with expert parallelism is not built",
        ),
    ],
)
def test_strategies_expert_parallelism_does_not_run_with_are_refused(ep_plan, change, message):
    plan = msgspec.structs.replace(ep_plan, strategy=msgspec.structs.replace(ep_plan.strategy, **change))
    model = WORKLOADS["zoo_mixtral_moe"].build(seed=1)
    problems = plan_problems(model, None, None, plan, world_size=2)
    assert any(p.startswith(message) for p in problems), problems


def test_a_model_with_other_experts_is_refused_naming_the_container(ep_plan):
    model = WORKLOADS["zoo_mixtral_moe"].build(seed=1)
    experts = model.layers[1].block_sparse_moe.experts
    del experts._sub_layers["3"]  # three experts where the plan spreads four
    problems = plan_problems(model, None, None, ep_plan, world_size=2)
    assert (
        'experts: "layers.1.block_sparse_moe.experts" has 3 numbered sub-layers, the plan spreads 4 experts over ep ranks'
        in problems
    )


def test_each_expert_is_held_by_the_ranks_at_its_index_of_every_ep_group(ep_plan):
    # dp2 ep2: rank 0 holds experts 0-1, rank 1 experts 2-3 (written from the design).
    holders = expert_holders(ep_plan)
    assert sorted(holders) == sorted(dropped_parameters(ep_plan, rank=0) | dropped_parameters(ep_plan, rank=1))
    assert holders["layers.0.block_sparse_moe.experts.1.w2.weight"] == [0]
    assert holders["layers.1.block_sparse_moe.experts.2.w1.weight"] == [1]
    # dp4 ep2 on the same model: ranks 0 and 2 hold experts 0-1, ranks 1 and 3 experts 2-3.
    dp4 = msgspec.structs.replace(
        ep_plan,
        mesh=msgspec.structs.replace(ep_plan.mesh, shape=[4], process_ids=[0, 1, 2, 3]),
        strategy=msgspec.structs.replace(ep_plan.strategy, dp=4),
    )
    assert expert_holders(dp4)["layers.0.block_sparse_moe.experts.0.w3.weight"] == [0, 2]
    assert expert_holders(dp4)["layers.0.block_sparse_moe.experts.3.w3.weight"] == [1, 3]
    assert (
        expert_holders(msgspec.structs.replace(ep_plan, strategy=msgspec.structs.replace(ep_plan.strategy, ep=1))) == {}
    )


def test_a_shared_expert_is_named_in_the_dispatch_hook_and_checked():
    """Qwen2-MoE (tests/models/zoo/qwen2_moe_hf.py): every decoder layer's ``mlp`` is a sparse MoE
    block with ``experts`` and a ``shared_expert`` MLP beside them (its ``shared_expert_gate`` is
    a plain Linear, not an MLP): written from the model."""
    target = "tests/models/zoo/qwen2_moe_hf.py"
    request = SearchRequest(devices_per_node=2, dp=2, mp=1, pp=1, ep=2, device=PROFILES["cpu"])
    plan = plan_target(target, None, request, {"target": target}).plan
    dispatch = [h for h in plan.hooks if h.action == "expert_dispatch"]
    assert [(h.layer, h.experts, h.shared) for h in dispatch] == [
        (f"model.layers.{i}.mlp", f"model.layers.{i}.mlp.experts", [f"model.layers.{i}.mlp.shared_expert"])
        for i in range(2)
    ]
    assert check_plan(plan) == []
    wrong = msgspec.structs.replace(dispatch[0], shared=["model.layers.0.mlp.experts.1"])
    broken = msgspec.structs.replace(plan, hooks=[wrong if h is dispatch[0] else h for h in plan.hooks])
    index = plan.hooks.index(dispatch[0])
    assert check_plan(broken) == [
        f"$.hooks[{index}].shared[0]: 'model.layers.0.mlp.experts.1' is not inside 'model.layers.0.mlp' beside its experts"
    ]
    model = WORKLOADS["zoo_qwen2_moe_hf"].build(seed=1)
    del model.model.layers[1].mlp._sub_layers["shared_expert"]
    assert (
        'experts: no sub-layer "model.layers.1.mlp.shared_expert" in the model (a shared expert of model.layers.1.mlp)'
        in (plan_problems(model, None, None, plan, world_size=2))
    )
