"""Training loops written the way people write them train under autodist's plans exactly as on
one device: the scripts in ``scripts/`` change only by the README's lines (``apply_plan`` when a
plan is given), log on rank 0 only, and match the single-device run of the same script within
1e-5 (losses rank 0 read with ``float(loss)``, parameters from the checkpoint they save).

Each script is self-contained, as a user's is: they repeat their data, logging and saving lines
on purpose (``duplicates`` lists them), and share nothing with the harness's training code.

Every script runs under dp2, mp2 and dp2 x mp2 (2 and 4 gloo ranks), except where a plan does
not apply to it:

- (a) also resumes under mp2 from the dp2 run's step-3 checkpoint (2 -> 2 ranks; other plan
  pairs are ``tests/test_checkpoint_replan.py``'s);
- (c) runs AMP O1 and O2 under each plan;
- (e) DistributedBatchSampler works under dp2, where its parts are the dp parts, and is refused
  in one line under mp2 and dp2 x mp2, where they are not;
- (g) habits that trained silently wrong before, under dp2 only (the plan where each is seen):
  ranks seeded apart before the build (``paddle.seed(seed + rank)``, PaddleFormers' ``set_seed``)
  train as one device, and so does an eval loader with a short last batch read as it is; a train
  loader Paddle would pad, and a script that drops ``apply_plan``'s return value, end before
  training with one error on every rank;
- (h) the optimizer built after ``apply_plan``, from the returned model's parameters: trains as
  one device under mp2, and is refused in one line where it would train wrong (an MoE model's
  gradients, which only the returned optimizer sums over ranks; a plan's micro-batches);
- (f) the tie by function call runs pp2 1F1B, the plan it is about (2 ranks; gloo's batched
  P2P replaced by the TEST-ONLY blocking stand-in, cpu_stand_ins.py): the script uses the
  README's pipeline lines (``model.step``), which only a pipeline plan has. Rank 0 holds the
  first stage and logs the losses the last stage computed. (Its tie under mp2 is
  ``tests/test_tied_by_call.py``'s.) An MoE model under ep2 is ``test_readable.py``'s loop.

Launches are the cost (2 cores): each script x plan runs once, plans are made once per session
(in the test process, each model traced once), and the single-device runs of every script are
made once per session, together in one process (one_device.py).
"""

from __future__ import annotations


import pytest

from loop_runs import ZERO_GRADIENT, assert_same_training, launch_script, run_script

pytestmark = pytest.mark.multiprocess

#: The plans every script runs under, where they apply (2, 2 and 4 ranks).
PLANS = ["dp2", "mp2", "dp2mp2"]


@pytest.fixture(scope="module")
def adamw_runs(loop_plans, tmp_path_factory):
    """``adamw_runs(plan)``: loop (a) under ``plan``, once per module (the resume reuses dp2's)."""
    runs: dict = {}

    def get(plan: str):
        if plan not in runs:
            ranks, path = loop_plans("gpt", plan)
            runs[plan] = run_script("adamw_schedule.py", tmp_path_factory.mktemp(f"adamw_{plan}"), ranks, path)
        return runs[plan]

    return get


@pytest.mark.parametrize("plan", PLANS)
def test_adamw_warmup_cosine_clip_eval_checkpoints(plan, adamw_runs, single_device):
    run = adamw_runs(plan)
    reference = single_device("adamw_schedule.py")
    assert_same_training(run, reference, keys=("losses", "eval", "accuracy", "lr"), exempt=ZERO_GRADIENT)
    assert sorted(run.log["eval"]) == ["3", "6"]


def test_adamw_resumes_under_another_plan(adamw_runs, loop_plans, single_device, tmp_path):
    first = adamw_runs("dp2")
    _, mp2 = loop_plans("gpt", "mp2")
    resumed = run_script("adamw_schedule.py", tmp_path / "resumed", 2, mp2, "--resume-from", str(first.out / "ckpt-3"))
    reference = single_device("adamw_schedule.py")
    assert sorted(resumed.log["losses"]) == ["4", "5", "6"]
    for key in ("losses", "lr"):
        for step, value in resumed.log[key].items():
            assert value == pytest.approx(reference.log[key][step], rel=1e-5), (key, step)
    assert_same_training(resumed, reference, keys=(), exempt=ZERO_GRADIENT)


def test_an_optimizer_built_after_apply_plan_trains_as_one_device_under_mp2(loop_plans, single_device, tmp_path):
    ranks, path = loop_plans("gpt", "mp2")
    run = run_script("optimizer_after.py", tmp_path, ranks, path)
    assert_same_training(run, single_device("optimizer_after.py"), params=False)


