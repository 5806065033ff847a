"""``autodist-plan calibrate``: shapes from a plan, the fits, the cluster.toml it writes."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Callable

import pytest
from harness.model_files import TINY_LM, train_script

from autodist.planner.cost.calibrate import (
    TRAINING_STEPS,
    Measurements,
    cluster_toml,
    fit_line,
    fit_link,
    fitted_device,
    plan_gemm_shapes,
    plan_messages,
)
from autodist.planner.cost.comm import Link, all_gather_time, all_reduce_time
from autodist.planner.cost.hardware import PROFILES, load_cluster_file
from autodist.schemas import load_plan
from harness.planning import plan_command

REPO = Path(__file__).resolve().parents[1]


def paddle_has_cuda() -> bool:
    import paddle

    return paddle.is_compiled_with_cuda() and paddle.device.cuda.device_count() > 0


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


def test_the_plans_own_messages_are_what_the_cost_model_prices():
    plan = load_plan(REPO / "plans" / "llama_docstring" / "plan_8dev.json")  # dp4 x mp2, fp32 (its parameters')
    messages = plan_messages(plan)
    # mp: the row-parallel outputs (o_proj, down_proj), the head's input gradient and the lookup's output
    # (looked up on local tensors under sequence parallelism and ZeRO 3 too), [4 x 1024 tokens over dp4,
    # 2048] in fp32, all-reduced (as the step time prices it: comm.vocab_lookup_collective)
    assert plan.vocab_lookup and plan.strategy.sequence_parallel and plan.strategy.sharding_stage == 3
    assert messages["mp"] == (("all_reduce",), [1024 * 2048 * 4])
    # dp: one gradient per parameter, its local size: a norm [2048]; q/k/v/o [2048, 1024] and the MLP
    # [2048, 2048] per mp rank, the median of the four sizes; the vocabulary-split embedding [4000, 2048]
    assert messages["dp"] == (("reduce_scatter", "all_gather"), [2048 * 4, 2048 * 2048 * 4, 4000 * 2048 * 4])


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
    assert fitted.latency_s == pytest.approx(alpha) and fitted.bandwidth == pytest.approx(bandwidth)
    assert fitted.latency_per_rank_s is None  # one group size: no growth to tell apart
    assert fit_link(timings, "inter") is None  # one node: nothing measured across nodes


def test_a_fit_at_two_group_sizes_prices_both_as_measured():
    # As measured here (docs/benchmarks.md): a ring step over 4 ranks took ~4x the 2-rank step.
    # Timings made by the alpha-beta ring with alpha(p) = 200 us + (p - 2) x 700 us, 1.3 GB/s.
    alpha, per_rank, bandwidth = 200e-6, 700e-6, 1.3e9
    truth = Link(bandwidth, alpha, per_rank)
    sizes = (4096, 2**18, 2**22, 2**24)
    timings = {("intra", "all_reduce", p): [(n, all_reduce_time(n, p, truth)) for n in sizes] for p in (2, 4)} | {
        ("intra", "all_gather", p): [(n, all_gather_time(n, p, truth)) for n in sizes] for p in (2, 4)
    }
    assert timings[("intra", "all_reduce", 4)][0][1] == pytest.approx(6 * (200e-6 + 2 * 700e-6) + 1.5 * 4096 / 1.3e9)
    fit = fit_link(timings, "intra")
    assert (fit.latency_s, fit.latency_per_rank_s, fit.bandwidth) == pytest.approx((alpha, per_rank, bandwidth))
    fitted = Link(fit.bandwidth, fit.latency_s, fit.latency_per_rank_s)
    for (_, name, p), points in timings.items():
        priced = {"all_reduce": all_reduce_time, "all_gather": all_gather_time}[name]
        for n, seconds in points:  # both group sizes reproduced, the 4 KB 4-rank all-reduce included
            assert priced(n, p, fitted) == pytest.approx(seconds, rel=1e-6)
    # ... and cluster.toml carries it to the planner
    device = fitted_device(Measurements(collectives=timings), PROFILES["cpu"], "fp32", "lab", comm_overlap=False)
    assert device["intra_node_latency_per_rank_us"] == pytest.approx(700.0)
    assert "inter_node_latency_per_rank_us" not in device  # not measured: the base's 0 kept


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
    assert profile.intra_node_latency_per_rank_s == 0.0  # one group size measured: not fitted
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
    """A dp2 ZeRO-3 plan for GPUs (its gradients reduce-scatter), calibrated on 2 gloo ranks: what
    gloo can run is measured, the reduce-scatter it lacks is reported. The tiny docstring Llama
    keeps the matmuls at the plan's shapes quick (the checked-in 2-device plan, hidden 2048, took
    most of a minute on 2 cores)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", **TINY_LLAMA}
    plan = plan_tiny_llama(
        ["--devices", "2", "--dp", "2", "--zero", "3", "--device", "h100-sxm"], tmp_path / "plan.json"
    )
    assert load_plan(plan).strategy.sharding_stage == 3
    out = launched_calibrate(tmp_path, 2, env, "--plan", str(plan))
    profile = load_cluster_file(str(out))
    assert profile.comm_overlap is False and profile.op_overhead_s > 0 and profile.memory_bandwidth > 0
    assert 0 < profile.matmul_efficiency <= 1
    text = out.read_text()
    assert "intra_all_reduce_2ranks" in text and "intra_send_recv_2ranks" in text
    assert "reduce_scatter (intra-node)" in text  # gloo has none: reported, not replaced
    # gloo cannot run a collective beside a matmul: the cpu profile's 1 kept, and said
    assert profile.overlap_compute_loss == 1.0 and "overlap_compute_loss: this backend (gloo)" in text


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
    dispatch = {"dispatch_overhead_s": 150e-6}
    device = fitted_device(measured, PROFILES["cpu"], "fp32", "lab", comm_overlap=False, dispatch=dispatch)
    path = tmp_path / "cluster.toml"
    path.write_text(cluster_toml(device, measured, []))
    assert load_cluster_file(str(path)).dispatch_overhead_s == pytest.approx(150e-6)
    # one kind timed: the other kinds' figures are left out, so they are priced with this one
    assert "data_parallel_dispatch_overhead_us" not in device
    assert load_cluster_file(str(path)).data_parallel_dispatch_overhead_s is None
    assert "training_step_s = 0.1" in path.read_text() and "priced_step_s = 0.04" in path.read_text()
    # Not measured: not written, so the base's (0) holds and the profile prices as before.
    device = fitted_device(measured, PROFILES["cpu"], "fp32", "lab", comm_overlap=False)
    path.write_text(cluster_toml(device, measured, []))
    assert "dispatch_overhead_us" not in device and load_cluster_file(str(path)).dispatch_overhead_s == 0.0
    assert all(profile.dispatch_overhead_s == 0.0 for profile in PROFILES.values())
    kinds = ("data_parallel_dispatch_overhead_s", "tensor_parallel_dispatch_overhead_s", "hybrid_dispatch_overhead_s")
    assert all(getattr(profile, kind) is None for profile in PROFILES.values() for kind in kinds)


