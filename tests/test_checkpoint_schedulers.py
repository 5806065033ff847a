"""Every LR scheduler Paddle ships, alone and inside ``LinearWarmup``, and every built-in
optimizer's state round-trip through ``save_checkpoint`` / ``load_checkpoint`` (one process: a
scheduler's state is the same on every rank; the multi-process proof across plans is in
``test_checkpoint_optimizers.py``). A scheduler state that would break the first ``step()`` is
refused at load with nothing changed, and what cannot be saved is refused by ``apply_plan``.
"""

from __future__ import annotations

import inspect
import json

import numpy as np
import paddle
import pytest
from harness.plans import tensor_parallel_plan
from harness.workloads import WORKLOADS

from autodist import CheckpointError, apply_plan, load_checkpoint, save_checkpoint
from autodist.schemas import PlanError
from autodist.planner.review.checkpoint_info import checkpoint_text
from autodist.schemas.checkpoint import METADATA_FILE, read_checkpoint

lr = paddle.optimizer.lr

#: Constructor arguments of each scheduler, small enough that a few steps cross its phases
#: (a boundary, a restart, a cycle). The test below fails when Paddle ships one not listed.
ARGUMENTS = {
    "NoamDecay": dict(d_model=64, warmup_steps=3, learning_rate=1.0),
    "PiecewiseDecay": dict(boundaries=[2, 5], values=[0.1, 0.05, 0.01]),
    "NaturalExpDecay": dict(learning_rate=0.1, gamma=0.3),
    "InverseTimeDecay": dict(learning_rate=0.1, gamma=0.3),
    "PolynomialDecay": dict(learning_rate=0.1, decay_steps=4, cycle=True),
    "LinearWarmup": dict(learning_rate=0.1, warmup_steps=3, start_lr=0.0, end_lr=0.1),
    "ExponentialDecay": dict(learning_rate=0.1, gamma=0.9),
    "MultiStepDecay": dict(learning_rate=0.1, milestones=[2, 4]),
    "StepDecay": dict(learning_rate=0.1, step_size=2),
    "LambdaDecay": dict(learning_rate=0.1, lr_lambda=lambda epoch: 0.9**epoch),
    "ReduceOnPlateau": dict(learning_rate=0.1, patience=1, cooldown=1),
    "CosineAnnealingDecay": dict(learning_rate=0.1, T_max=4),
    "MultiplicativeDecay": dict(learning_rate=0.1, lr_lambda=lambda epoch: 0.9),
    "OneCycleLR": dict(max_learning_rate=0.1, total_steps=20),
    "CyclicLR": dict(base_learning_rate=0.01, max_learning_rate=0.1, step_size_up=3),
    "LinearLR": dict(learning_rate=0.1, total_steps=5),
    "CosineAnnealingWarmRestarts": dict(learning_rate=0.1, T_0=3, T_mult=2),
}
SCHEDULERS = sorted(
    name
    for name, cls in vars(lr).items()
    if inspect.isclass(cls) and issubclass(cls, lr.LRScheduler) and cls is not lr.LRScheduler
)
#: Each scheduler alone, and LinearWarmup around each other one.
CASES = SCHEDULERS + [f"LinearWarmup({name})" for name in SCHEDULERS if name != "LinearWarmup"]


def test_every_scheduler_paddle_ships_is_covered():
    assert SCHEDULERS == sorted(ARGUMENTS)


def make_scheduler(case: str) -> lr.LRScheduler:
    if case.startswith("LinearWarmup("):
        inner = make_scheduler(case.removeprefix("LinearWarmup(").removesuffix(")"))
        return lr.LinearWarmup(inner, warmup_steps=3, start_lr=0.0, end_lr=0.1)
    return getattr(lr, case)(**ARGUMENTS[case])


def step(scheduler: lr.LRScheduler, i: int) -> None:
    if isinstance(scheduler, lr.ReduceOnPlateau):
        scheduler.step(1.0 / (1 + i % 3))  # a metric that improves, stalls and improves again
    else:
        scheduler.step()


def tiny(seed: int, case: str):
    paddle.seed(seed)
    model = paddle.nn.Linear(3, 2)
    scheduler = make_scheduler(case)
    return model, paddle.optimizer.SGD(learning_rate=scheduler, parameters=model.parameters()), scheduler


