"""The cost model's formulas against published figures and first principles.

The activation-memory and FLOP formulas of Korthikanti et al. are checked against the traced
graph in tests/test_cost_graph.py; this file covers what needs no graph.
"""

from __future__ import annotations

from dataclasses import replace

import msgspec
import pytest

from autodist.planner.cost.blocks import BlockCost, EdgeCost, ModelCost, Saved
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
from autodist.planner.cost.compute import fixed_op_time
from autodist.planner.cost.hardware import PROFILES
from autodist.planner.cost.memory import model_state_bytes, optimizer_bytes_per_param
from autodist.planner.cost.step_time import Setup, StageTable, estimate, stage_ranges
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


def test_a_ring_steps_latency_grows_with_the_group_as_the_link_says():
    # 1 us a step for two ranks, 2 us more per rank beyond two, 1 GB/s; 4000 bytes.
    link = Link(bandwidth=1e9, latency_s=1e-6, latency_per_rank_s=2e-6)
    # 4 ranks: 6 steps of 1 + 2 x 2 = 5 us = 30 us, and 2 x 3/4 x 4000 B at 1 GB/s = 6 us
    assert all_reduce_time(4000, 4, link) == pytest.approx(36e-6)
    assert all_gather_time(4000, 4, link) == pytest.approx(3 * 5e-6 + 3e-6)  # 3 steps, 3/4 x 4000 B
    assert all_reduce_time(4000, 2, link) == pytest.approx(2 * 1e-6 + 4e-6)  # two ranks: no growth
    assert p2p_time(4000, link) == pytest.approx(1e-6 + 4e-6)  # a transfer between two ranks
    # the device's figures reach the links the planner prices groups on
    device = msgspec.structs.replace(H100, intra_node_latency_per_rank_s=2e-6, inter_node_latency_per_rank_s=3e-6)
    assert group_link(8, 1, 8, device).step_latency(8) == pytest.approx(H100.intra_node_latency_s + 6 * 2e-6)
    assert group_link(16, 1, 8, device).step_latency(16) == pytest.approx(H100.inter_node_latency_s + 14 * 3e-6)


def test_groups_use_nvlink_only_when_they_stay_inside_a_node():
    assert group_within_node(8, 1, 8)  # mp8, innermost: one node
    assert not group_within_node(16, 1, 8)  # mp16 spans two nodes
    assert group_within_node(4, 2, 8)  # dp4 over mp2: ranks 0,2,4,6
    assert not group_within_node(2, 8, 8)  # dp2 over mp8: ranks 0 and 8
    assert not group_within_node(4, 1, 6)  # ranks 4..7 straddle nodes of 6
    inside, across = group_link(8, 1, 8, H100), group_link(2, 8, 8, H100)
    assert inside.bandwidth == H100.intra_node_bandwidth and across.bandwidth == H100.inter_node_bandwidth


def test_a_group_spanning_nodes_uses_one_nic_per_member_in_a_node():
    # dp16 over two nodes, stride 1: 8 members per node, 8 NICs (capped by NVLink).
    assert group_link(16, 1, 8, H100).bandwidth == min(8 * H100.inter_node_bandwidth, H100.intra_node_bandwidth)
    assert group_link(16, 2, 8, H100).bandwidth == 4 * H100.inter_node_bandwidth  # dp over mp2: 4 per node
    assert group_link(4, 8, 8, H100).bandwidth == H100.inter_node_bandwidth  # dp over mp8: one per node
    assert group_link(16, 1, 8, H100).latency_s == H100.inter_node_latency_s


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
    assert result.estimate.step_time_s == pytest.approx(
        3 * 4 * 1e9 * tokens / (H100.peak_flops["bf16"] * H100.matmul_efficiency)
    )
    assert result.estimate.mfu == pytest.approx(H100.matmul_efficiency)
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