def test_the_overlap_loss_is_measured_where_collectives_run_beside_compute_and_said_where_not(tmp_path):
    from autodist.planner.cost.calibrate import overlap_loss_from, overlap_probe, overlap_unmeasurable

    # 20 matmuls: 40 ms alone, 50 ms beside the all-reduces: a fifth of the speed lost.
    measured = Measurements(overlap=(4096, 2048, 2048, 16 << 20, 0.040, 0.050))
    device = fitted_device(measured, PROFILES["h100-sxm"], "bf16", "lab", comm_overlap=True)
    assert device["overlap_compute_loss"] == pytest.approx(0.2)
    path = tmp_path / "cluster.toml"
    path.write_text(cluster_toml(device, measured, []))
    assert load_cluster_file(str(path)).overlap_compute_loss == pytest.approx(0.2)
    assert "overlap = [4096, 2048, 2048, 16777216, 0.04, 0.05]" in path.read_text()
    # clamped to [0, 0.99]: faster beside than alone is noise
    assert overlap_loss_from(0.05, 0.04) == 0.0 and overlap_loss_from(0.04, 40.0) == 0.99
    # gloo runs a collective on the thread that computes: nothing to time, the base's figure kept
    assert "gloo" in overlap_unmeasurable(False, 2) and "one rank" in overlap_unmeasurable(True, 1)
    assert overlap_unmeasurable(True, 2) == ""
    kept = fitted_device(Measurements(), PROFILES["cpu"], "fp32", "lab", comm_overlap=False)
    assert kept["overlap_compute_loss"] == PROFILES["cpu"].overlap_compute_loss == 1.0
    # the plan's largest matmul (its tokens capped as measure_matmuls caps them: 4e10 FLOPs for
    # three) and data-parallel message (dp4 x mp2: the [4000, 2048] fp32 embedding)
    plan = load_plan(REPO / "plans" / "llama_docstring" / "plan_8dev.json")
    assert (1024, 2048, 4000) in plan_gemm_shapes(plan)
    assert overlap_probe(plan, plan_gemm_shapes(plan)) == (
        (int(4e10 / 3 / (2 * 2048 * 4000)), 2048, 4000),
        4000 * 2048 * 4,
    )
    # a cluster file's figure is a fraction
    from autodist.planner.errors import PlannerError

    path.write_text('[device]\nbase = "h100-sxm"\noverlap_compute_loss = 1.5\n')
    with pytest.raises(PlannerError, match="overlap_compute_loss must be .*at most 1\\)"):
        load_cluster_file(str(path))
    path.write_text('[device]\nbase = "h100-sxm"\noverlap_compute_loss = 0\n')
    assert load_cluster_file(str(path)).overlap_compute_loss == 0.0


