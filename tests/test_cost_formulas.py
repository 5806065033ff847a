"""The cost model's formulas against published figures and first principles.

The activation-memory and FLOP formulas of Korthikanti et al. are checked against the traced
graph in tests/test_cost_graph.py; this file covers what needs no graph.
"""

from __future__ import annotations

import pytest

from autodist.planner.cost.blocks import BlockCost, ModelCost
from autodist.planner.cost.comm import (
    Link,
    all_gather_time,
    all_reduce_bytes,
    all_reduce_time,
    group_link,
    group_within_node,
    p2p_time,
    reduce_scatter_time,
)
from autodist.planner.cost.hardware import PROFILES
from autodist.planner.cost.memory import model_state_bytes, optimizer_bytes_per_param
from autodist.planner.cost.step_time import MATMUL_EFFICIENCY, Setup, StageTable, estimate, stage_ranges
from autodist.schemas import Strategy

H100 = PROFILES["h100-sxm"]


# -- ZeRO (Rajbhandari et al. 2020, Figure 1: Psi = 7.5B, N_d = 64, K = 12) --------------------------


@pytest.mark.parametrize(("stage", "gigabytes"), [(0, 120.0), (1, 31.4), (2, 16.6), (3, 1.9)])
def test_zero_paper_example(stage, gigabytes):
    state = model_state_bytes(7.5e9, dp=64, stage=stage, dtype="fp16", optimizer="adam")
    assert round(state.total / 1e9, 1) == gigabytes


def test_optimizer_state_bytes_per_parameter():
    assert optimizer_bytes_per_param("bf16", "adam") == 12  # the paper's K for mixed-precision Adam
    assert optimizer_bytes_per_param("fp32", "adam") == 8  # momentum + variance, no master copy
    assert optimizer_bytes_per_param("bf16", "sgd") == 4  # only the fp32 master copy
    assert optimizer_bytes_per_param("fp32", "sgd") == 0
    with pytest.raises(ValueError, match="unknown optimizer 'lion'"):
        optimizer_bytes_per_param("bf16", "lion")


# -- alpha-beta ring collectives ------------------------------------------------------------------------


def test_ring_collectives_follow_the_alpha_beta_formulas():
    link = Link(bandwidth=100e9, latency_s=5e-6)
    n, p = 1e9, 8
    assert all_reduce_time(n, p, link) == pytest.approx(2 * 7 * 5e-6 + 2 * 7 / 8 * n / 100e9)
    assert all_gather_time(n, p, link) == pytest.approx(7 * 5e-6 + 7 / 8 * n / 100e9)
    # An all-reduce is a reduce-scatter then an all-gather: sequence parallelism costs the same.
    assert all_reduce_time(n, p, link) == pytest.approx(reduce_scatter_time(n, p, link) + all_gather_time(n, p, link))
    assert p2p_time(n, link) == pytest.approx(5e-6 + n / 100e9)
    assert all_reduce_bytes(n, p) == pytest.approx(2 * 7 / 8 * n)
    assert all_reduce_time(n, 1, link) == all_gather_time(n, 1, link) == 0.0


def test_groups_use_nvlink_only_when_they_stay_inside_a_node():
    assert group_within_node(8, 1, 8)  # mp8, innermost: one node
    assert not group_within_node(16, 1, 8)  # mp16 spans two nodes
    assert group_within_node(4, 2, 8)  # dp4 over mp2: ranks 0,2,4,6
    assert not group_within_node(2, 8, 8)  # dp2 over mp8: ranks 0 and 8
    assert not group_within_node(4, 1, 6)  # ranks 4..7 straddle nodes of 6
    inside, across = group_link(8, 1, 8, H100), group_link(2, 8, 8, H100)
    assert inside.bandwidth == H100.intra_node_bandwidth and across.bandwidth == H100.inter_node_bandwidth


# -- step time -----------------------------------------------------------------------------------------


def _compute_only_model(layers: int, flops_per_token: float = 1e9) -> ModelCost:
    block = BlockCost(layer="b", flops_per_token=flops_per_token)
    return ModelCost(blocks=(block,) * layers, hidden_size=1, traced_batch=1, traced_seq=1024)