def test_sequential_ranks_each_update_every_parameter():
    """Under ``sequential`` the whole model runs on every rank, so each rank's optimizer holds
    every stage's parameters and dispatches an update for each: the fixed cost per update is the
    whole model's, as on one device; 1F1B's ranks hold their stage's only. (The search ranked a
    toy model's sequential pp2 first partly because it priced half the updates.)"""
    block = BlockCost(layer="b", flops_per_token=1e6, params_split=1000, param_tensors=4)
    table = StageTable(ModelCost(blocks=(block,) * 4, hidden_size=1, traced_batch=1, traced_seq=1024))
    one = estimate(table, Strategy(), _setup(1, 2)).optimizer_s
    sequential = estimate(table, Strategy(pp=2, schedule="sequential"), _setup(2, 2)).optimizer_s
    piped = estimate(table, Strategy(pp=2, micro_batches=2, schedule="1F1B"), _setup(2, 2)).optimizer_s
    update = fixed_op_time(H100)
    assert sequential == pytest.approx(piped + 8 * update)
    assert piped < sequential < one


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

    model = ModelCost(
        blocks=(BlockCost(layer="b", flops_per_token=1e6),), hidden_size=1, traced_batch=1, traced_seq=128
    )
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


def test_hidden_communication_costs_the_compute_it_slows():
    # loss 0.2: compute runs at 0.8 x its speed while a collective runs beside it. A piece of c s
    # of communication beside k s of compute takes max(c, k + 0.2 c): exposes max(c - k, 0.2 c).
    from autodist.planner.cost.step_time import overlapped

    # The link keeps up: 4 pieces of 0.25 s beside 4 of 2.5 s. The first piece exposed (0.25 s),
    # each of the other three slows its compute by 0.2 x 0.25 = 0.05 s: 0.25 + 0.15 = 0.4 s.
    assert overlapped(1.0, 10.0, 4, loss=0.2) == pytest.approx(0.4)
    # It does not: 4 pieces of 2.5 s beside 4 of 1 s. The compute, slowed to 1.25 s, finishes
    # inside each 2.5 s piece, which exposes 2.5 - 1 = 1.5 s as without the loss: 2.5 + 4.5 = 7 s.
    assert overlapped(10.0, 4.0, 4, loss=0.2) == pytest.approx(7.0)
    # Just: 1.1 s pieces beside 1 s of compute, slowed to 1 + 0.2 x 1.1 = 1.22 s > 1.1 s: the
    # slowed compute is the longer, 0.22 s exposed a piece (not 0.1): 1.1 + 3 x 0.22 = 1.76 s.
    assert overlapped(4.4, 4.0, 4, loss=0.2) == pytest.approx(1.76)
    # Loss 1 hides nothing (gloo: the collective holds the thread that computes).
    assert overlapped(1.0, 10.0, 4, loss=1.0) == pytest.approx(1.0)


def test_without_comm_overlap_the_loss_is_all_of_it_whatever_the_profile_says():
    from autodist.planner.cost.compute import overlap_loss

    block = BlockCost(layer="b", params_whole=10**8, param_tensors=1, flops_per_token=3e9)
    model = ModelCost(blocks=(block,) * 4, hidden_size=1, traced_batch=1, traced_seq=1024)

    def step(**figures):
        device = _device(intra_node_bandwidth=100e9, intra_node_latency_s=5e-6, **figures)
        setup = Setup(device=device, devices_per_node=8, nodes=1, seq_len=1024, global_batch=8)
        return estimate(StageTable(model), Strategy(dp=8, sharding_stage=0), setup).estimate.step_time_s

    assert overlap_loss(_device(comm_overlap=False, overlap_compute_loss=0.3)) == 1.0
    assert step(comm_overlap=False, overlap_compute_loss=0.3) == pytest.approx(step(overlap_compute_loss=1.0))
    assert step(overlap_compute_loss=0.3) < step(overlap_compute_loss=1.0)
    assert (PROFILES["h100-sxm"].overlap_compute_loss, PROFILES["a100-80g"].overlap_compute_loss) == (0.24, 0.30)
    assert PROFILES["cpu"].overlap_compute_loss == 1.0 and not PROFILES["cpu"].comm_overlap


