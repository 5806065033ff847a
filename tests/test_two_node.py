"""A simulated two-node job: two ``python -m paddle.distributed.launch`` processes (``--nnodes 2
--nproc_per_node 2 --master 127.0.0.1:PORT --rank 0|1``) form one 4-rank world, apply a plan
made for 2 nodes x 2 devices (dp across the nodes, mp inside each) and train like one device."""

from __future__ import annotations

import pytest

from harness.cases import Config, check_against_reference, train_configurations

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]


def test_two_nodes_dp2_mp2_match_single_device(tmp_path, reference_runs):
    trained = train_configurations("docstring_llama", [Config(dp=2, mp=2, optimizer="adamw")], tmp_path, nodes=2)["dp2_mp2_adamw"]
    assert (trained.plan.cluster.nodes, trained.plan.cluster.devices_per_node) == (2, 2)
    assert [out["world"] for out in trained.outputs] == [4, 4, 4, 4]
    check_against_reference(trained, reference_runs)
