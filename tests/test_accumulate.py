"""Gradient accumulation is applied, not only priced: a plan with ``micro_batches > 1`` and no
pipeline trains, through the ordinary loop, exactly like one step on the whole batch."""

from __future__ import annotations

import numpy as np
import paddle
import pytest
from harness.cases import Config, check_against_reference, train_configurations
from harness.plans import tensor_parallel_plan
from harness.workloads import WORKLOADS, make_loader, make_optimizer, train

from autodist.applier import apply_plan
from autodist.applier.modes.accumulate import split_batch
from autodist.applier.placement.validate import plan_problems


def test_split_batch_keeps_structure_and_order():
    batch = {"ids": paddle.arange(8).reshape([4, 2]), "tag": "x", "pair": (paddle.arange(4), paddle.arange(4) * 10)}
    pieces = split_batch(batch, 2)
    assert [p["ids"].tolist() for p in pieces] == [[[0, 1], [2, 3]], [[4, 5], [6, 7]]]
    assert [p["pair"][1].tolist() for p in pieces] == [[0, 10], [20, 30]]
    assert [p["tag"] for p in pieces] == ["x", "x"]


def _train_one_rank(micro_batches: int, steps: int = 3) -> tuple[list[float], dict]:
    """The docstring Llama with AdamW (schedule, clipping): plain at full batch 8, or through a
    one-rank plan that splits each batch of 8 into ``micro_batches``."""
    workload = WORKLOADS["docstring_llama"]
    model = workload.build(seed=7)
    optimizer, schedule = make_optimizer("adamw", model.parameters())
    loader = make_loader(workload, steps=steps, seed=7, batch=8)
    if micro_batches:
        plan = tensor_parallel_plan(model, micro_batches=micro_batches)
        model, optimizer, loader = apply_plan(model, optimizer, loader, plan)
        assert len(loader) == steps * micro_batches  # the loop really sees micro-batches
    losses = train(workload, model, optimizer, schedule, loader, steps)
    return losses, {k: v.numpy() for k, v in model.state_dict().items()}, schedule.last_epoch


def test_one_rank_accumulation_equals_the_whole_batch():
    """The loop sees 4 micro-batches per batch; without accumulation that is 4 updates per
    batch, and without dividing the summed gradients by 4 a 4x larger update."""
    dense_losses, dense_state, dense_epoch = _train_one_rank(0)
    losses, state, epoch = _train_one_rank(4)
    assert epoch == dense_epoch == 3  # the schedule advanced once per update, not per micro-batch
    np.testing.assert_allclose(losses, dense_losses, rtol=1e-5)
    for key in dense_state:
        np.testing.assert_allclose(state[key], dense_state[key], atol=1e-5, err_msg=key)


def test_accumulating_loader_yields_micro_batches():
    workload = WORKLOADS["docstring_llama"]
    model = workload.build(seed=0)
    optimizer, _ = make_optimizer("sgd", model.parameters())
    loader = make_loader(workload, steps=2, seed=0, batch=8)
    _, _, loader = apply_plan(model, optimizer, loader, tensor_parallel_plan(model, micro_batches=4))
    shapes = [list(inputs.shape) for inputs, _ in loader]
    assert shapes == [[2, 8]] * 8


def test_sequential_schedule_with_micro_batches_is_refused():
    model = WORKLOADS["docstring_llama"].build(seed=0)
    problems = plan_problems(model, None, None, tensor_parallel_plan(model, pp=2, micro_batches=2), world_size=2)
    assert any("accumulates micro-batches only without a pipeline" in p for p in problems), problems


@pytest.mark.multiprocess
def test_dp2_with_4_micro_batches_trains_like_full_batch_steps(tmp_path, reference_runs):
    """Two ranks, each splitting its 4 samples into 4 micro-batches of 1 and updating once
    per 8-sample batch, give the single-device losses and parameters of 8-sample steps."""
    config = Config(dp=2, micro_batches=4, batch=8, optimizer="adamw")
    trained = train_configurations("docstring_llama", [config], tmp_path)[config.name]
    assert trained.plan.strategy.micro_batches == 4
    assert [out["micro_batches"] for out in trained.outputs] == [4, 4]
    check_against_reference(trained, reference_runs)


def _learning_rates_per_update(micro_batches: int, steps: int = 4) -> tuple[list[float], int]:
    """The optimizer's learning rate at each call of ``step()`` that changed the parameters,
    through the README loop (``scheduler.step()`` every iteration)."""
    workload = WORKLOADS["docstring_llama"]
    model = workload.build(seed=3)
    schedule = paddle.optimizer.lr.ExponentialDecay(learning_rate=1e-3, gamma=0.5)  # a new rate every step
    optimizer = paddle.optimizer.AdamW(learning_rate=schedule, parameters=model.parameters())
    loader = make_loader(workload, steps=steps, seed=3, batch=8)
    if micro_batches:
        model, optimizer, loader = apply_plan(
            model, optimizer, loader, tensor_parallel_plan(model, micro_batches=micro_batches)
        )
    watched = model.parameters()[0]
    used = []
    for inputs, labels in loader:
        workload.loss(model, inputs, labels).backward()
        rate, before = optimizer.get_lr(), watched.numpy().copy()
        optimizer.step()
        optimizer.clear_grad()
        schedule.step()
        if not np.array_equal(before, watched.numpy()):
            used.append(rate)
    return used, schedule.last_epoch


def test_the_learning_rate_of_each_update_is_the_full_batch_runs():
    """The loop steps the scheduler once per micro-batch; each update still uses the rate the
    single-device, whole-batch run uses at that update, and the schedule counts updates."""
    dense, dense_epoch = _learning_rates_per_update(0)
    accumulated, epoch = _learning_rates_per_update(4)
    assert dense == [1e-3, 5e-4, 2.5e-4, 1.25e-4]
    assert accumulated == dense and epoch == dense_epoch == 4


def test_another_plan_gives_the_scheduler_its_own_step_back():
    """Re-applying (a notebook, a re-plan) never stacks wrappers, and a plan without
    accumulation leaves a scheduler that steps on every call, not one frozen by an old wrapper."""
    workload = WORKLOADS["docstring_llama"]
    schedule = paddle.optimizer.lr.StepDecay(learning_rate=1.0, step_size=1)
    own_step = type(schedule).step
    for micro_batches in (4, 2, 1):
        model = workload.build(seed=0)
        optimizer = paddle.optimizer.SGD(learning_rate=schedule, parameters=model.parameters())
        apply_plan(model, optimizer, None, tensor_parallel_plan(model, micro_batches=micro_batches))
        if micro_batches > 1:
            assert schedule.step.__wrapped__.__func__ is own_step  # one wrapper over the scheduler's own step
    assert "step" not in vars(schedule)
    before = schedule.last_epoch
    schedule.step()
    schedule.step()
    assert schedule.last_epoch == before + 2