def _dp_model(layers: int, params_per_block: int, flops_per_token: float) -> ModelCost:
    block = BlockCost(layer="b", params_whole=params_per_block, param_tensors=1, flops_per_token=flops_per_token)
    return ModelCost(blocks=(block,) * layers, hidden_size=1, traced_batch=1, traced_seq=1024)


def _dp_times(zero: int, flops_per_token: float, m: int = 1, loss: float = 0.0):
    """(exposed dp seconds, forward s, backward s per micro-batch, one block's all-gather s) for
    dp8 over 4 blocks of 1e8 bf16 parameters on one H100 node, ``loss`` of compute speed lost
    beside a collective (0: hidden communication costs nothing)."""
    model = _dp_model(4, 10**8, flops_per_token)
    device = msgspec.structs.replace(H100, overlap_compute_loss=loss)
    setup = Setup(device=device, devices_per_node=8, nodes=1, seq_len=1024, global_batch=8 * m)
    result = estimate(StageTable(model), Strategy(dp=8, sharding_stage=zero, micro_batches=m), setup)
    rate = H100.peak_flops["bf16"] * H100.matmul_efficiency
    forward = 4 * flops_per_token * 1024 / rate
    link = Link(H100.intra_node_bandwidth, H100.intra_node_latency_s)
    block_gather = all_gather_time(2e8, 8, link)
    return result.dp_comm_s, forward, 2 * forward, block_gather


def test_dp_all_reduce_hides_behind_backward_but_the_last_bucket():
    exposed, _, backward, _ = _dp_times(0, 3e9)
    link = Link(H100.intra_node_bandwidth, H100.intra_node_latency_s)
    total = all_reduce_time(8e8, 8, link, 4)  # one all-reduce per parameter
    assert total < backward / 4  # each bucket shorter than a block's backward
    assert exposed == pytest.approx(total / 4)


def test_zero3_gathers_hide_behind_the_previous_block_except_the_first():
    # Compute-bound: per micro-batch, one block's gather exposed in forward and one in backward;
    # the gradient reduce-scatter (as big as all four gathers) adds its last piece in backward.
    exposed, forward, backward, gather = _dp_times(3, 1e9)
    assert gather < forward / 4
    link = Link(H100.intra_node_bandwidth, H100.intra_node_latency_s)
    reduce = reduce_scatter_time(8e8, 8, link, 4)
    assert exposed == pytest.approx(gather + (4 * gather + reduce) / 4)
    # Two micro-batches: the gathers happen in each one's forward and backward.
    exposed2, *_ = _dp_times(3, 1e9, m=2)
    assert exposed2 == pytest.approx(exposed + 2 * gather)


def test_zero3_hidden_gathers_cost_the_h100s_loss_of_compute():
    # The same ZeRO-3 step with H100's 0.24: each piece hidden behind compute (the link keeps up)
    # slows that compute by 0.24 x the piece. Hidden: forward 3 of the 4 gathers, backward 3/4 of
    # the 4 gathers and the reduce-scatter; the step rises by exactly 0.24 x that.
    loss = H100.overlap_compute_loss
    assert loss == 0.24
    free, forward, _, gather = _dp_times(3, 1e9)
    slowed, *_ = _dp_times(3, 1e9, loss=loss)
    reduce = reduce_scatter_time(8e8, 8, Link(H100.intra_node_bandwidth, H100.intra_node_latency_s), 4)
    assert gather * (1 + loss) < forward / 4  # every piece hides
    hidden = 3 * gather + 3 / 4 * (4 * gather + reduce)
    assert slowed - free == pytest.approx(loss * hidden)
    model = _dp_model(4, 10**8, 1e9)
    setup = Setup(device=H100, devices_per_node=8, nodes=1, seq_len=1024, global_batch=8)
    step = estimate(StageTable(model), Strategy(dp=8, sharding_stage=3), setup).estimate.step_time_s
    free_device = msgspec.structs.replace(H100, overlap_compute_loss=0.0)
    free_setup = replace(setup, device=free_device)
    free_step = estimate(StageTable(model), Strategy(dp=8, sharding_stage=3), free_setup).estimate.step_time_s
    assert step - free_step == pytest.approx(loss * hidden)