def test_a_z_loss_on_vocabulary_split_logits_trains_as_one_device_under_mp2(loop_plans, single_device, tmp_path):
    """The logits arrive split over the vocabulary; Paddle 3.3.1's ``logsumexp`` alone summed the
    halves' (step 1 under mp2: loss 5.0467 and z 53.87 for one device's 4.6986 and 19.06)."""
    ranks, path = loop_plans("gpt", "mp2")
    run = run_script("z_loss.py", tmp_path, ranks, path)
    assert_same_training(run, single_device("z_loss.py"), keys=("losses", "z"), params=False)


@pytest.mark.parametrize(
    ("model", "plan_name", "message"),
    [
        (
            "mixtral",
            "dp2",
            "ValueError: this model was applied without an optimizer, but its MoE layers' gradients are summed over "
            "the ranks that share them only by the optimizer apply_plan returns; pass yours",
        ),
        (
            "gpt",
            "dp2m2",
            "optimizer: none given, but this plan accumulates 2 micro-batches per update: the loader apply_plan "
            "returns yields micro-batches, which only the optimizer it returns sums into one update; pass yours",
        ),
    ],
    ids=["moe_gradients_unsummed", "micro_batches_stepped_apart"],
)
def test_an_optimizer_built_after_apply_plan_is_refused_where_it_would_train_wrong(
    model, plan_name, message, loop_plans, tmp_path
):
    """Under dp2 a Mixtral whose optimizer was made after apply_plan trained each rank's MoE
    copies apart (step 2: 4.6161 against one device's 4.6078) and with micro-batches a plain
    optimizer updates after each: both end before the first update, on every rank."""
    ranks, path = loop_plans(model, plan_name)
    job = launch_script("optimizer_after.py", tmp_path, ranks, path, "--model", model)
    assert all(p.returncode == 1 for p in job.processes), job.report()
    for process in job.processes:
        assert message in process.stderr, process.stderr[-2000:]
        assert "step 1" not in process.stdout


def test_clip_grad_norm_is_refused_in_one_line_where_ranks_hold_their_own_experts(loop_plans, tmp_path):
    """Under ep2 each rank holds its own experts, whose gradients the optimizer sums over their
    ranks at its step: no norm of one rank's gradients is the model's (a loop clipping Mixtral so
    logged 2.9966 for one device's 3.0993, and clipped by it). It is refused on every rank before
    the first update."""
    ranks, path = loop_plans("mixtral", "ep2")
    job = launch_script("accumulate.py", tmp_path, ranks, path, "--model", "mixtral")
    assert all(p.returncode == 1 for p in job.processes), job.report()
    for process in job.processes:
        assert (
            "ValueError: paddle.nn.utils.clip_grad_norm_ under this plan sees this rank's experts' gradients alone, "
            "before the optimizer sums them over their ranks, so its norm is not the model's: clip in the optimizer "
            "instead, grad_clip=paddle.nn.ClipGradByGlobalNorm(max_norm)"
        ) in process.stderr, process.stderr[-2000:]
        assert "update 1" not in process.stdout


@pytest.mark.parametrize("plan", PLANS)
def test_manual_gradient_accumulation_and_clip_grad_norm(plan, loop_plans, single_device, tmp_path):
    ranks, path = loop_plans("gpt", plan)
    """The gradient norm ``clip_grad_norm_`` returns (and clips by) is one device's: Paddle 3.3
    sums the split halves' norms (exact_reductions.py; mp2 logged 3.199 for 2.223 without it)."""
    run = run_script("accumulate.py", tmp_path, ranks, path)
    reference = single_device("accumulate.py")
    assert_same_training(run, reference, keys=("losses", "norms"), exempt=ZERO_GRADIENT)
    assert sorted(run.log["norms"]) == ["1", "2"] and min(reference.log["norms"].values()) > 1.0  # it clips


@pytest.mark.parametrize("plan", PLANS)
@pytest.mark.parametrize("level", ["O1", "O2"])
def test_amp_auto_cast_grad_scaler_and_decorate(level, plan, loop_plans, single_device, tmp_path):
    ranks, path = loop_plans("gpt", plan)
    run = run_script("amp.py", tmp_path, ranks, path, "--level", level)
    assert_same_training(run, single_device("amp.py", "--level", level), exempt=ZERO_GRADIENT)


@pytest.mark.parametrize("plan", PLANS)
def test_paddleformers_model_returns_its_own_loss(plan, loop_plans, single_device, tmp_path):
    ranks, path = loop_plans("llama", plan)
    run = run_script("paddleformers_labels.py", tmp_path, ranks, path)
    assert_same_training(run, single_device("paddleformers_labels.py"))