def _setup(world: int, global_batch: int) -> Setup:
    return Setup(device=H100, devices_per_node=world, nodes=1, seq_len=1024, global_batch=global_batch)


def test_one_device_without_communication_runs_at_the_stated_efficiency():
    table = StageTable(_compute_only_model(4))
    result = estimate(table, Strategy(), _setup(1, 8))
    tokens = 8 * 1024
    assert result.estimate.step_time_s == pytest.approx(3 * 4 * 1e9 * tokens / (H100.peak_flops["bf16"] * MATMUL_EFFICIENCY))
    assert result.estimate.mfu == pytest.approx(MATMUL_EFFICIENCY)
    assert result.estimate.tokens_per_s == pytest.approx(tokens / result.estimate.step_time_s)


@pytest.mark.parametrize(("pp", "m"), [(2, 4), (4, 8), (4, 4), (8, 32)])
def test_1f1b_bubble_is_p_minus_1_over_m(pp, m):
    table = StageTable(_compute_only_model(8))
    flat = estimate(table, Strategy(), _setup(1, m)).estimate.step_time_s  # all work on one device
    piped = estimate(table, Strategy(pp=pp, micro_batches=m, schedule="1F1B"), _setup(pp, m))
    ideal = flat / pp
    assert piped.estimate.step_time_s == pytest.approx(ideal * (1 + (pp - 1) / m))
    assert piped.bubble_s == pytest.approx(ideal * (pp - 1) / m)


def test_sequential_schedule_has_no_overlap_at_all():
    table = StageTable(_compute_only_model(8))
    flat = estimate(table, Strategy(), _setup(1, 8)).estimate.step_time_s
    sequential = estimate(table, Strategy(pp=4, micro_batches=8, schedule="sequential"), _setup(4, 8))
    assert sequential.estimate.step_time_s == pytest.approx(flat)


def test_uneven_stages_are_priced_by_the_slowest():
    assert stage_ranges(10, 4) == [(0, 3), (3, 6), (6, 8), (8, 10)]
    table = StageTable(_compute_only_model(10))
    flat = estimate(table, Strategy(), _setup(1, 8)).estimate.step_time_s
    piped = estimate(table, Strategy(pp=4, micro_batches=8, schedule="1F1B"), _setup(4, 8)).estimate.step_time_s
    assert piped == pytest.approx(flat * 3 / 10 * (8 + 3) / 8)


def test_full_recompute_adds_one_forward():
    table = StageTable(_compute_only_model(4))
    plain = estimate(table, Strategy(), _setup(1, 8)).estimate
    setup = Setup(device=H100, devices_per_node=1, nodes=1, seq_len=1024, global_batch=8, recompute="full")
    again = estimate(table, Strategy(), setup).estimate
    assert again.step_time_s == pytest.approx(plain.step_time_s * 4 / 3)
    assert again.mfu == pytest.approx(plain.mfu * 3 / 4)  # MFU counts model FLOPs, not recomputed ones


def test_implicit_collectives_add_their_bytes_and_latency_to_mp_time():
    from autodist.planner.cost.step_time import Implicit

    model = ModelCost(blocks=(BlockCost(layer="b", flops_per_token=1e6),), hidden_size=1, traced_batch=1, traced_seq=128)
    setup = Setup(device=H100, devices_per_node=4, nodes=1, seq_len=128, global_batch=2)
    strategy = Strategy(mp=4, micro_batches=2)
    plain = estimate(StageTable(model), strategy, setup)
    extra = estimate(StageTable(model), strategy, setup, Implicit(sent_per_token=1000.0, count=3))
    tokens = 128  # one sample of 128 tokens per micro-batch
    per_micro_batch = 3 * 2 * 3 * H100.intra_node_latency_s + 1000.0 * tokens / H100.intra_node_bandwidth
    assert extra.mp_comm_s - plain.mp_comm_s == pytest.approx(2 * per_micro_batch)
    assert extra.estimate.comm_bytes.implicit == 2 * 1000 * tokens