def test_zero3_gathers_are_exposed_when_compute_is_short():
    exposed, forward, backward, gather = _dp_times(3, 1e3)  # almost no compute
    link = Link(H100.intra_node_bandwidth, H100.intra_node_latency_s)
    reduce = reduce_scatter_time(8e8, 8, link, 4)
    fwd = (4 * gather + 3 * (4 * gather - forward)) / 4
    bwd = (4 * gather + reduce + 3 * (4 * gather + reduce - backward)) / 4
    assert exposed == pytest.approx(fwd + bwd)
    assert exposed == pytest.approx(8 * gather + reduce - 3 / 4 * (forward + backward))


def test_zero12_gather_updated_parameters_after_the_step():
    exposed, _, _, _ = _dp_times(1, 1e9)
    link = Link(H100.intra_node_bandwidth, H100.intra_node_latency_s)
    reduce, gather = reduce_scatter_time(8e8, 8, link, 4), all_gather_time(8e8, 8, link, 4)
    assert exposed == pytest.approx(reduce / 4 + gather)


def test_gradients_summed_in_fp32_send_twice_the_bytes_of_bf16_ones_the_parameters_not():
    # ZeRO-3 over dp8, 4 blocks of 1e8 parameters, almost no compute (all exposed): the
    # reduce-scatter of the gradients in fp32 (FSDP's reduce_dtype, Composer's default) sends
    # 4 bytes an element where bf16 sends 2; the parameters' all-gathers stay bf16
    model = _dp_model(4, 10**8, 1e3)
    strategy = Strategy(dp=8, sharding_stage=3)
    setup = Setup(device=H100, devices_per_node=8, nodes=1, seq_len=1024, global_batch=8)
    bf16, fp32 = (estimate(StageTable(model), strategy, replace(setup, grad_reduce_dtype=d)) for d in (None, "fp32"))
    link = Link(H100.intra_node_bandwidth, H100.intra_node_latency_s)
    assert fp32.estimate.comm_bytes.dp - bf16.estimate.comm_bytes.dp == 7 / 8 * 4e8 * (4 - 2)
    extra = reduce_scatter_time(16e8, 8, link, 4) - reduce_scatter_time(8e8, 8, link, 4)
    assert fp32.dp_comm_s - bf16.dp_comm_s == pytest.approx(extra)  # the last block's, exposed whole


def test_tensor_parallel_all_reduces_are_exposed():
    block = BlockCost(
        layer="b",
        flops_per_token=1e9,
        allreduce_fwd_per_token=1000,
        allreduce_fwd_count=2,
        allreduce_bwd_per_token=1000,
        allreduce_bwd_count=2,
    )
    model = ModelCost(blocks=(block,) * 2, hidden_size=1000, traced_batch=1, traced_seq=1024)
    setup = Setup(device=H100, devices_per_node=4, nodes=1, seq_len=1024, global_batch=1)
    result = estimate(StageTable(model), Strategy(mp=4), setup)
    link = Link(H100.intra_node_bandwidth, H100.intra_node_latency_s)
    one_way = all_reduce_time(2 * 1000 * 1024 * 2, 4, link, 4)
    assert result.mp_comm_s == pytest.approx(2 * one_way)
    assert result.estimate.step_time_s == pytest.approx(result.compute_s + result.mp_comm_s)


