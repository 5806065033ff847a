"""Rebuild the user's optimizer over the sharded parameters, then shard its states.

``paddle.distributed.to_distributed`` shards the model but leaves the optimizer holding the
old dense parameters: the sharded weights then silently never train. Here the optimizer is
rebuilt — same class, same hyper-parameters, the same learning-rate scheduler and grad-clip
*objects*, the same parameter groups — over exactly the new parameters, so that bug cannot
happen, and then wrapped by ``dist.shard_optimizer`` with the plan's ZeRO stage.

Example::

    >>> opt = paddle.optimizer.AdamW(1e-3, parameters=model.parameters(), weight_decay=0.1)  # doctest: +SKIP
    >>> new = rebuild_optimizer(opt, {id(old): new for ...})   # doctest: +SKIP
    >>> new._learning_rate is opt._learning_rate, new._weight_decay  # doctest: +SKIP
    (True, 0.1)
"""

from __future__ import annotations

import inspect
from typing import Any

import paddle
import paddle.distributed as dist

from autodist.schemas import Plan
from autodist.schemas.vocabulary import shard_dim

from autodist.applier.checkpoint import scheduler_state
from autodist.applier.placement.mesh import stage_mesh

#: Optimizer classes ``dist.shard_optimizer`` accepts (Paddle 3.3.1, api.py _ShardOptimizer).
SHARDABLE = (paddle.optimizer.AdamW, paddle.optimizer.SGD)
_SHARDING_STAGES = {1: dist.ShardingStage1, 2: dist.ShardingStage2, 3: dist.ShardingStage3}
#: Constructor arguments that are not hyper-parameters.
_NOT_HYPER = {"self", "parameters", "args", "kwargs"}
#: The suffix ``dist.shard_tensor`` appends to a parameter's name (base/framework.py).
_DIST_SUFFIX = ".dist"


def optimizer_problems(model: paddle.nn.Layer, optimizer: Any, plan: Plan) -> list[str]:
    """Why ``optimizer`` cannot be rebuilt for ``plan`` (empty when it can)."""
    if optimizer is None:
        return []
    if not isinstance(optimizer, paddle.optimizer.Optimizer):
        return [f"optimizer: a paddle.optimizer.Optimizer is needed, got {type(optimizer).__name__}"]
    problems = []
    held = {id(p): p for p in optimizer_parameters(optimizer)}
    named = dict(model.named_parameters())
    model_ids = {id(p) for p in named.values()}
    foreign = [p.name for i, p in held.items() if i not in model_ids]
    if foreign:
        problems.append(f"optimizer: holds {len(foreign)} parameters that are not the model's: {foreign[:8]}")
    left_out = [fqn for fqn, p in named.items() if id(p) not in held and not p.stop_gradient]
    if left_out:
        problems.append(f"optimizer: does not hold the model's trainable parameters {left_out[:8]}")
    if any(optimizer._accumulators.values()) or optimizer._master_weights:
        problems.append(
            "optimizer: it has already stepped (it holds moments); call apply_plan before the first "
            "step and load optimizer state afterwards"
        )
    try:
        rebuild_arguments(optimizer)
    except ValueError as exc:
        problems.append(f"optimizer: {exc}")
    problems += unsaveable(optimizer)
    split = sorted(fqn for fqn, param in plan.params.items() if any(shard_dim(p) is not None for p in param.placements))
    if isinstance(optimizer, paddle.optimizer.RMSProp) and split:
        problems.append(
            f"optimizer: RMSProp cannot update a parameter split over ranks ({split[0]!r} here): Paddle 3.3's "
            "rmsprop_ kernel raises 'Param and ParamOut must be the same Tensor' at the first step "
            "(docs/paddle-notes.md, Optimizers); use a plan that splits no parameter, or another optimizer"
        )
    stage = plan.strategy.sharding_stage
    if stage and not isinstance(optimizer, SHARDABLE):
        problems.append(
            f"$.strategy.sharding_stage: {stage} needs AdamW or SGD (Paddle's shard_optimizer "
            f"supports only those), the optimizer is {type(optimizer).__name__}"
        )
    if stage and "dp" not in plan.mesh.axes:
        problems.append(f"$.strategy.sharding_stage: {stage} shards over dp, but the mesh has no dp dim")
    return problems


