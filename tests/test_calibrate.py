"""``autodist-plan calibrate``: shapes from a plan, the fits, the cluster.toml it writes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from autodist.planner.cost.calibrate import (
    Measurements,
    cluster_toml,
    fit_line,
    fit_link,
    fitted_device,
    plan_gemm_shapes,
)
from autodist.planner.cost.hardware import PROFILES, load_cluster_file
from autodist.schemas import load_plan

REPO = Path(__file__).resolve().parents[1]


def test_gemm_shapes_are_per_rank_as_the_plan_splits_them():
    plan = load_plan(REPO / "plans" / "paddleformers_llama" / "plan_4x8dev_mp8_pp2.json")
    shapes = plan_gemm_shapes(plan)
    # the [8, 2048] batch over dp and micro-batches
    tokens = 8 * 2048 // (plan.strategy.dp * plan.strategy.micro_batches)
    assert (tokens, 2048 // 8, 2048) in shapes  # q_proj [2048, 2048], column-split: n / mp
    assert (tokens, 2048, 5632 // 8) in shapes  # down_proj [5632, 2048], row-split: k / mp
    assert all(m == tokens for m, _, _ in shapes)


def test_fit_recovers_a_known_rate_and_fixed_cost():
    rate, fixed = 50e9, 20e-6
    points = [(w, fixed + w / rate) for w in (1e5, 1e7, 1e9, 4e10)]
    intercept, slope = fit_line(points, relative=True)
    assert intercept == pytest.approx(fixed) and 1 / slope == pytest.approx(rate)


def test_link_fit_uses_the_ring_formulas_of_each_collective():
    alpha, bandwidth, p = 30e-6, 2e9, 4
    timings = {("intra", "all_reduce", p): [(n, 2 * (p - 1) * alpha + 2 * (p - 1) / p * n / bandwidth)
                                            for n in (4096, 2**20, 2**24)],
               ("intra", "all_gather", p): [(n, (p - 1) * alpha + (p - 1) / p * n / bandwidth)
                                            for n in (4096, 2**22)]}
    fitted = fit_link(timings, "intra")
    assert fitted[0] == pytest.approx(alpha) and fitted[1] == pytest.approx(bandwidth)
    assert fit_link(timings, "inter") is None  # one node: nothing measured across nodes


def test_cluster_toml_round_trips_through_the_cluster_file_reader(tmp_path):
    rate, fixed = 40e9, 15e-6  # a CPU: 40 GFLOP/s sustained, 15 us per op
    shapes = [(64, 64, 64), (512, 256, 1024), (1024, 1024, 1024)]
    measured = Measurements(
        matmuls=[(m, n, k, fixed + 2 * m * n * k / rate) for m, n, k in shapes],
        memory=[(3 * 2**22, 3 * 2**22 / 8e9), (3 * 2**24, 3 * 2**24 / 10e9)],
        collectives={("intra", "all_reduce", 2): [(n, 2 * 50e-6 + n / 1e9) for n in (4096, 2**20, 2**24)]},
        missing=['reduce_scatter (intra-node): NotImplementedError: "no"\nsecond line'])
    device = fitted_device(measured, PROFILES["cpu"], "fp32", "lab", comm_overlap=False)
    path = tmp_path / "cluster.toml"
    path.write_text(cluster_toml(device, measured, ["2 rank(s)"]))
    profile = load_cluster_file(str(path))
    assert profile.name == "lab" and profile.comm_overlap is False
    assert profile.matmul_efficiency == pytest.approx(rate / PROFILES["cpu"].peak_flops["fp32"], rel=1e-4)
    assert profile.op_overhead_s == pytest.approx(fixed, rel=1e-3)
    assert profile.memory_bandwidth == pytest.approx(10e9, rel=1e-4)  # the best of the two
    assert profile.intra_node_latency_s == pytest.approx(50e-6, rel=1e-3)
    assert profile.intra_node_bandwidth == pytest.approx(1e9, rel=1e-3)
    # not measured: kept from the base profile
    assert profile.inter_node_bandwidth == PROFILES["cpu"].inter_node_bandwidth
    assert profile.memory_bytes == PROFILES["cpu"].memory_bytes
    text = path.read_text()
    assert "missing = [" in text and "reduce_scatter" in text


def test_a_bad_comm_overlap_in_a_cluster_file_is_named(tmp_path):
    from autodist.planner.errors import PlannerError

    path = tmp_path / "c.toml"
    path.write_text('[device]\nbase = "cpu"\ncomm_overlap = "yes"\n')
    with pytest.raises(PlannerError, match="comm_overlap must be true or false"):
        load_cluster_file(str(path))
    path.write_text('[device]\nbase = "cpu"\nmatmul_efficiency = 1.5\n')
    with pytest.raises(PlannerError, match="matmul_efficiency must be a positive, finite number .*at most 1\\)"):
        load_cluster_file(str(path))


@pytest.mark.multiprocess
@pytest.mark.slow
def test_calibrate_on_two_gloo_ranks_reports_what_gloo_lacks(tmp_path):
    out = tmp_path / "cluster.toml"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = subprocess.run(
        [sys.executable, "-m", "paddle.distributed.launch", "--nproc_per_node", "2", "--log_dir", str(tmp_path / "logs"),
         str(Path(sys.executable).parent / "autodist-plan"), "calibrate", "--plan",
         str(REPO / "plans" / "llama_docstring" / "plan_2dev.json"), "-o", str(out)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    logs = "".join(p.read_text() for p in sorted((tmp_path / "logs").glob("workerlog.*")))
    assert run.returncode == 0, logs[-3000:]
    profile = load_cluster_file(str(out))
    assert profile.comm_overlap is False and profile.op_overhead_s > 0 and profile.memory_bandwidth > 0
    assert 0 < profile.matmul_efficiency <= 1
    text = out.read_text()
    assert "intra_all_reduce_2ranks" in text and "intra_send_recv_2ranks" in text
    assert "reduce_scatter (intra-node)" in text  # gloo has none: reported, not replaced
