"""Which ranks hold the same piece of each parameter (applier/placement/replicas.py), the groups apply_plan
copies the first rank's values over. Runs of it: tests/loops/test_loops.py, loop (g)."""

from __future__ import annotations

import msgspec
import pytest
from harness.plans import tensor_parallel_plan
from harness.workloads import WORKLOADS

from autodist.applier.placement.replicas import replica_groups


@pytest.fixture(scope="module")
def llama():
    return WORKLOADS["docstring_llama"].build(seed=1)


def test_dp2_x_mp2_a_replicated_parameter_is_one_group_a_split_one_a_group_per_piece(llama):
    groups = replica_groups(tensor_parallel_plan(llama, dp=2, mp=2))  # mesh [[0, 1], [2, 3]]: dp x mp
    assert groups["norm.weight"] == [[0, 1, 2, 3]]
    assert groups["layers.0.self_attn.q_proj.weight"] == [[0, 2], [1, 3]]  # S(1) over mp: replicas over dp
    assert groups["layers.0.mlp.down_proj.weight"] == [[0, 2], [1, 3]]


def test_mp2_alone_leaves_a_split_parameter_to_each_rank(llama):
    groups = replica_groups(tensor_parallel_plan(llama, mp=2))
    assert "layers.0.self_attn.q_proj.weight" not in groups  # each rank its own piece: nothing to copy
    assert groups["norm.weight"] == [[0, 1]]


def test_pipeline_stages_copy_within_their_stage_and_a_tied_weight_across_stages(llama):
    plan = tensor_parallel_plan(llama, pp=2, dp=2, mp=2)  # stage 0: ranks 0-3, stage 1: ranks 4-7
    groups = replica_groups(plan)
    assert groups["layers.0.input_layernorm.weight"] == [[0, 1, 2, 3]]
    assert groups["layers.1.self_attn.q_proj.weight"] == [[4, 6], [5, 7]]
    embed = plan.params["embed_tokens.weight"]
    plan.params["embed_tokens.weight"] = msgspec.structs.replace(
        embed, placements=["R", "R", "S(0)"], tied_to=["lm_head.weight"], tied_stages={"lm_head.weight": 1}
    )
    # The copy on stage 1 is the same value: each vocabulary half is one group over both stages.
    assert replica_groups(plan)["embed_tokens.weight"] == [[0, 2, 4, 6], [1, 3, 5, 7]]
