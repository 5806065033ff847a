"""An LR scheduler's state in a checkpoint: saved whole, nested schedulers included, checked
against the live scheduler before it is loaded.

Paddle's ``LRScheduler.state_dict()`` is the state, with two gaps this module fills:

- a scheduler wrapping another (``LinearWarmup(CosineAnnealingDecay(...))``) puts the inner
  one's ``state_dict()`` in its own as a dict (``LinearWarmup_LR``); it is saved as a nested
  :class:`~autodist.schemas.checkpoint.SavedScheduler` with the inner class's name, so a
  checkpoint of a warmup around a cosine decay does not load into a warmup around a step decay;
- ``CosineAnnealingWarmRestarts`` leaves its position in the cycle (``T_cur``, ``T_i``) out, so
  a resumed run restarted its cycle (docs/paddle-notes.md, "Checkpoints"): :data:`LEFT_OUT`
  names those attributes, and they are saved beside the state.

Loading checks the saved state against the live scheduler's own (the same classes, keys and
kinds of value, plain values in range), then runs one ``step()`` on a copy with the saved
state, so a state that would break the first ``scheduler.step()`` is refused at load, with
nothing changed. ``apply_plan`` refuses up front (:func:`unsaveable`) a scheduler whose state
cannot be saved, before any training.

Example::

    >>> import paddle
    >>> warm = paddle.optimizer.lr.LinearWarmup(paddle.optimizer.lr.CosineAnnealingDecay(0.1, T_max=10), 3, 0.0, 0.1)
    >>> saved = saved_scheduler(warm)
    >>> saved.class_name, sorted(saved.state), saved.nested["LinearWarmup_LR"].class_name
    ('LinearWarmup', ['last_epoch', 'last_lr'], 'CosineAnnealingDecay')
    >>> fresh = paddle.optimizer.lr.LinearWarmup(paddle.optimizer.lr.CosineAnnealingDecay(0.1, T_max=10), 3, 0.0, 0.1)
    >>> problems(fresh, saved), restore(fresh, saved)
    ([], None)
"""

from __future__ import annotations

import copy
import warnings
from typing import Any

import paddle
from paddle.optimizer.lr import LRScheduler

from autodist.schemas.checkpoint import (
    MAX_SCHEDULER_DEPTH,
    CheckpointError,
    SavedScheduler,
    scheduler_problems,
    state_key_problem,
    state_value_problem,
)


#: Attributes a scheduler needs to resume that Paddle 3.3's ``state_dict()`` leaves out
#: (docs/paddle-notes.md, "Checkpoints"); they are saved in the state beside Paddle's keys.
LEFT_OUT: dict[type, tuple[str, ...]] = {paddle.optimizer.lr.CosineAnnealingWarmRestarts: ("T_cur", "T_i")}

#: The largest learning rate a checkpoint may hold (``last_lr``, which every Paddle scheduler's
#: state has): far above any that trains (LARS runs at about 30), far below one that turns every
#: parameter into inf or NaN at the next step (a state edited to 1e308 did).
MAX_LR = 1e3

#: The warning Paddle's ``LinearWarmup.set_state_dict`` gives on every load of a nested state.
_NESTED_LOAD_WARNING = "There are some unused values in state_dict"


def scheduler_of(optimizer: Any) -> LRScheduler | None:
    """The LR scheduler ``optimizer`` (unwrapped) was built with, or None."""
    lr = getattr(optimizer, "_learning_rate", None)
    return lr if isinstance(lr, LRScheduler) else None