def test_gathers_and_whole_cores_are_priced_as_they_run():
    """One block, h = 1000, at mp 4 on 1024 tokens (global batch 1 x seq 1024), bf16, nothing but
    its attention core (4000 FLOPs and 8 floats of saved scores a token x seq). Gathered (a fused
    q|k|v not run as a local view): its output all-gathered forward, 3h = 3000 elements a token,
    and the row projection's input gradient backward, h = 1000; the core whole on every rank. As
    a local view: no gather, a quarter of the core. Half its core whole: 1/2 + 1/2 / 4 of it."""
    scores = Saved(floats=8.0)
    gathers = dict(gather_fwd_per_token=3000, gather_fwd_count=1, gather_bwd_per_token=1000, gather_bwd_count=1)
    blocks = {
        "gathered": BlockCost(
            layer="b", flops_per_token_seq=4000.0, saved_inside_seq=scores, core_whole=1.0, **gathers
        ),
        "local": BlockCost(layer="b", flops_per_token_seq=4000.0, saved_inside_seq=scores),
        "half": BlockCost(layer="b", flops_per_token_seq=4000.0, saved_inside_seq=scores, core_whole=0.5),
    }
    setup = Setup(device=H100, devices_per_node=4, nodes=1, seq_len=1024, global_batch=1)
    runs = {
        name: estimate(StageTable(ModelCost(blocks=(block,), hidden_size=1000, traced_seq=1024)), Strategy(mp=4), setup)
        for name, block in blocks.items()
    }
    gathered, local, half = runs["gathered"], runs["local"], runs["half"]
    # 3/4 of each gathered tensor sent: 3/4 x 3000 x 1024 x 2 bytes + 3/4 x 1000 x 1024 x 2 bytes
    assert gathered.estimate.comm_bytes.mp == 4_608_000 + 1_536_000
    step = H100.intra_node_latency_s + 2 * H100.intra_node_latency_per_rank_s  # a ring step of 4 ranks
    assert gathered.mp_comm_s == pytest.approx(2 * 3 * step + 6_144_000 / H100.intra_node_bandwidth)
    assert local.estimate.comm_bytes.mp == local.mp_comm_s == 0
    # forward and a backward of twice the forward: 3 x 4000 x 1024 x 1024 FLOPs at the roof, whole
    roof = H100.peak_flops["bf16"] * H100.matmul_efficiency
    assert gathered.compute_s == pytest.approx(3 * 4000 * 1024 * 1024 / roof)
    assert local.compute_s == pytest.approx(3 * 4000 * 1024 * 1024 / 4 / roof)
    assert half.compute_s == pytest.approx(3 * 4000 * 1024 * 1024 * (0.5 + 0.5 / 4) / roof)
    # the saved scores: 8 floats x 2 bytes a token x seq, whole or a quarter
    assert gathered.estimate.memory.activations == 8 * 2 * 1024 * 1024
    assert local.estimate.memory.activations == 8 * 2 * 1024 * 1024 // 4
    assert half.estimate.memory.activations == 8 * 2 * 1024 * 1024 * 5 // 8
    # full recompute runs the forward, and its gather, once more
    again = estimate(
        StageTable(ModelCost(blocks=(blocks["gathered"],), hidden_size=1000, traced_seq=1024)),
        Strategy(mp=4, recompute="full"),
        replace(setup, recompute="full"),
    )
    assert again.estimate.comm_bytes.mp == 2 * 4_608_000 + 1_536_000


def test_a_vocabulary_split_lookup_in_the_global_view_all_gathers_its_table_and_does_not_all_reduce_its_output():
    # Paddle 3.3.1 gathers a row-split embedding table whole before the lookup (its SPMD rule wants
    # it replicated) and again for embedding_grad, and leaves the output replicated
    # (docs/paddle-notes.md, "SPMD rules"): where the lookup's layer cannot run it locally, or (the
    # edge below can: lookup_output) where the strategy runs no local tensors (2 micro-batches
    # priced with local_views=False, as where the strategy runs none: schemas/parallel_dims.runs_local_views).
    vocab, hidden, seq = 1000, 64, 128
    first = EdgeCost(params_vocab=vocab * hidden, lookup_table=vocab * hidden, lookup_output=hidden, param_tensors=1)
    block = BlockCost(layer="b", flops_per_token=1e6)
    model = ModelCost(blocks=(block,), hidden_size=hidden, vocab_size=vocab, first=first, traced_seq=seq)
    setup = Setup(device=H100, devices_per_node=2, nodes=1, seq_len=seq, global_batch=4, dtype="bf16")
    result = estimate(StageTable(model), Strategy(mp=2, micro_batches=2), setup, local_views=False)
    link = Link(H100.intra_node_bandwidth, H100.intra_node_latency_s)
    table = 1000 * 64 * 2  # the whole table in bf16: the all-gather's message
    # 2 micro-batches x (forward + backward) gathers, each (mp - 1) alpha + (mp - 1) / mp x table / bandwidth
    one = link.latency_s + table / 2 / link.bandwidth
    assert all_gather_time(table, 2, link) == pytest.approx(one)
    assert result.mp_comm_s == pytest.approx(4 * one)
    assert result.estimate.comm_bytes.mp == 4 * 64_000  # no all-reduce of the lookup's output
    # the gathered table and its whole gradient, alive once; the parameter stays split
    assert result.estimate.memory.activations == 2 * table
    assert result.estimate.memory.params == vocab * hidden // 2 * 2
    # unsplit (mp 1, or a vocabulary that does not divide by mp): no gather, nothing held whole
    odd = replace(model, vocab_size=999)
    for strategy, cost in ((Strategy(micro_batches=2), model), (Strategy(mp=2, micro_batches=2), odd)):
        plain = estimate(StageTable(cost), strategy, setup).estimate
        assert plain.comm_bytes.mp == 0 and plain.memory.activations == 0