def test_a_distributed_batch_sampler_over_the_dp_ranks_just_works(loop_plans, single_device, tmp_path):
    ranks, path = loop_plans("gpt", "dp2")
    run = run_script("distributed_sampler.py", tmp_path, ranks, path)
    assert_same_training(run, single_device("distributed_sampler.py"), exempt=ZERO_GRADIENT)


@pytest.mark.parametrize(("plan", "dp"), [("mp2", 1), ("dp2mp2", 2)])
def test_a_distributed_batch_sampler_over_every_rank_is_refused_in_one_line(plan, dp, loop_plans, tmp_path):
    """Under mp2 (dp2 x mp2) the script's sampler splits the data 2 (4) ways, so the mp ranks of a
    dp group would read different samples (under dp2 x mp2 it trained silently wrong before: step
    1 4.630 vs 4.508)."""
    ranks, path = loop_plans("gpt", plan)
    job = launch_script("distributed_sampler.py", tmp_path, ranks, path)
    assert all(p.returncode == 1 for p in job.processes), job.report()
    for rank, process in enumerate(job.processes):
        assert (
            f"rank {rank} failed validation: dataloader: its DistributedBatchSampler gives this rank part {rank} "
            f"of {ranks}, but the plan reads each batch in dp={dp} parts" in process.stderr
        )
        assert "use paddle.io.BatchSampler(dataset, batch_size=4) and apply_plan splits it" in process.stderr


@pytest.fixture(scope="module")
def tied_pp2(loop_plans, tmp_path_factory):
    ranks, path = loop_plans("nanogpt", "pp2")
    return run_script("tied_pipeline.py", tmp_path_factory.mktemp("tied_pp2"), ranks, path, stand_ins=True)


def test_a_tie_by_function_call_trains_under_1f1b_and_rank_0_logs_the_loss(tied_pp2, single_device):
    assert_same_training(tied_pp2, single_device("tied_pipeline.py"), keys=("losses",), params=False)
    assert sorted(tied_pp2.log["losses"]) == ["1", "2", "3"]


def test_a_tie_by_function_call_under_1f1b_ends_with_the_single_device_parameters(tied_pp2, single_device):
    assert_same_training(tied_pp2, single_device("tied_pipeline.py"), keys=())


@pytest.mark.parametrize(
    ("plan_name", "seed", "args"),
    [
        ("dp2", "paddle", ()),
        ("dp2", "paddleformers", ()),
        ("mp2", "paddleformers", ()),
        # Whole eval batches: a dense batch of 3 under dp2 x mp2 stops in the attention's reshape
        # (Paddle splits it over dp there: "local_shape[0] is 3 and shard mesh dims is 2"), loudly.
        ("dp2mp2", "paddle", ("--eval-samples", "8")),
        # Built lazily, each rank draws every parameter whole from its generator: rank 0's now.
        ("mp2", "paddle", ("--lazy",)),
    ],
    ids=["dp2", "dp2-set_seed", "mp2-set_seed", "dp2mp2", "mp2-lazy"],
)
def test_ranks_seeded_apart_before_the_build_train_as_one_device(
    plan_name, seed, args, loop_plans, single_device, tmp_path
):
    """Each rank built its own model (seeded 2024 + rank; PaddleFormers' set_seed after a bare
    fleet.init does the same per dp rank): apply_plan gives every rank rank 0's model before it
    shards it (replicas.py), so every piece is one device's. Without that the dp2 run logged
    4.53270 at step 1 against 4.50802 on one device, on both ranks alike; under mp2 and dp2 x mp2
    rank 1's columns of every split weight were its own draw, and both logged 4.47414 (copied over
    dp from ranks 0 and 1, before). The eval loader's last batch reads as on one device."""
    ranks, path = loop_plans("gpt", plan_name)
    run = run_script("seeded_per_rank.py", tmp_path, ranks, path, "--seed", seed, *args)
    eager = [arg for arg in args if arg != "--lazy"]  # one device builds eagerly (nothing applies a lazy build)
    assert_same_training(
        run, single_device("seeded_per_rank.py", "--seed", seed, *eager), keys=("losses", "eval"), exempt=ZERO_GRADIENT
    )
    assert sorted(run.log["eval"]) == ["1", "2"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--samples", "13"],
            "dataloader: 13 samples do not split over dp=2: Paddle's shard_dataloader would pad them to 14 with "
            "repeats of the first samples and train on those; give the DataLoader drop_last=True",
        ),
        (
            ["--discard-return"],
            "ValueError: this optimizer was replaced by apply_plan and holds the model's old parameters, so it would "
            "train nothing: use the optimizer apply_plan returns, model, opt, loader = apply_plan(model, opt, loader, "
            "plan)",
        ),
    ],
    ids=["last_batch_padded", "return_value_dropped"],
)
def test_a_habit_that_would_train_wrong_ends_before_training_on_every_rank(args, message, loop_plans, tmp_path):
    ranks, path = loop_plans("gpt", "dp2")
    job = launch_script("seeded_per_rank.py", tmp_path, ranks, path, *args)
    assert all(p.returncode == 1 for p in job.processes), job.report()
    for process in job.processes:
        assert message in process.stderr, process.stderr[-2000:]
        assert "step 1" not in process.stdout