def unsaveable(optimizer: paddle.optimizer.Optimizer) -> list[str]:
    """Why ``save_checkpoint`` could not save ``optimizer``'s state or its LR scheduler's (empty
    when it can): checked by ``apply_plan`` before any training, not found at the first save.
    A checkpoint saves what ``Optimizer.state_dict()`` holds (the states in ``_accumulators``,
    master weights) and the scheduler; a class that overrides ``state_dict()`` keeps more
    (Paddle's LBFGS: its step history in ``.state``)."""
    elsewhere = state_elsewhere(optimizer)
    return ([f"optimizer: {elsewhere}"] if elsewhere else []) + scheduler_state.unsaveable(optimizer)


def state_elsewhere(optimizer: paddle.optimizer.Optimizer) -> str | None:
    """Why ``optimizer`` keeps state a checkpoint cannot save, or None."""
    if type(optimizer).state_dict is paddle.optimizer.Optimizer.state_dict:
        return None
    return (
        f"{type(optimizer).__name__} keeps state outside its accumulators (it overrides state_dict()), "
        "which save_checkpoint cannot save; use an optimizer that keeps its state in accumulators (SGD, "
        "Momentum, Adam, AdamW, Lamb, Adagrad, RMSProp, Adadelta, Adamax, NAdam, RAdam, Rprop)"
    )


def optimizer_parameters(optimizer: paddle.optimizer.Optimizer) -> list[paddle.Tensor]:
    """The parameters an optimizer updates, flattened over parameter groups."""
    params = optimizer._parameter_list or []
    if params and isinstance(params[0], dict):
        return [p for group in params for p in group["params"]]
    return list(params)


def rebuild_arguments(optimizer: paddle.optimizer.Optimizer) -> dict[str, Any]:
    """The constructor keyword arguments that re-create ``optimizer``'s hyper-parameters,
    read back from the attributes Paddle stores them in. Raises ValueError naming any argument
    that cannot be recovered."""
    kwargs, lost = {}, []
    for name, arg in inspect.signature(type(optimizer).__init__).parameters.items():
        if name in _NOT_HYPER or arg.kind in (arg.VAR_POSITIONAL, arg.VAR_KEYWORD):
            continue
        found, value = _stored_argument(optimizer, name)
        if found:
            kwargs[name] = value
        else:
            lost.append(name)
    if lost:
        raise ValueError(f"cannot rebuild {type(optimizer).__name__}: argument(s) {lost} are not recoverable")
    return kwargs


def rebuild_optimizer(optimizer: paddle.optimizer.Optimizer, new_param: dict[int, paddle.Tensor]) -> Any:
    """A new optimizer of the same class and hyper-parameters over the new parameters;
    ``new_param`` maps ``id(old parameter)`` to its replacement, and old parameters it does not
    map (another pipeline stage's) are left out. Parameter groups keep their own settings."""

    def replace(params):
        return [new_param[id(p)] for p in params if id(p) in new_param]

    old = optimizer._parameter_list or []
    if old and isinstance(old[0], dict):
        params = [{**group, "params": replace(group["params"])} for group in optimizer._param_groups]
    else:
        params = replace(old)
    return type(optimizer)(parameters=params, **rebuild_arguments(optimizer))


def retire(optimizer: paddle.optimizer.Optimizer) -> None:
    """Make the user's optimizer, which ``apply_plan`` replaced, refuse to update. It still holds
    the model's old dense parameters, which the model no longer uses: its ``step()`` would run
    and train nothing (a script that calls ``apply_plan(model, opt, loader, plan)`` without
    taking what it returns). ``clear_grad()`` and reading its state still work.

    Example::

        >>> retire(opt)          # doctest: +SKIP
        >>> opt.step()           # doctest: +SKIP
        Traceback (most recent call last):
        ValueError: this optimizer was replaced by apply_plan ...
    """

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise ValueError(
            "this optimizer was replaced by apply_plan and holds the model's old parameters, so it would "
            "train nothing: use the optimizer apply_plan returns, model, opt, loader = apply_plan(model, opt, "
            "loader, plan)"
        )

    optimizer.step = optimizer.minimize = refuse