def test_a_vocabulary_split_lookup_on_local_tensors_all_reduces_its_output_once():
    # plan.vocab_lookup (Megatron's way, applier/modes/vocab_lookup.py): each rank looks up its own rows
    # and one all-reduce sums the outputs in the forward; the backward communicates nothing for the
    # table, and no rank holds it whole.
    vocab, hidden, seq = 1000, 64, 128
    first = EdgeCost(params_vocab=vocab * hidden, lookup_table=vocab * hidden, lookup_output=hidden, param_tensors=1)
    block = BlockCost(layer="b", flops_per_token=1e6)
    model = ModelCost(blocks=(block,), hidden_size=hidden, vocab_size=vocab, first=first, traced_seq=seq)
    setup = Setup(device=H100, devices_per_node=2, nodes=1, seq_len=seq, global_batch=4, dtype="bf16")
    result = estimate(StageTable(model), Strategy(mp=2), setup)
    link = Link(H100.intra_node_bandwidth, H100.intra_node_latency_s)
    # One micro-batch of 4 sequences x 128 tokens = 512 tokens, by 64 features, 2 bytes: 65,536 B.
    # Ring all-reduce over 2 ranks: 2 (p - 1) = 2 latencies + 2 (p - 1) / p x 65,536 B = 65,536 B
    # over the link; it sends those 65,536 B. No gather: no table bytes, nothing held whole.
    output = 4 * 128 * 64 * 2
    assert all_reduce_time(output, 2, link) == pytest.approx(2 * link.latency_s + output / link.bandwidth)
    assert result.mp_comm_s == pytest.approx(2 * link.latency_s + 65_536 / link.bandwidth)
    assert result.estimate.comm_bytes.mp == 65_536
    assert result.estimate.memory.activations == 0
    # the same edge whose layer cannot look up locally gathers the table twice (128,000 B each)
    gathered = estimate(StageTable(replace(model, first=replace(first, lookup_output=0))), Strategy(mp=2), setup)
    assert gathered.estimate.comm_bytes.mp == 2 * 64_000


def test_local_views_true_prices_the_lookup_locally_whatever_the_strategy():
    # estimate(..., local_views=True): how bench/published.py prices Megatron-LM, which looks up
    # locally under every strategy. Priced in the global view (local_views=False, as where apply_plan
    # runs no local tensors) the table is all-gathered twice per micro-batch; priced as Megatron, each
    # micro-batch all-reduces its output once: 2 x 256 tokens x 64 features x 2 bytes = 2 x 32,768 B sent.
    vocab, hidden, seq = 1000, 64, 128
    first = EdgeCost(params_vocab=vocab * hidden, lookup_table=vocab * hidden, lookup_output=hidden, param_tensors=1)
    model = ModelCost(
        blocks=(BlockCost(layer="b", flops_per_token=1e6),), hidden_size=hidden, vocab_size=vocab, first=first
    )
    setup = Setup(device=H100, devices_per_node=2, nodes=1, seq_len=seq, global_batch=4, dtype="bf16")
    strategy = Strategy(mp=2, micro_batches=2)
    assert estimate(StageTable(model), strategy, setup, local_views=False).estimate.comm_bytes.mp == 4 * 64_000
    megatron = estimate(StageTable(model), strategy, setup, local_views=True)
    assert megatron.estimate.comm_bytes.mp == 2 * 32_768
    assert megatron.estimate.memory.activations == 0


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


