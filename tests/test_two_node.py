"""A simulated two-node job: two ``python -m paddle.distributed.launch`` processes (``--nnodes 2
--nproc_per_node 2 --master 127.0.0.1:PORT --rank 0|1``) form one 4-rank world, apply the plan
``autodist-plan --nodes 2 --devices 2 --dp 2 --mp 2`` made (mp inside each node, dp across
them) and train like one device."""

from __future__ import annotations

import pytest

from harness.cases import Config, check_against_reference, train_configurations

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]


def test_two_nodes_dp2_mp2_match_single_device(tmp_path, reference_runs):
    config = Config(dp=2, mp=2, optimizer="adamw", plan_source="planner")
    trained = train_configurations("docstring_llama", [config], tmp_path, nodes=2)[config.name]
    assert (trained.plan.cluster.nodes, trained.plan.cluster.devices_per_node) == (2, 2)
    assert trained.plan.mesh.process_ids == [0, 1, 2, 3] and trained.plan.mesh.axes == ["dp", "mp"]
    assert [out["world"] for out in trained.outputs] == [4, 4, 4, 4]
    check_against_reference(trained, reference_runs)
