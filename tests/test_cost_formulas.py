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


# -- overlap -------------------------------------------------------------------------------------------


def test_overlap_hides_all_but_one_piece_while_compute_is_longer():
    from autodist.planner.cost.step_time import overlapped

    assert overlapped(1.0, 10.0, 4) == pytest.approx(0.25)  # 1/4 exposed, the rest behind compute
    # Communication-bound: 4 pieces of 2.5 s against 4 of 1 s run 4 x 2.5 + 1 = 11 s, 4 s of compute.
    assert overlapped(10.0, 4.0, 4) == pytest.approx(7.0)
    assert overlapped(3.0, 5.0, 1) == pytest.approx(3.0)  # one piece: nothing to overlap with
    assert overlapped(0.0, 5.0, 4) == 0.0


def _dp_model(layers: int, params_per_block: int, flops_per_token: float) -> ModelCost:
    block = BlockCost(layer="b", params_whole=params_per_block, flops_per_token=flops_per_token)
    return ModelCost(blocks=(block,) * layers, hidden_size=1, traced_batch=1, traced_seq=1024)


def _dp_times(zero: int, flops_per_token: float, m: int = 1):
    """(exposed dp seconds, forward s, backward s per micro-batch, one block's all-gather s) for
    dp8 over 4 blocks of 1e8 bf16 parameters on one H100 node."""
    model = _dp_model(4, 10**8, flops_per_token)
    setup = Setup(device=H100, devices_per_node=8, nodes=1, seq_len=1024, global_batch=8 * m)
    result = estimate(StageTable(model), Strategy(dp=8, sharding_stage=zero, micro_batches=m), setup)
    rate = H100.peak_flops["bf16"] * MATMUL_EFFICIENCY
    forward = 4 * flops_per_token * 1024 / rate
    link = Link(H100.intra_node_bandwidth, H100.intra_node_latency_s)
    block_gather = all_gather_time(2e8, 8, link)
    return result.dp_comm_s, forward, 2 * forward, block_gather


def test_dp_all_reduce_hides_behind_backward_but_the_last_bucket():
    exposed, _, backward, _ = _dp_times(0, 1e9)
    link = Link(H100.intra_node_bandwidth, H100.intra_node_latency_s)
    total = all_reduce_time(8e8, 8, link)
    assert total < backward / 4  # each bucket shorter than a block's backward
    assert exposed == pytest.approx(total / 4)


def test_zero3_gathers_hide_behind_the_previous_block_except_the_first():
    # Compute-bound: per micro-batch, one block's gather exposed in forward and one in backward;
    # the gradient reduce-scatter (as big as all four gathers) adds its last piece in backward.
    exposed, forward, backward, gather = _dp_times(3, 1e9)
    assert gather < forward / 4
    link = Link(H100.intra_node_bandwidth, H100.intra_node_latency_s)
    reduce = reduce_scatter_time(8e8, 8, link)
    assert exposed == pytest.approx(gather + (4 * gather + reduce) / 4)
    # Two micro-batches: the gathers happen in each one's forward and backward.
    exposed2, *_ = _dp_times(3, 1e9, m=2)
    assert exposed2 == pytest.approx(exposed + 2 * gather)


def test_zero3_gathers_are_exposed_when_compute_is_short():
    exposed, forward, backward, gather = _dp_times(3, 1e3)  # almost no compute
    link = Link(H100.intra_node_bandwidth, H100.intra_node_latency_s)
    reduce = reduce_scatter_time(8e8, 8, link)
    fwd = (4 * gather + 3 * (4 * gather - forward)) / 4
    bwd = (4 * gather + reduce + 3 * (4 * gather + reduce - backward)) / 4
    assert exposed == pytest.approx(fwd + bwd)
    assert exposed == pytest.approx(8 * gather + reduce - 3 / 4 * (forward + backward))


def test_zero12_gather_updated_parameters_after_the_step():
    exposed, _, _, _ = _dp_times(1, 1e9)
    link = Link(H100.intra_node_bandwidth, H100.intra_node_latency_s)
    reduce, gather = reduce_scatter_time(8e8, 8, link), all_gather_time(8e8, 8, link)
    assert exposed == pytest.approx(reduce / 4 + gather)


def test_tensor_parallel_all_reduces_are_exposed():
    block = BlockCost(layer="b", flops_per_token=1e9, allreduce_fwd_per_token=1000, allreduce_fwd_count=2,
                      allreduce_bwd_per_token=1000, allreduce_bwd_count=2)
    model = ModelCost(blocks=(block,) * 2, hidden_size=1000, traced_batch=1, traced_seq=1024)
    setup = Setup(device=H100, devices_per_node=4, nodes=1, seq_len=1024, global_batch=1)
    result = estimate(StageTable(model), Strategy(mp=4), setup)
    link = Link(H100.intra_node_bandwidth, H100.intra_node_latency_s)
    one_way = all_reduce_time(2 * 1000 * 1024 * 2, 4, link, 4)
    assert result.mp_comm_s == pytest.approx(2 * one_way)
    assert result.estimate.step_time_s == pytest.approx(result.compute_s + result.mp_comm_s)


# -- VPP -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("pp", "m"), [(2, 4), (4, 8), (4, 4)])
def test_vpp_bubble_is_v_times_smaller(pp, m):
    from autodist.planner.cost.step_time import VPP_CHUNKS

    table = StageTable(_compute_only_model(8))
    flat = estimate(table, Strategy(), _setup(1, m)).estimate.step_time_s
    vpp = estimate(table, Strategy(pp=pp, micro_batches=m, schedule="VPP", virtual_stages=VPP_CHUNKS), _setup(pp, m))
    ideal = flat / pp
    assert vpp.bubble_s == pytest.approx(ideal * (pp - 1) / (VPP_CHUNKS * m))
    assert vpp.estimate.step_time_s == pytest.approx(ideal * (1 + (pp - 1) / (VPP_CHUNKS * m)))


def test_vpp_hands_off_v_times_as_often():
    from autodist.planner.cost.step_time import VPP_CHUNKS

    block = BlockCost(layer="b", flops_per_token=1e9, output_per_token=4096)
    model = ModelCost(blocks=(block,) * 8, hidden_size=4096, traced_batch=1, traced_seq=1024)
    setup = _setup(2, 4)
    one = estimate(StageTable(model), Strategy(pp=2, micro_batches=4, schedule="1F1B"), setup)
    vpp = estimate(StageTable(model), Strategy(pp=2, micro_batches=4, schedule="VPP", virtual_stages=VPP_CHUNKS), setup)
    assert vpp.estimate.comm_bytes.pp == VPP_CHUNKS * one.estimate.comm_bytes.pp
    handoff = 4096 * 1024 * 2
    assert one.estimate.comm_bytes.pp == 4 * 2 * handoff
    link = Link(H100.intra_node_bandwidth, H100.intra_node_latency_s)
    assert vpp.pp_comm_s == pytest.approx(4 * 2 * VPP_CHUNKS * p2p_time(handoff, link))