TINY_LLAMA = {
    "LLAMA_DOCSTRING_NUM_LAYERS": "2",
    "LLAMA_DOCSTRING_HIDDEN_SIZE": "32",
    "LLAMA_DOCSTRING_INTERMEDIATE_SIZE": "64",
    "LLAMA_DOCSTRING_NUM_HEADS": "4",
    "LLAMA_DOCSTRING_VOCAB_SIZE": "64",
    "LLAMA_DOCSTRING_SEQ_LENGTH": "16",
}
TINY_LLAMA_MODEL = "plans/llama_docstring/model.py"


def plan_tiny_llama(args: list[str], output: Path) -> Path:
    """``autodist-plan`` of the docstring Llama at :data:`TINY_LLAMA`'s sizes, run in this process
    (harness.planning.plan_command: the model traced once for the module, not once a plan)."""
    return plan_command(TINY_LLAMA_MODEL, args, output, environment=TINY_LLAMA)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_calibrate_with_the_model_fits_dispatch_to_a_real_training_step(tmp_path):
    import tomllib

    env = {**os.environ, "OMP_NUM_THREADS": "1", **TINY_LLAMA}
    model = str(REPO / TINY_LLAMA_MODEL)
    plan_args = ["--devices", "2", "--dtype", "fp32", "--sharding-stage", "0", "--no-sequence-parallel"]
    plan = plan_tiny_llama([*plan_args, "--dp", "2", "--device", "cpu"], tmp_path / "plan.json")
    out = launched_calibrate(tmp_path, 2, env, "--plan", str(plan), "--model", model)
    measured = tomllib.loads(out.read_text())["measured"]
    assert measured["training_step_s"] > 0 and measured["priced_step_s"] > 0
    profile = load_cluster_file(str(out))
    # Time per op that the op-level timings do not explain, or none when they price the step longer:
    # the dp2 plan's for strategies without tensor parallelism, its sibling dp1 x mp2's for those with.
    [[sibling, sibling_step, sibling_priced]] = measured["siblings"]
    assert sibling.startswith("dp1 mp2 ") and sibling_step > 0
    dp_only, mp_only = profile.data_parallel_dispatch_overhead_s, profile.tensor_parallel_dispatch_overhead_s
    assert dp_only is not None and (dp_only > 0) == (measured["training_step_s"] > measured["priced_step_s"])
    assert mp_only is not None and (mp_only > 0) == (sibling_step > sibling_priced)
    assert profile.dispatch_overhead_s == dp_only and profile.hybrid_dispatch_overhead_s is None  # the plan's
    measured["sibling_step"], measured["sibling_priced"] = sibling_step, sibling_priced
    # Each strategy priced with the file: its estimate is its own measured step (the fit's definition).
    for degrees, step, priced in (
        (["--dp", "2"], "training_step_s", "priced_step_s"),
        (["--dp", "1", "--mp", "2"], "sibling_step", "sibling_priced"),
    ):
        again = plan_tiny_llama([*plan_args, *degrees, "--cluster", str(out)], tmp_path / "again.json")
        estimate = load_plan(again).estimate.step_time_s
        assert estimate == pytest.approx(max(measured[step], measured[priced]), rel=1e-3), degrees