def shard_optimizer(optimizer: Any, plan: Plan) -> Any:
    """``dist.shard_optimizer`` with the plan's sharding stage over ``dp``. Stage 0 wraps too
    (it places the states like their parameters and handles global-norm clipping across
    meshes) when Paddle supports the class; other classes train unwrapped at stage 0."""
    stage = plan.strategy.sharding_stage
    if stage == 0:
        return _scalars_left_whole(dist.shard_optimizer(optimizer)) if isinstance(optimizer, SHARDABLE) else optimizer
    shard_fn = _SHARDING_STAGES[stage](sharding_mesh_dim="dp", mesh=stage_mesh(plan, 0))
    return _scalars_left_whole(dist.shard_optimizer(optimizer, shard_fn))


def _scalars_left_whole(sharded: Any) -> Any:
    """``sharded`` (Paddle's ``_ShardOptimizer``) training a 0-d parameter (HF CLIP's
    ``logit_scale``) as one device does (docs/paddle-notes.md, "Parameters and optimizers"):

    - its states left as made: Paddle 3.3.1 reads ``param.shape[0]`` of every parameter in its
      first step, to leave those whose first dim is 1 unsharded (``IndexError`` on a 0-d one,
      which has no dim to shard either: left as a ``[1]`` one is);
    - its gradient handed to the update 0-d again: ``ClipGradByGlobalNorm`` multiplies it by a
      ``[1]`` factor, which makes it ``[1]``, and AdamW's distributed rule then raises
      ``param, grad, momentum1 and momentum2 have different ndim``.
    """
    shard_accumulator = sharded._shard_accumulator
    update = sharded._create_optimization_pass

    def as_params(pairs: list) -> list:
        return [(p, g.reshape([]) if g is not None and not p.shape and g.shape else g) for p, g in pairs]

    def create_optimization_pass(params_grads: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(params_grads, dict):  # a parameter group: {"params": [(param, grad), ...], ...}
            params_grads = {**params_grads, "params": as_params(params_grads["params"])}
        else:
            params_grads = as_params(params_grads)
        return update(params_grads, *args, **kwargs)

    # in the instance's own dict: _ShardOptimizer.__setattr__ sets attributes on the inner optimizer
    vars(sharded)["_shard_accumulator"] = lambda param: shard_accumulator(param) if param.shape else None
    vars(sharded)["_create_optimization_pass"] = create_optimization_pass
    return sharded


def _stored_argument(optimizer, name: str) -> tuple[bool, Any]:
    if name == "weight_decay":
        return True, _weight_decay(optimizer)
    if name == "apply_decay_param_fun":
        return True, _keep_names(getattr(optimizer, "_apply_decay_param_fun", None))
    for attr in (f"_{name}", name):
        if attr in optimizer.__dict__:
            value = optimizer.__dict__[attr]
            # Rprop keeps its pair arguments (learning_rate_range, etas) as a list around the tuple.
            wrapped = isinstance(value, list) and len(value) == 1 and isinstance(value[0], tuple)
            return True, value[0] if wrapped else value
    return False, None


def _weight_decay(optimizer) -> Any:
    """AdamW keeps a coefficient; Momentum turns an L2Decay into its own fields; the others
    keep the regularizer object."""
    if "_weight_decay" in optimizer.__dict__:
        return optimizer._weight_decay
    if getattr(optimizer, "_regularization_method", "") == "l2_decay":
        return paddle.regularizer.L2Decay(optimizer._regularization_coeff)
    return optimizer.regularization


def _keep_names(decide):
    """AdamW asks ``apply_decay_param_fun(param.name)``; sharding renames ``w`` to ``w.dist``,
    so the user's function would no longer recognise its names and silently stop decaying."""
    if decide is None:
        return None
    return lambda name: decide(name.removesuffix(_DIST_SUFFIX))