def test_paddle_save_of_the_state_on_rank_0_under_dp_writes_one_devices_file(loop_plans, single_device, tmp_path):
    """``paddle.save(model.state_dict())`` and the optimizer's on rank 0, the single-device habit:
    Paddle 3.3.1 alone fails on the distributed tensors (``'DistTensor' object has no attribute
    '_is_initialized'``). Under dp every rank holds them whole, so the files are one device's."""
    import numpy as np
    import paddle

    one = single_device("plain_save.py")
    ranks, path = loop_plans("gpt", "dp2")
    run = run_script("plain_save.py", tmp_path, ranks, path)
    assert run.log["losses"] == pytest.approx(one.log["losses"], abs=1e-5)
    got, want = paddle.load(str(run.out / "model.pdparams")), paddle.load(str(one.out / "model.pdparams"))
    assert sorted(got) == sorted(want)
    for key in want:
        g, w = got[key].numpy(), want[key].numpy()
        if key in ZERO_GRADIENT:  # AdamW's step on a gradient that is rounding noise (loop_runs.py)
            g[ZERO_GRADIENT[key]] = w[ZERO_GRADIENT[key]] = 0
        np.testing.assert_allclose(g, w, atol=1e-5, err_msg=key)
    # The optimizer's state is keyed by its tensors' names, which differ (an unmatched one is
    # refused by Paddle's set_state_dict); its values are the moments, one device's like the above.
    moments = paddle.load(str(run.out / "opt.pdopt"))
    assert sum(isinstance(v, paddle.Tensor) for v in moments.values()) == sum(
        isinstance(v, paddle.Tensor) for v in paddle.load(str(one.out / "opt.pdopt")).values()
    )


@pytest.mark.parametrize(
    "model, plan_name, message",
    [
        ("gpt", "mp2", "is split (or a pending sum) by autodist's plan, so no rank holds it whole; call "),
        ("mixtral", "ep2", "paddle.save under this plan: this rank holds its own experts only, so no rank's tensors"),
    ],
    ids=["split", "experts_apart"],
)
def test_paddle_save_of_state_no_rank_holds_whole_is_refused_in_one_line(
    model, plan_name, message, loop_plans, tmp_path
):
    """Under mp the state dict holds pieces, under ep each rank its own experts: a file saved by
    rank 0 would not be the model (or Paddle fails deep inside). Refused before the path is
    touched, naming save_checkpoint and export_checkpoint; no rank is left waiting."""
    ranks, path = loop_plans(model, plan_name)
    job = launch_script("plain_save.py", tmp_path, ranks, path, "--model", model)
    assert job.processes[0].returncode == 1, job.report()
    assert message in job.processes[0].stderr, job.processes[0].stderr[-2000:]
    assert "autodist.save_checkpoint(model, optimizer, directory) on every rank" in job.processes[0].stderr
    assert not (tmp_path / "model.pdparams").exists()
    assert "step 2" not in job.processes[0].stdout


@pytest.mark.parametrize("plan", ["dp2", "mp2"])
def test_fleet_distributed_optimizer_on_the_returned_optimizer_trains_as_one_device(
    plan, loop_plans, single_device, tmp_path
):
    ranks, path = loop_plans("gpt", plan)
    run = run_script("fleet_habits.py", tmp_path, ranks, path, "--wrap", "optimizer")
    assert_same_training(run, single_device("fleet_habits.py"), params=False)


@pytest.mark.parametrize(
    "wrap, wrapper", [("model", "fleet.distributed_model"), ("data_parallel", "paddle.DataParallel")]
)
def test_wrapping_the_returned_model_again_is_refused_in_one_line(wrap, wrapper, loop_plans, tmp_path):
    """Paddle's wrappers copy the distributed parameters as dense tensors: SIGSEGV on every rank,
    no traceback. Refused before they run, naming the line to drop."""
    ranks, path = loop_plans("gpt", "mp2")
    job = launch_script("fleet_habits.py", tmp_path, ranks, path, "--wrap", wrap)
    for process in job.processes:
        assert process.returncode == 1, job.report()
        assert (
            f"ValueError: {wrapper}: this model was distributed by autodist.apply_plan, whose plan already runs its "
            f"data and model parallelism; drop the {wrapper}(model) line"
        ) in process.stderr, process.stderr[-2000:]