# -- roofline ------------------------------------------------------------------------------------------


def _device(**figures):
    from autodist.schemas import DeviceProfile

    base = dict(
        name="t",
        memory_bytes=1,
        peak_flops={"bf16": 100e12, "fp16": 100e12, "fp32": 25e12},
        intra_node_bandwidth=1,
        inter_node_bandwidth=1,
        intra_node_latency_s=0,
        inter_node_latency_s=0,
        memory_bandwidth=1e12,
        matmul_efficiency=0.5,
        op_overhead_s=0.0,
    )
    return DeviceProfile(**{**base, **figures})


def test_large_square_matmul_hits_the_compute_roof():
    from autodist.planner.cost.compute import matmul_time

    # 2 * 4096^3 = 1.374e11 FLOPs at 50 TFLOP/s; bytes 3 * 4096^2 * 2 = 0.1 GB at 1 TB/s = 0.1 ms.
    assert matmul_time(4096, 4096, 4096, _device(), "bf16") == pytest.approx(2 * 4096**3 / 50e12)


def test_thin_matmul_hits_the_memory_roof():
    from autodist.planner.cost.compute import matmul_time

    # A matrix-vector product: 2 * 4096^2 FLOPs = 0.67 us of compute, but the 4096^2 weight
    # (plus two vectors) in bf16 is 33.6 MB at 1 TB/s = 33.6 us.
    assert matmul_time(1, 4096, 4096, _device(), "bf16") == pytest.approx(2 * (4096 * 4096 + 2 * 4096) / 1e12)
    # fp32 elements move twice the bytes.
    assert matmul_time(1, 4096, 4096, _device(), "fp32") == pytest.approx(4 * (4096 * 4096 + 2 * 4096) / 1e12)


def test_overhead_is_the_saturation_curve_half_rate_at_e_p_t0():
    from autodist.planner.cost.compute import matmul_time

    device = _device(op_overhead_s=10e-6, memory_bandwidth=0.0)  # no memory roof
    work = 0.5 * 100e12 * 10e-6  # e P t0 = 5e8 FLOPs: half the roof
    m = n = k = round((work / 2) ** (1 / 3))
    rate = 2 * m * n * k / matmul_time(m, n, k, device, "bf16")
    assert rate == pytest.approx(0.5 * 0.5 * 100e12, rel=1e-2)
    big = 8192
    assert 2 * big**3 / matmul_time(big, big, big, device, "bf16") > 0.99 * 0.5 * 100e12  # saturated


def test_unknown_memory_bandwidth_prices_memory_bound_ops_at_nothing():
    from autodist.planner.cost.compute import matmul_time, memory_time

    device = _device(memory_bandwidth=0.0)
    assert memory_time(1e9, device) == 0.0
    assert matmul_time(1, 4096, 4096, device, "bf16") == pytest.approx(2 * 4096 * 4096 / 50e12)
    assert memory_time(1e9, _device()) == pytest.approx(1e-3)


def test_step_time_prices_per_rank_gemm_shapes_and_memory_bound_bytes():
    from autodist.planner.cost.blocks import Gemm, Moved

    device = _device(op_overhead_s=5e-6)
    # One block: a column-parallel (n=4096, k=1024) and a row-parallel (n=1024, k=4096) linear,
    # plus 10 elements per token moved outside the mp region and 20 inside.
    block = BlockCost(
        layer="b",
        flops_per_token=2 * 2 * 4096 * 1024,
        params_split=2 * 4096 * 1024,
        gemms=(Gemm(4096, 1024, "column"), Gemm(1024, 4096, "row")),
        moved=Moved(outside=10, inside=20),
    )
    model = ModelCost(blocks=(block,), hidden_size=1024, traced_batch=1, traced_seq=512)
    setup = Setup(device=device, devices_per_node=2, nodes=1, seq_len=512, global_batch=2)
    result = estimate(StageTable(model), Strategy(mp=2), setup)
    tokens = 2 * 512
    gemm = 2 * tokens * 2048 * 1024 / 50e12 + 5e-6  # both are (1024 tokens) x 1024 x 2048 per rank
    moved = (10 + 20 / 2) * tokens * 2 / 1e12
    assert result.compute_s == pytest.approx(3 * (2 * gemm + moved))