@pytest.mark.parametrize("case", CASES)
def test_a_scheduler_resumes_at_the_learning_rates_of_an_uninterrupted_run(tmp_path, case):
    """Step 5 times, save, load into a fresh scheduler; 7 more steps give the same learning
    rates as 12 uninterrupted ones (CosineAnnealingWarmRestarts restarted its cycle on load, and
    LinearWarmup around anything could not be saved)."""
    model, optimizer, scheduler = tiny(1, case)
    for i in range(5):
        step(scheduler, i)
    save_checkpoint(model, optimizer, tmp_path / "ckpt", step=5)
    _, fresh_optimizer, fresh = tiny(2, case)
    load_checkpoint(paddle.nn.Linear(3, 2), fresh_optimizer, tmp_path / "ckpt")
    assert fresh.state_dict() == scheduler.state_dict()
    uninterrupted, resumed = [], []
    for i in range(5, 12):
        step(scheduler, i)
        step(fresh, i)
        uninterrupted.append(scheduler())
        resumed.append(fresh())
    assert resumed == uninterrupted


def test_a_nested_schedule_records_the_class_it_wraps(tmp_path):
    model, optimizer, _ = tiny(1, "LinearWarmup(CosineAnnealingDecay)")
    save_checkpoint(model, optimizer, tmp_path / "ckpt", step=0)
    raw = json.loads((tmp_path / "ckpt" / METADATA_FILE).read_text())
    assert raw["scheduler"]["class_name"] == "LinearWarmup"
    assert raw["scheduler"]["nested"]["LinearWarmup_LR"]["class_name"] == "CosineAnnealingDecay"
    scheduler_line = checkpoint_text(read_checkpoint(tmp_path / "ckpt"), "ckpt").splitlines()[6]
    assert scheduler_line == (
        "scheduler   LinearWarmup (last_epoch=0, last_lr=0.0, "
        "LinearWarmup_LR=CosineAnnealingDecay (last_epoch=0, last_lr=0.1))"
    )


# -- refused at load, nothing changed -------------------------------------------------------------------


def everything(model, optimizer, scheduler):
    inner = getattr(scheduler, "learning_rate", None)  # LinearWarmup's wrapped scheduler
    return (
        {fqn: p.numpy().tobytes() for fqn, p in model.named_parameters()},
        {f"{k}/{n}": t.numpy().tobytes() for k, per in optimizer._accumulators.items() for n, t in per.items()},
        json.dumps(scheduler.state_dict(), sort_keys=True, default=str),
        [
            {k: v for k, v in vars(s).items() if isinstance(v, (int, float))}
            for s in (scheduler, inner)
            if s is not None
        ],
    )


def tampered(tmp_path, case, edit):
    """A checkpoint of ``case`` after 5 steps of Momentum, its metadata edited by ``edit``."""
    model, _, scheduler = tiny(1, case)
    optimizer = paddle.optimizer.Momentum(learning_rate=scheduler, parameters=model.parameters())
    for i in range(5):
        (model(paddle.ones([2, 3])) ** 2).mean().backward()
        optimizer.step()
        optimizer.clear_grad()
        step(scheduler, i)
    save_checkpoint(model, optimizer, tmp_path / "ckpt", step=5)
    raw = json.loads((tmp_path / "ckpt" / METADATA_FILE).read_text())
    edit(raw["scheduler"])
    (tmp_path / "ckpt" / METADATA_FILE).write_text(json.dumps(raw))
    return tmp_path / "ckpt"


def a_trained_momentum(case):
    """A model, Momentum and scheduler that have stepped once (states to leave untouched)."""
    model, _, scheduler = tiny(3, case)
    optimizer = paddle.optimizer.Momentum(learning_rate=scheduler, parameters=model.parameters())
    (model(paddle.ones([2, 3])) ** 2).mean().backward()
    optimizer.step()
    optimizer.clear_grad()
    step(scheduler, 0)
    return model, optimizer, scheduler


