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


def launched_calibrate(tmp_path: Path, ranks: int, env: dict, *args: str) -> Path:
    """``autodist-plan calibrate ARGS -o cluster.toml`` on ``ranks`` gloo ranks (paddle's launcher,
    logs under tmp_path/logs); the file it wrote, after asserting it exited 0 (else the logs' tail)."""
    out = tmp_path / "cluster.toml"
    cli = str(Path(sys.executable).parent / "autodist-plan")
    launch = [sys.executable, "-m", "paddle.distributed.launch", "--nproc_per_node", str(ranks)]
    run = subprocess.run(
        [*launch, "--log_dir", str(tmp_path / "logs"), cli, "calibrate", *args, "-o", str(out)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    logs = "".join(p.read_text() for p in sorted((tmp_path / "logs").glob("workerlog.*")))
    assert run.returncode == 0, logs[-3000:]
    return out


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
    timings = {
        ("intra", "all_reduce", p): [
            (n, 2 * (p - 1) * alpha + 2 * (p - 1) / p * n / bandwidth) for n in (4096, 2**20, 2**24)
        ],
        ("intra", "all_gather", p): [(n, (p - 1) * alpha + (p - 1) / p * n / bandwidth) for n in (4096, 2**22)],
    }
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
        missing=['reduce_scatter (intra-node): NotImplementedError: "no"\nsecond line'],
    )
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
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = launched_calibrate(tmp_path, 2, env, "--plan", str(REPO / "plans" / "llama_docstring" / "plan_2dev.json"))
    profile = load_cluster_file(str(out))
    assert profile.comm_overlap is False and profile.op_overhead_s > 0 and profile.memory_bandwidth > 0
    assert 0 < profile.matmul_efficiency <= 1
    text = out.read_text()
    assert "intra_all_reduce_2ranks" in text and "intra_send_recv_2ranks" in text
    assert "reduce_scatter (intra-node)" in text  # gloo has none: reported, not replaced


def test_dispatch_fit_solves_priced_equals_measured():
    from autodist.planner.cost.calibrate import fit_dispatch

    # 250 ops priced per step on top of 40 ms: a 90 ms step leaves 50 ms, 200 us per op.
    assert fit_dispatch(0.090, lambda td: 0.040 + 250 * td) == pytest.approx(200e-6, rel=1e-9)

    # Where overlap hides communication the price grows more slowly: 4 ms of comm is exposed
    # until 100 ops x td cover it. At td = 0: 10 + 4 = 14 ms; at td = 100 us: 10 + 10 + 0 = 20 ms.
    def overlapped(td):
        compute = 0.010 + 100 * td
        return compute + max(0.0, 0.004 - 100 * td)

    assert fit_dispatch(0.020, overlapped) == pytest.approx(100e-6, rel=1e-9)
    assert fit_dispatch(0.012, overlapped) == pytest.approx(0.0, abs=1e-12)  # 14 ms at td = 0 already


def test_dispatch_overhead_round_trips_and_named_profiles_have_none(tmp_path):
    measured = Measurements(matmuls=[(64, 64, 64, 2e-5), (512, 512, 512, 1e-2)], training_step=0.1, priced_step=0.04)
    device = fitted_device(measured, PROFILES["cpu"], "fp32", "lab", comm_overlap=False, dispatch_s=150e-6)
    path = tmp_path / "cluster.toml"
    path.write_text(cluster_toml(device, measured, []))
    assert load_cluster_file(str(path)).dispatch_overhead_s == pytest.approx(150e-6)
    assert "training_step_s = 0.1" in path.read_text() and "priced_step_s = 0.04" in path.read_text()
    # Not measured: not written, so the base's (0) holds and the profile prices as before.
    device = fitted_device(measured, PROFILES["cpu"], "fp32", "lab", comm_overlap=False)
    path.write_text(cluster_toml(device, measured, []))
    assert "dispatch_overhead_us" not in device and load_cluster_file(str(path)).dispatch_overhead_s == 0.0
    assert all(profile.dispatch_overhead_s == 0.0 for profile in PROFILES.values())


TINY_LLAMA = {
    "LLAMA_DOCSTRING_NUM_LAYERS": "2",
    "LLAMA_DOCSTRING_HIDDEN_SIZE": "32",
    "LLAMA_DOCSTRING_INTERMEDIATE_SIZE": "64",
    "LLAMA_DOCSTRING_NUM_HEADS": "4",
    "LLAMA_DOCSTRING_VOCAB_SIZE": "64",
    "LLAMA_DOCSTRING_SEQ_LENGTH": "16",
}


@pytest.mark.multiprocess
@pytest.mark.slow
def test_calibrate_with_the_model_fits_dispatch_to_a_real_training_step(tmp_path):
    import tomllib

    env = {**os.environ, "OMP_NUM_THREADS": "1", **TINY_LLAMA}
    cli = str(Path(sys.executable).parent / "autodist-plan")
    model = str(REPO / "plans" / "llama_docstring" / "model.py")
    plan_args = [
        cli,
        model,
        "--devices",
        "2",
        "--dp",
        "2",
        "--dtype",
        "fp32",
        "--sharding-stage",
        "0",
        "--no-sequence-parallel",
    ]
    subprocess.run(
        [*plan_args, "--device", "cpu", "-o", str(tmp_path / "plan.json")],
        env=env,
        check=True,
        capture_output=True,
        timeout=300,
    )
    out = launched_calibrate(tmp_path, 2, env, "--plan", str(tmp_path / "plan.json"), "--model", model)
    measured = tomllib.loads(out.read_text())["measured"]
    assert measured["training_step_s"] > 0 and measured["priced_step_s"] > 0
    profile = load_cluster_file(str(out))
    # Time per op that the op-level timings do not explain, or none when they price the step longer.
    assert (profile.dispatch_overhead_s > 0) == (measured["training_step_s"] > measured["priced_step_s"])
    # The same plan priced with the file: its estimate is the measured step (the fit's definition).
    subprocess.run(
        [*plan_args, "--cluster", str(out), "-o", str(tmp_path / "again.json")],
        env=env,
        check=True,
        capture_output=True,
        timeout=300,
    )
    estimate = load_plan(tmp_path / "again.json").estimate.step_time_s
    assert estimate == pytest.approx(max(measured["training_step_s"], measured["priced_step_s"]), rel=1e-3)


@pytest.mark.parametrize(
    "plan, message",
    [
        (None, "--model needs --plan: the training steps run that plan"),
        (
            "paddleformers_llama/plan_4x8dev_mp8_pp2.json",
            "--model: training steps under a VPP schedule are not timed yet",
        ),
    ],
)
def test_calibrate_model_without_a_plan_it_can_train_is_one_error(tmp_path, plan, message):
    args = [
        "calibrate",
        "--model",
        str(REPO / "plans" / "llama_docstring" / "model.py"),
        "-o",
        str(tmp_path / "c.toml"),
    ]
    if plan:
        args += ["--plan", str(REPO / "plans" / plan)]
    run = subprocess.run(
        [str(Path(sys.executable).parent / "autodist-plan"), *args], capture_output=True, text=True, timeout=300
    )
    assert run.returncode != 0 and message in run.stderr and "Traceback" not in run.stderr
    assert not (tmp_path / "c.toml").exists()


@pytest.mark.parametrize("ep", [1, 2])
def test_the_pricer_calibrate_fits_with_prices_the_plans_own_strategy(ep):
    """calibrate fits ``dispatch_overhead_us`` to the plan's step as the planner prices it: an
    expert-parallel plan must be priced with its ep (priced as ep 1, the fit would be to another
    strategy's step; seen in bench/experts.py)."""
    from autodist.planner.cli.calibrate import _plan_pricer
    from autodist.planner.cost.search import SearchRequest
    from autodist.planner.driver import plan_target

    target = "tests/models/zoo/mixtral_moe.py"
    request = SearchRequest(devices_per_node=2, dp=2, mp=1, pp=1, ep=ep, global_batch_size=4, device=PROFILES["cpu"])
    plan = plan_target(target, None, request, {"target": target}).plan
    assert plan.strategy.ep == ep
    assert _plan_pricer(target, plan, PROFILES["cpu"])(0.0) == pytest.approx(plan.estimate.step_time_s, rel=1e-9)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_calibrate_measures_the_collectives_on_the_plans_own_groups(tmp_path):
    """A dp2 x mp2 plan on 4 gloo ranks: besides the whole node, its two mp pairs and its two dp
    pairs are measured (each axis's pairs at once), and the file names them."""
    import tomllib

    env = {**os.environ, "OMP_NUM_THREADS": "1", **TINY_LLAMA}
    cli = str(Path(sys.executable).parent / "autodist-plan")
    model = str(REPO / "plans" / "llama_docstring" / "model.py")
    plan = tmp_path / "plan.json"
    subprocess.run(
        [cli, model, "--devices", "4", "--dp", "2", "--mp", "2", "--device", "cpu", "--dtype", "fp32", "-o", str(plan)],
        env=env,
        check=True,
        capture_output=True,
        timeout=300,
    )
    out = launched_calibrate(tmp_path, 4, env, "--plan", str(plan))
    text = out.read_text()
    assert "the plan's own groups" in text and "dp [[0, 2], [1, 3]]; mp [[0, 1], [2, 3]]" in text
    measured = tomllib.loads(text)["measured"]
    sizes = 4  # COLLECTIVE_BYTES
    assert len(measured["intra_all_reduce_4ranks"]) == sizes  # the node
    assert len(measured["intra_all_reduce_2ranks"]) == 2 * sizes  # the dp pairs, then the mp pairs
    assert load_cluster_file(str(out)).intra_node_latency_s > 0


def test_calibrate_on_a_gpu_without_a_profile_follows_the_planner(monkeypatch):
    """A GPU the planner assumes is an h100-sxm (hardware.default_device) is calibrated as one:
    base h100-sxm, bf16 matmuls, collectives beside compute (NCCL), not as this machine's CPU."""
    from autodist.planner.cli.calibrate import machine_defaults
    from autodist.planner.cost import hardware

    monkeypatch.setattr(hardware, "local_cuda_name", lambda: "Tesla V100-SXM2-16GB")
    assert hardware.default_device()[0] == "h100-sxm"
    assert machine_defaults(None, None) == (PROFILES["h100-sxm"], "bf16", True)
    assert machine_defaults("cpu", "fp32") == (PROFILES["cpu"], "fp32", True)
    monkeypatch.setattr(hardware, "local_cuda_name", lambda: None)
    assert machine_defaults(None, None) == (PROFILES["cpu"], "fp32", False)