def saved_scheduler(scheduler: LRScheduler, depth: int = 1) -> SavedScheduler:
    """``scheduler``'s state as a checkpoint records it. Raises :class:`CheckpointError` naming
    a value that is no plain value (:func:`~autodist.schemas.checkpoint.state_value_problem`)."""
    name = type(scheduler).__name__
    if depth > MAX_SCHEDULER_DEPTH:
        raise CheckpointError(f"LR schedulers nested more than {MAX_SCHEDULER_DEPTH} deep cannot be saved")
    state: dict[str, Any] = {}
    nested: dict[str, SavedScheduler] = {}
    own = dict(scheduler.state_dict())
    own.update({key: getattr(scheduler, key) for key in _left_out(scheduler)})
    for key, value in own.items():
        if state_key_problem(key):
            raise CheckpointError(f"LR scheduler {name}'s state key {state_key_problem(key)}: it cannot be saved")
        if isinstance(value, dict):
            nested[str(key)] = saved_scheduler(_wrapped(scheduler, str(key)), depth + 1)
            continue
        state[str(key)] = _plain(value)
        problem = state_value_problem(state[str(key)])
        if problem:
            raise CheckpointError(
                f"LR scheduler {name}'s state {key!r} {problem}: it cannot be saved; give the scheduler a "
                "state_dict() of plain numbers and strings (and the state_dict() of a scheduler it wraps)"
            )
    return SavedScheduler(class_name=name, state=state, nested=nested)


def problems(scheduler: LRScheduler, saved: SavedScheduler) -> list[str]:
    """Why ``saved`` cannot be loaded into ``scheduler`` (empty when it can): another class
    (outer or wrapped), other state keys, a value of another kind, or a state with which
    ``step()`` fails."""
    try:
        live = saved_scheduler(scheduler)
    except CheckpointError as exc:
        return [exc.problem]
    found = scheduler_problems(saved) + _differences(live, saved, "LR scheduler") + _lr_problems(saved)
    if found:
        return found
    trial = _copy(scheduler)
    try:
        restore(trial, saved)
        trial.verbose = False
        trial.step(0.0) if isinstance(trial, paddle.optimizer.lr.ReduceOnPlateau) else trial.step()
        float(trial())
    except Exception as exc:  # whatever the scheduler's own code raises on this state
        said = " ".join(str(exc).split())  # one line, whatever the scheduler's code says
        return [f"the saved LR scheduler state fails its first step(): {type(exc).__name__}: {said:.200}"]
    return []


def _lr_problems(saved: SavedScheduler, where: str = "LR scheduler") -> list[str]:
    """A saved learning rate (``last_lr``) beyond ±:data:`MAX_LR`, in ``saved`` or a scheduler it wraps.

    >>> _lr_problems(SavedScheduler(class_name="StepDecay", state={"last_epoch": 3, "last_lr": 1e308}))
    ["LR scheduler StepDecay's saved last_lr 1e+308 is beyond ±1000.0, no learning rate a training uses"]
    """
    lr = saved.state.get("last_lr")
    found = [] if not isinstance(lr, (int, float)) or abs(lr) <= MAX_LR else [
        f"{where} {saved.class_name}'s saved last_lr {lr:.3g} is beyond ±{MAX_LR}, no learning rate a training uses"
    ]  # fmt: skip
    for key, inner in sorted(saved.nested.items()):
        found += _lr_problems(inner, f"{where} {saved.class_name}.{key}")
    return found