def test_calibrate_model_without_a_plan_is_one_error(tmp_path):
    model = str(REPO / "plans" / "llama_docstring" / "model.py")
    run = subprocess.run(
        [
            str(Path(sys.executable).parent / "autodist-plan"),
            "calibrate",
            "--model",
            model,
            "-o",
            str(tmp_path / "c.toml"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    message = "--model needs --plan: the training steps run that plan"
    assert run.returncode != 0 and message in run.stderr and "Traceback" not in run.stderr
    assert not (tmp_path / "c.toml").exists()


def _losses_through_train_step(monkeypatch, run: Callable[[], object]) -> list[float]:
    """The loss of every step ``run()`` makes through ``autodist.applier.training.train_step``."""
    from autodist.applier import training

    losses: list[float] = []
    own = training.train_step

    def recorded(loss_of, optimizer, batch) -> float:
        losses.append(own(loss_of, optimizer, batch))
        return losses[-1]

    monkeypatch.setattr(training, "train_step", recorded)
    run()
    monkeypatch.setattr(training, "train_step", own)
    return losses


def _calibrate_steps(tmp_path: Path, model: str) -> Callable[[], float]:
    """calibrate's timed steps (``measure_training_step``) of ``model`` planned for one device."""
    from autodist.planner import driver
    from autodist.planner.cost import calibrate

    plan = plan_command(model, ["--devices", "1", "--device", "cpu"], tmp_path / "one.json")
    loaded = driver.load(model)
    return lambda: calibrate.measure_training_step(loaded.model, load_plan(plan), loaded.input_specs, loaded.loss_fn)


def _train_script(*args: str) -> Callable[[], None]:
    """``examples/train.py ARGS``, in this process."""
    script = train_script()
    return lambda: script.main(list(args))


def test_calibrate_times_the_step_the_training_script_runs(tmp_path, monkeypatch):
    """calibrate --model times ``examples/train.py``'s step, one function (applier/training.py):
    the model file's loss on labels, read every step. For the docstring Llama (vocabulary 64) that
    is its cross-entropy, about ln 64 at the start in both; calibrate timed the mean of its logits
    before (about 0), which at the mp shape moved a step by -20 % to +25 % against training's
    (docs/benchmarks.md, "Calibrate's step against the training script's")."""
    for name, value in TINY_LLAMA.items():
        monkeypatch.setenv(name, value)
    model = str(REPO / "plans" / "llama_docstring" / "model.py")
    timed = _losses_through_train_step(monkeypatch, _calibrate_steps(tmp_path, model))
    trained = _losses_through_train_step(monkeypatch, _train_script("--model", model, "--steps", "3"))
    assert len(timed) == TRAINING_STEPS + 1 and len(trained) == 3  # the first step of each is warm-up
    assert all(abs(loss - math.log(64)) < 0.5 for loss in timed + trained), (timed, trained)


def test_a_model_file_without_a_loss_is_timed_with_the_mean_of_its_output(tmp_path, monkeypatch):
    """A model file that gives no loss has no training script's step (train.py refuses it in one
    line): calibrate times the same step with the mean of the model's first output as the loss."""
    (tmp_path / "lm.py").write_text(TINY_LM)
    model = str(tmp_path / "lm.py")
    timed = _losses_through_train_step(monkeypatch, _calibrate_steps(tmp_path, model))
    assert len(timed) == TRAINING_STEPS + 1
    assert all(abs(loss) < 1.0 for loss in timed), timed  # the logits' mean, not a cross-entropy over 32 ids (~3.5)
    with pytest.raises(SystemExit, match="error: the model file gives no loss"):
        _train_script("--model", model, "--steps", "3")()


def _pipeline_plan(tmp_path: Path) -> Path:
    """The tiny Llama planned for 2 GPUs as a 1F1B pipeline of 2 stages, 2 micro-batches."""
    args = ["--devices", "2", "--pp", "2", "--schedule", "1F1B", "--micro-batches", "2", "--device", "h100-sxm"]
    return plan_tiny_llama([*args, "--dtype", "fp32"], tmp_path / "plan.json")


@pytest.mark.skipif(paddle_has_cuda(), reason="the CPU (gloo) side: a GPU runs the schedule")
def test_calibrate_says_it_cannot_time_the_schedule_gloo_lacks_and_fits_the_rest(tmp_path):
    """gloo lacks batched P2P (it times out), which 1F1B needs: calibrate --model says so in one
    line, on stderr and in the file, times no stand-in, and still writes the fitted device."""
    import tomllib

    env = {**os.environ, "OMP_NUM_THREADS": "1", **TINY_LLAMA}
    plan = _pipeline_plan(tmp_path)
    model = str(REPO / "plans" / "llama_docstring" / "model.py")
    out = tmp_path / "c.toml"
    run = subprocess.run(
        [str(Path(sys.executable).parent / "autodist-plan"), "calibrate", "--plan", str(plan), "--model", model]
        + ["-o", str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    said = [line for line in run.stderr.splitlines() if "training steps under the plan" in line]
    assert said == [
        "not measured: training steps under the plan: the 1F1B schedule needs batched P2P (batch_isend_irecv), "
        "which the gloo backend lacks (it times out (gloo TIMEOUT))"
    ]
    tables = tomllib.loads(out.read_text())
    assert "training_step_s" not in tables["measured"] and "dispatch_overhead_us" not in tables["device"]
    assert any("1F1B schedule" in m for m in tables["measured"]["missing"])
    assert tables["device"]["op_overhead_us"] > 0 and tables["measured"]["matmuls"]  # the rest is fitted


@pytest.mark.multiprocess
def test_the_timed_training_steps_of_a_1f1b_plan_run_its_own_schedule_test_only_stand_in(tmp_path):
    """The CPU proof of the ``gpu`` test below (TEST-ONLY stand-in: gloo's missing batched P2P
    replaced by blocking send/recv, harness/calibrate_schedule_rank.py): on 2 gloo ranks,
    calibrate's ``measure_training_step`` for the pp2 1F1B plan steps apply_plan's schedule
    (``PipelineModel.step``) once per loader batch, warm-up included, each call over the plan's
    2 micro-batches, and returns a median step on every rank. The seconds are not checked (the
    stand-in's, and the machine is shared)."""
    import json

    from harness.launcher import launch_ranks

    from autodist.planner.cost.calibrate import TRAINING_STEPS

    plan = _pipeline_plan(tmp_path)
    model = str(REPO / "plans" / "llama_docstring" / "model.py")
    outs = [tmp_path / f"rank{r}.json" for r in range(2)]
    script = str(Path(__file__).parent / "harness" / "calibrate_schedule_rank.py")
    job = launch_ranks(
        2, [script, model, str(plan), str(tmp_path / "rank{rank}.json")], tmp_path / "ranks", 300, TINY_LLAMA
    )
    job.raise_for_failure()
    for out in outs:
        timed = json.loads(out.read_text())
        assert timed["micro_batches_per_call"] == [2] * (TRAINING_STEPS + 1), timed
        assert timed["seconds"] > 0


@pytest.mark.gpu
@pytest.mark.multiprocess
def test_calibrate_measures_the_overlap_loss_on_gpus(tmp_path):
    """On 2 GPUs (NCCL) the matmul is timed alone and beside asynchronous all-reduces, and the
    loss written is what those timings give, below 1."""
    import tomllib

    out = launched_calibrate(tmp_path, 2, dict(os.environ))
    tables = tomllib.loads(out.read_text())
    m, n, k, nbytes, alone, beside = tables["measured"]["overlap"]
    assert (m, n, k) == (1024, 1024, 1024) and nbytes == 16 << 20 and alone > 0 and beside > 0
    loss = tables["device"]["overlap_compute_loss"]
    assert 0 <= loss < 1 and loss == pytest.approx(max(0.0, 1 - alone / beside), abs=1e-5)
    assert not any("overlap_compute_loss" in m for m in tables["measured"]["missing"])


@pytest.mark.gpu
@pytest.mark.multiprocess
def test_calibrate_times_the_plans_own_1f1b_schedule_on_gpus(tmp_path):
    """Where the backend has batched P2P (NCCL), the training steps timed are the plan's own 1F1B
    schedule (apply_plan's PipelineModel.step), and the dispatch is fitted to them."""
    import tomllib

    env = {**os.environ, **TINY_LLAMA}
    plan = _pipeline_plan(tmp_path)
    model = str(REPO / "plans" / "llama_docstring" / "model.py")
    out = launched_calibrate(tmp_path, 2, env, "--plan", str(plan), "--model", model)
    tables = tomllib.loads(out.read_text())
    assert tables["measured"]["training_step_s"] > 0 and tables["measured"]["priced_step_s"] > 0
    assert not any("training steps" in m for m in tables["measured"]["missing"])
    assert "dispatch_overhead_us" in tables["device"]


@pytest.mark.parametrize("ep", [1, 2])
def test_the_pricer_calibrate_fits_with_prices_the_plans_own_strategy(ep):
    """calibrate fits ``dispatch_overhead_us`` to the plan's step as the planner prices it: an
    expert-parallel plan must be priced with its ep (priced as ep 1, the fit would be to another
    strategy's step; seen in bench/experts.py)."""
    from autodist.planner.cli.calibrate import _plan_pricers
    from autodist.planner.cost.search import SearchRequest
    from autodist.planner.driver import plan_target

    target = "tests/models/zoo/mixtral_moe.py"
    request = SearchRequest(devices_per_node=2, dp=2, mp=1, pp=1, ep=ep, global_batch_size=4, device=PROFILES["cpu"])
    plan = plan_target(target, None, request, {"target": target}).plan
    assert plan.strategy.ep == ep
    assert _plan_pricers(target, [plan], PROFILES["cpu"])[0](0.0) == pytest.approx(plan.estimate.step_time_s, rel=1e-9)


def test_the_fit_charges_each_kind_of_strategy_the_time_per_op_its_own_steps_left(monkeypatch):
    """Recorded steps of dp2 x mp2 and of its siblings dp4 and mp4 (4 ranks, the docstring Llama):
    the fit gives each kind of strategy its own framework time per op, so each, priced with the
    fitted profile as the search prices it, costs its own measured step; the one time per op
    fitted on dp2 x mp2 alone (the fit before) priced dp4 and mp4 at dp2 x mp2's."""
    from dataclasses import replace

    from autodist.planner.cli.calibrate import _plan_pricers
    from autodist.planner.cost.calibrate import fit_dispatches, sibling_degrees
    from autodist.planner.cost.hardware import device_profile
    from autodist.planner.cost.search import SearchRequest
    from autodist.planner.driver import plan_target

    for key, value in {**TINY_LLAMA, "LLAMA_DOCSTRING_HIDDEN_SIZE": "64", "LLAMA_DOCSTRING_SEQ_LENGTH": "32"}.items():
        monkeypatch.setenv(key, value)
    target = "plans/llama_docstring/model.py"
    base = dict(devices_per_node=4, global_batch_size=8, dtype="fp32", sharding_stage=0, sequence_parallel=False)
    request = SearchRequest(**base, device=PROFILES["cpu"], dp=2, mp=2, pp=1)
    hybrid = plan_target(target, None, request, {"target": target}).plan
    siblings = sibling_degrees(hybrid.strategy)
    assert siblings == [(4, 1), (1, 4)]
    plans = [hybrid, *(plan_target(target, None, replace(request, dp=dp, mp=mp), {}).plan for dp, mp in siblings)]
    pricers = _plan_pricers(target, plans, PROFILES["cpu"])
    # recorded steps: dp2 x mp2 left 2.5x the time per op dp4 did (docs/benchmarks.md, the mixed shape)
    ops = [(pricer(1e-3) - pricer(0.0)) / 1e-3 for pricer in pricers]  # priced ops per step
    measured = [pricer(0.0) + n * td for pricer, n, td in zip(pricers, ops, (500e-6, 200e-6, 350e-6))]
    fitted = fit_dispatches([(p.strategy.dp, p.strategy.mp, s, f) for p, s, f in zip(plans, measured, pricers)])
    assert fitted == pytest.approx(
        {
            "hybrid_dispatch_overhead_s": 500e-6,
            "data_parallel_dispatch_overhead_s": 200e-6,
            "tensor_parallel_dispatch_overhead_s": 350e-6,
            "dispatch_overhead_s": 500e-6,  # the plan's: for a kind not timed
        }
    )
    device = fitted_device(Measurements(), PROFILES["cpu"], "fp32", "lab", comm_overlap=False, dispatch=fitted)
    profile = device_profile({"device": device}, "cluster.toml")
    for plan, step in zip(plans, measured):
        again = plan_target(
            target, None, replace(request, device=profile, dp=plan.strategy.dp, mp=plan.strategy.mp), {}
        )
        assert again.plan.estimate.step_time_s == pytest.approx(step, rel=1e-6), plan.strategy
    # The fit before: one time per op, dp2 x mp2's, for every strategy: dp4 priced 300 us too much an op.
    one = fit_dispatches([(2, 2, measured[0], pricers[0])])
    assert one == pytest.approx({"dispatch_overhead_s": 500e-6, "hybrid_dispatch_overhead_s": 500e-6})
    assert pricers[1](one["dispatch_overhead_s"]) - measured[1] == pytest.approx(ops[1] * 300e-6)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_calibrate_measures_the_collectives_on_the_plans_own_groups(tmp_path):
    """A dp2 x mp2 plan on 4 gloo ranks: besides the whole node, its two mp pairs and its two dp
    pairs are measured (each axis's pairs at once), and the file names them."""
    import tomllib

    env = {**os.environ, "OMP_NUM_THREADS": "1", **TINY_LLAMA}
    degrees = ["--devices", "4", "--dp", "2", "--mp", "2"]
    plan = plan_tiny_llama([*degrees, "--device", "cpu", "--dtype", "fp32"], tmp_path / "plan.json")
    out = launched_calibrate(tmp_path, 4, env, "--plan", str(plan))
    text = out.read_text()
    assert "the plan's own groups" in text and "dp [[0, 2], [1, 3]]; mp [[0, 1], [2, 3]]" in text
    measured = tomllib.loads(text)["measured"]
    sizes = 4  # COLLECTIVE_BYTES
    assert len(measured["intra_all_reduce_4ranks"]) == sizes  # the node
    # The dp pairs at COLLECTIVE_BYTES and at the plan's gradients (fp32: a norm [32], q/k/v/o
    # [32, 16] per mp rank, the MLP's and the embedding's [32, 32]); then the mp pairs at
    # COLLECTIVE_BYTES and at the row-parallel outputs ([4 x 16 tokens over dp2, 32] in fp32), the
    # size of the token lookup's output too, which the plan all-reduces (plan.vocab_lookup: the
    # embedding's [64, 32] table is not gathered, so no all-gather is measured at its size).
    pairs = [nbytes for nbytes, _ in measured["intra_all_reduce_2ranks"]]
    assert pairs[sizes : sizes + 3] == [32 * 4, 32 * 16 * 4, 32 * 32 * 4]
    assert pairs[2 * sizes + 3 :] == [32 * 32 * 4] and len(pairs) == 2 * sizes + 4
    assert 64 * 32 * 4 not in [nbytes for nbytes, _ in measured.get("intra_all_gather_2ranks", [])]
    assert "the plan's own messages over dp: all_reduce of 128, 2048, 4096 bytes" in text
    assert "the plan's own messages over mp: all_reduce of 4096 bytes" in text
    profile = load_cluster_file(str(out))
    assert profile.intra_node_latency_s > 0 and profile.intra_node_latency_per_rank_s >= 0  # 2 and 4 ranks
    assert "intra_node_latency_per_rank_us" in tomllib.loads(text)["device"]


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


def test_the_cluster_file_reads_a_latency_that_grows_with_the_group_strictly(tmp_path):
    from autodist.planner.errors import PlannerError

    path = tmp_path / "cluster.toml"
    path.write_text('[device]\nbase = "cpu"\nintra_node_latency_us = 200\nintra_node_latency_per_rank_us = 700\n')
    device = load_cluster_file(str(path))
    assert (device.intra_node_latency_s, device.intra_node_latency_per_rank_s) == pytest.approx((200e-6, 700e-6))
    assert device.inter_node_latency_per_rank_s == 0.0  # not given: the base's
    path.write_text('[device]\nbase = "cpu"\nintra_node_latency_per_rank_us = -1\n')
    with pytest.raises(PlannerError, match=r"\[device\].intra_node_latency_per_rank_us must be a positive, finite"):
        load_cluster_file(str(path))