@pytest.mark.parametrize(
    "case, edit, expect",
    [
        ("StepDecay", lambda s: s["state"].update(last_epoch="5"), "saved 'last_epoch' is '5', where this"),
        ("StepDecay", lambda s: s["state"].update(last_epoch=2.5), "saved 'last_epoch' is 2.5"),
        ("StepDecay", lambda s: s["state"].update(last_lr=None), "saved 'last_lr' is None"),
        ("StepDecay", lambda s: s["state"].pop("last_lr"), "saved state has keys ['last_epoch']"),
        ("StepDecay", lambda s: s["state"].update(extra=1), "saved state has keys ['extra', 'last_epoch', 'last_lr']"),
        ("StepDecay", lambda s: s["state"].update(last_epoch=[1, 2]), "saved 'last_epoch' is [1, 2]"),
        ("StepDecay", lambda s: s["state"].update(last_lr={"a": 1}), "scheduler.last_lr is a dict"),
        ("StepDecay", lambda s: s["state"].update(last_epoch=10**30), "integer beyond"),
        (
            "LinearWarmup(CosineAnnealingDecay)",
            lambda s: s["nested"]["LinearWarmup_LR"].update(class_name="StepDecay"),
            "LR scheduler LinearWarmup.LinearWarmup_LR StepDecay in the checkpoint, CosineAnnealingDecay here",
        ),
        (
            "LinearWarmup(CosineAnnealingDecay)",
            lambda s: s.pop("nested"),
            "saved state has keys ['last_epoch', 'last_lr']",
        ),
        (
            "LinearWarmup(CosineAnnealingDecay)",
            lambda s: s["nested"]["LinearWarmup_LR"]["state"].update(last_epoch="x"),
            "LinearWarmup.LinearWarmup_LR CosineAnnealingDecay's saved 'last_epoch' is 'x'",
        ),
        (
            "CosineAnnealingWarmRestarts",
            lambda s: s["state"].update(T_i=0),
            "fails its first step(): ZeroDivisionError",
        ),
        ("CosineAnnealingDecay", lambda s: s.update(class_name="StepDecay"), "StepDecay in the checkpoint"),
    ],
    ids=lambda v: v if isinstance(v, str) and "(" not in v and " " not in v else None,
)
def test_a_bad_scheduler_state_is_refused_at_load_with_nothing_changed(tmp_path, case, edit, expect):
    """Before, each of these loaded and failed at the first ``scheduler.step()``, or (a wrong
    class wrapped by LinearWarmup, a float epoch) trained on with another schedule."""
    path = tampered(tmp_path, case, edit)
    model, optimizer, scheduler = a_trained_momentum(case)
    before = everything(model, optimizer, scheduler)
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(model, optimizer, path)
    assert expect in str(info.value) and "\n" not in str(info.value), str(info.value)
    assert everything(model, optimizer, scheduler) == before


def test_checking_a_state_steps_a_copy_never_the_live_schedulers():
    """load_checkpoint tries one step() with the saved state before loading it; the scheduler
    and the one it wraps are untouched by that trial (attributes and their lists, dicts)."""
    from autodist.applier.checkpoint.scheduler_state import problems, saved_scheduler

    live, other = make_scheduler("LinearWarmup(CyclicLR)"), make_scheduler("LinearWarmup(CyclicLR)")
    step(live, 0)
    for i in range(7):
        step(other, i)
    # (``keys`` is set by Paddle's own state_dict(), which reading the live state calls)
    snapshot = lambda s: [{k: v for k, v in vars(x).items() if k != "keys"} for x in (s, s.learning_rate)]  # noqa: E731
    before = snapshot(live)
    assert problems(live, saved_scheduler(other)) == []
    assert snapshot(live) == before


def test_a_non_finite_scheduler_state_is_refused_at_save_not_written_as_null(tmp_path):
    """JSON has no NaN: it was written as null, and loaded as a ReduceOnPlateau that never stepped."""
    model, optimizer, scheduler = tiny(1, "ReduceOnPlateau")
    scheduler.step(float("nan"))
    with pytest.raises(CheckpointError, match="LR scheduler ReduceOnPlateau's state 'best' is not a finite number"):
        save_checkpoint(model, optimizer, tmp_path / "ckpt", step=1)
    assert not (tmp_path / "ckpt").exists()


def test_a_deeply_nested_scheduler_state_is_refused_when_read(tmp_path):

    def deep(s, depth=12):
        for _ in range(depth):
            s["nested"] = {"LinearWarmup_LR": {"class_name": "LinearWarmup", "state": {}, "nested": {}}}
            s = s["nested"]["LinearWarmup_LR"]

    path = tampered(tmp_path, "StepDecay", deep)
    with pytest.raises(CheckpointError, match="LR schedulers nested more than 8 deep"):
        load_checkpoint(*a_trained_momentum("StepDecay")[:2], path)


# -- refused up front by apply_plan -------------------------------------------------------------------


class LoggingDecay(lr.StepDecay):
    """A user's scheduler that keeps its history in its state: a dict, not one scheduler's."""

    def state_keys(self):
        self.keys = ["last_epoch", "last_lr", "history"]

    def step(self, epoch=None):
        super().step(epoch)
        self.history = {**getattr(self, "history", {}), str(self.last_epoch): self.last_lr}


class KeyedDecay(lr.StepDecay):
    """A user's scheduler with a state key that is no identifier."""

    def state_keys(self):
        self.keys = ["last_epoch", "last_lr", "best-loss"]

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        setattr(self, "best-loss", 1.0)