def restore(scheduler: LRScheduler, saved: SavedScheduler) -> None:
    """Load ``saved`` (checked by :func:`problems`) into ``scheduler`` through Paddle's
    ``set_state_dict``, then the attributes it leaves out."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_NESTED_LOAD_WARNING)
        scheduler.set_state_dict(_paddle_state(scheduler, saved))
    _restore_left_out(scheduler, saved)


def unsaveable(optimizer: Any) -> list[str]:
    """``apply_plan``'s up-front check: why ``optimizer``'s LR scheduler could not be saved by
    ``save_checkpoint`` (empty when it can), found before any training rather than at the first
    save."""
    scheduler = scheduler_of(optimizer)
    if scheduler is None:
        return []
    try:
        saved_scheduler(scheduler)
    except CheckpointError as exc:
        return [f"optimizer: {exc.problem}"]
    return []


def _left_out(scheduler: LRScheduler) -> tuple[str, ...]:
    return next((keys for cls, keys in LEFT_OUT.items() if isinstance(scheduler, cls)), ())


def _wrapped(scheduler: LRScheduler, key: str) -> LRScheduler:
    """The scheduler whose state ``scheduler.state_dict()[key]`` is: the one scheduler it holds."""
    inner = [v for v in vars(scheduler).values() if isinstance(v, LRScheduler)]
    if len(inner) != 1:
        raise CheckpointError(
            f"LR scheduler {type(scheduler).__name__}'s state {key!r} is a dict, and it holds {len(inner)} "
            "schedulers, not one: it cannot be saved; give it a state_dict() of plain numbers and strings"
        )
    return inner[0]


def _plain(value: Any) -> Any:
    """numpy and size-1 tensor scalars as Python ones (``ReduceOnPlateau.best`` is the metric
    given to ``step``); lists element by element."""
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if hasattr(value, "item") and not isinstance(value, (bool, int, float, str)):
        return value.item()
    return value


def _differences(live: SavedScheduler, saved: SavedScheduler, where: str) -> list[str]:
    if live.class_name != saved.class_name:
        return [f"{where} {saved.class_name} in the checkpoint, {live.class_name} here"]
    if set(live.state) != set(saved.state) or set(live.nested) != set(saved.nested):
        ours, theirs = set(live.state) | set(live.nested), set(saved.state) | set(saved.nested)
        return [f"{where} {live.class_name}'s saved state has keys {sorted(theirs)}, this one {sorted(ours)}"]
    found = [f"{where} {live.class_name}'s saved {key!r} {problem}" for key in sorted(live.state)
             if (problem := _kind_problem(live.state[key], saved.state[key]))]  # fmt: skip
    for key in sorted(live.nested):
        found += _differences(live.nested[key], saved.nested[key], f"{where} {live.class_name}.{key}")
    return found


def _kind_problem(live: Any, saved: Any) -> str | None:
    """A saved value of another kind than the live one: an integer for an integer (``last_epoch``),
    a number for a float (an integral one for an integer too), the same for a string or list;
    where the live scheduler holds null (``ReduceOnPlateau.best`` before its first step), null
    or a number."""
    number = (int, float)
    if live is None:
        ok = saved is None or isinstance(saved, number) and not isinstance(saved, bool)
    elif isinstance(live, bool) or isinstance(live, (str, list)):
        ok = type(saved) is type(live)
    elif isinstance(live, int):  # Paddle itself turns some into integral floats (T_cur after step(epoch))
        ok = not isinstance(saved, bool) and (isinstance(saved, int) or isinstance(saved, float) and saved.is_integer())
    else:
        ok = isinstance(saved, number) and not isinstance(saved, bool)
    if ok and isinstance(live, list):
        return next((f"[{i}] {p}" for i, (a, b) in enumerate(zip(live, saved)) if (p := _kind_problem(a, b))), None)
    return None if ok else f"is {saved!r:.40}, where this scheduler holds a {type(live).__name__}"


def _paddle_state(scheduler: LRScheduler, saved: SavedScheduler) -> dict[str, Any]:
    """``saved`` as Paddle's ``set_state_dict`` takes it: without the attributes it leaves out,
    with the wrapped scheduler's state as a dict."""
    left_out = _left_out(scheduler)
    state = {key: value for key, value in saved.state.items() if key not in left_out}
    for key, inner in saved.nested.items():
        state[key] = _paddle_state(_wrapped(scheduler, key), inner)
    return state


def _restore_left_out(scheduler: LRScheduler, saved: SavedScheduler) -> None:
    for key in _left_out(scheduler):
        setattr(scheduler, key, saved.state[key])
    for key, inner in saved.nested.items():
        _restore_left_out(_wrapped(scheduler, key), inner)


def _copy(scheduler: LRScheduler) -> LRScheduler:
    """A copy to try a state on that shares nothing ``step()`` changes: the scheduler and each
    one it wraps copied, their lists, dicts and sets copied one level. Not a deep copy: a
    scheduler of one's own may hold the optimizer, and a deep copy would copy every parameter."""
    trial = copy.copy(scheduler)
    for key, value in vars(scheduler).items():
        if isinstance(value, LRScheduler):
            setattr(trial, key, _copy(value))
        elif isinstance(value, (list, dict, set)):
            setattr(trial, key, copy.copy(value))
    return trial