def test_optimizer_step_reads_and_writes_every_state_once_plus_one_op_per_parameter():
    device = _device(op_overhead_s=5e-6)
    block = BlockCost(layer="b", params_whole=10**6, param_tensors=3)
    model = ModelCost(blocks=(block,) * 2, hidden_size=1, traced_batch=1, traced_seq=8)
    setup = Setup(device=device, devices_per_node=1, nodes=1, seq_len=8, global_batch=1)
    result = estimate(StageTable(model), Strategy(), setup)
    states = 2e6 * (2 + 2 + 12)  # bf16 params and grads, Adam's 12 bytes (master copy, two moments)
    assert result.optimizer_s == pytest.approx(2 * states / 1e12 + 6 * 5e-6)
    assert result.estimate.step_time_s == pytest.approx(result.optimizer_s)  # nothing else to do


def test_without_comm_overlap_the_gradient_sync_is_all_exposed():
    device = _device(comm_overlap=False, intra_node_bandwidth=100e9, intra_node_latency_s=5e-6)
    block = BlockCost(layer="b", params_whole=10**8, param_tensors=1, flops_per_token=3e9)
    model = ModelCost(blocks=(block,) * 4, hidden_size=1, traced_batch=1, traced_seq=1024)
    setup = Setup(device=device, devices_per_node=8, nodes=1, seq_len=1024, global_batch=8)
    result = estimate(StageTable(model), Strategy(dp=8), setup)
    assert result.compute_s > 10 * result.dp_comm_s > 0  # plenty of backward to hide behind, yet:
    assert result.dp_comm_s == pytest.approx(all_reduce_time(8e8, 8, Link(100e9, 5e-6), 4))


def test_dispatch_overhead_is_paid_once_per_priced_op_forward_backward_and_optimizer():
    from autodist.planner.cost.blocks import Gemm, Moved

    # One block: 2 matmuls and 3 other ops, 2 parameters; dp = mp = 1, so no collectives.
    block = BlockCost(
        layer="b",
        flops_per_token=2 * 2 * 64 * 64,
        params_whole=2 * 64 * 64,
        param_tensors=2,
        gemms=(Gemm(64, 64), Gemm(64, 64)),
        moved=Moved(outside=10, ops=3),
    )
    model = ModelCost(blocks=(block,), hidden_size=64, traced_batch=1, traced_seq=16)

    def step(**figures):
        setup = Setup(
            device=_device(comm_overlap=False, **figures),
            devices_per_node=1,
            nodes=1,
            seq_len=16,
            global_batch=1,
            dtype="fp32",
        )
        return estimate(StageTable(model), Strategy(), setup).estimate.step_time_s

    # 5 ops in the forward, twice that in the backward, 2 updates: 3 x 5 + 2 = 17 ops a step.
    assert step(dispatch_overhead_s=100e-6) - step() == pytest.approx(17 * 100e-6)
    # It adds to the kernel-level fixed cost: the same as op_overhead_s of that size.
    assert step(op_overhead_s=40e-6, dispatch_overhead_s=60e-6) == pytest.approx(step(op_overhead_s=100e-6))


def test_matmul_pays_launch_and_dispatch_on_top_of_its_roofline():
    from autodist.planner.cost.compute import matmul_time

    device = _device(op_overhead_s=10e-6, dispatch_overhead_s=30e-6)
    # 2 x 128^3 FLOPs at 50 TFLOP/s = 84 ns; bytes 3 x 128^2 x 2 at 1 TB/s = 98 ns (memory-bound).
    assert matmul_time(128, 128, 128, device, "bf16") == pytest.approx(3 * 128 * 128 * 2 / 1e12 + 40e-6)