@pytest.mark.parametrize(
    "make, expect",
    [
        (
            lambda params: paddle.optimizer.LBFGS(parameters=params),
            "optimizer: LBFGS keeps state outside its accumulators (it overrides state_dict()), which "
            "save_checkpoint cannot save; use an optimizer that keeps its state in accumulators",
        ),
        (
            lambda params: paddle.optimizer.AdamW(LoggingDecay(0.1, step_size=2), parameters=params),
            "optimizer: LR scheduler LoggingDecay's state 'history' is a dict, and it holds 0 schedulers, not "
            "one: it cannot be saved; give it a state_dict() of plain numbers and strings",
        ),
        (
            lambda params: paddle.optimizer.AdamW(KeyedDecay(0.1, step_size=2), parameters=params),
            "optimizer: LR scheduler KeyedDecay's state key 'best-loss' is not an identifier: it cannot be saved",
        ),
    ],
    ids=["lbfgs", "dict-state", "key"],
)
def test_what_cannot_be_saved_is_refused_by_apply_plan_before_training(make, expect):
    model = WORKLOADS["docstring_llama"].build(0)
    optimizer = make(model.parameters())
    if isinstance(optimizer._learning_rate, LoggingDecay):
        optimizer._learning_rate.step()  # the history exists once it has stepped
    before = {fqn: (id(p), p.numpy().tobytes()) for fqn, p in model.named_parameters()}
    with pytest.raises(PlanError) as info:
        apply_plan(model, optimizer, None, tensor_parallel_plan(model))
    assert expect in str(info.value), str(info.value)
    assert {fqn: (id(p), p.numpy().tobytes()) for fqn, p in model.named_parameters()} == before


def test_rmsprop_is_refused_under_a_plan_that_splits_parameters_and_accepted_under_dp():
    """Paddle's rmsprop_ kernel fails at the first step on a split parameter (mp2; measured in
    test_checkpoint_optimizers.py's launch before this refusal): refused before training."""
    from autodist.applier.placement.optimizer import optimizer_problems

    model = WORKLOADS["docstring_llama"].build(0)
    optimizer = paddle.optimizer.RMSProp(0.01, parameters=model.parameters())
    (problem,) = optimizer_problems(model, optimizer, tensor_parallel_plan(model, mp=2))
    assert problem.startswith("optimizer: RMSProp cannot update a parameter split over ranks"), problem
    assert optimizer_problems(model, optimizer, tensor_parallel_plan(model, dp=2)) == []


def test_every_scheduler_passes_apply_plans_check(tmp_path):
    model = WORKLOADS["docstring_llama"].build(0)
    for case in CASES:
        from autodist.applier.placement.optimizer import unsaveable

        optimizer = paddle.optimizer.AdamW(make_scheduler(case), parameters=model.parameters())
        assert unsaveable(optimizer) == [], case


# -- every built-in optimizer -----------------------------------------------------------------------------

#: Every optimizer class paddle.optimizer ships but LBFGS, whose state save_checkpoint cannot hold
#: (refused by apply_plan above).
OPTIMIZERS = sorted(
    name
    for name, cls in vars(paddle.optimizer).items()
    if inspect.isclass(cls) and issubclass(cls, paddle.optimizer.Optimizer) and name not in ("Optimizer", "LBFGS")
)


def test_the_optimizers_covered_are_the_nine_named_and_more():
    assert {"SGD", "Momentum", "Adam", "AdamW", "Lamb", "Adagrad", "RMSProp", "Adadelta", "Adamax"} <= set(OPTIMIZERS)


def mlp(seed: int):
    paddle.seed(seed)
    return paddle.nn.Sequential(paddle.nn.Linear(4, 8), paddle.nn.Tanh(), paddle.nn.Linear(8, 2))


def batch(i: int):
    return paddle.to_tensor(np.random.RandomState(i).rand(3, 4).astype("float32"))


def run(model, optimizer, first: int, steps: int) -> list[float]:
    losses = []
    for i in range(first, first + steps):
        loss = (model(batch(i)) ** 2).mean()
        loss.backward()
        optimizer.step()
        optimizer.clear_grad()
        losses.append(float(loss))
    return losses


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_every_optimizers_state_resumes_to_the_uninterrupted_run(tmp_path, name):
    make = lambda model: getattr(paddle.optimizer, name)(learning_rate=0.05, parameters=model.parameters())  # noqa: E731
    reference = mlp(1)
    reference_losses = run(reference, make(reference), 0, 3)
    model = mlp(1)
    optimizer = make(model)
    losses = run(model, optimizer, 0, 2)
    save_checkpoint(model, optimizer, tmp_path / "ckpt", step=2)
    resumed = mlp(7)
    resumed_optimizer = make(resumed)
    load_checkpoint(resumed, resumed_optimizer, tmp_path / "ckpt")
    assert losses + run(resumed, resumed_optimizer, 2, 1) == reference_losses
    for (fqn, want), got in zip(reference.named_parameters(), resumed.parameters()):
        assert np.array_equal(got.numpy(), want.numpy()), fqn
