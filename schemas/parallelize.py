"""A plan in ``dist.parallelize`` words, as data: what each placement and hook of a plan becomes
in Paddle's intermediate API (paddle 3.3, ``paddle/distributed/auto_parallel/intermediate/``).

Two things read it: ``autodist-plan export --to paddle-parallelize`` writes it as a Python module
(:mod:`autodist.planner.review.export`), and :mod:`autodist.integrations.paddleformers` builds
the PaddleFormers ``Trainer``'s ``auto_dist_config`` from it. What Paddle does with a config
decides what is written:

- ``mp_config.parallelize_plan`` keys are *regular expressions* matched against the full names of
  ``model.named_sublayers()``; a key ending in ``.weight``/``.bias`` names one parameter of the
  layer. ``ColWiseParallel`` shards a 2-D parameter on dim 1 and a 1-D one on dim 0;
  ``RowWiseParallel`` shards a 2-D weight on dim 0 and leaves the bias replicated. So a
  parameter's planned placement on ``mp`` maps to a style directly, and a layer key is used when
  its weight and bias agree with what the style does to a whole layer.
- ``pp_config.split_spec`` maps the last layer of each stage but the last to
  ``SplitPoint.END``: every later sub-layer, in ``named_sublayers`` order, goes to the next stage.
- ``dp_config.sharding_level`` is the ZeRO stage; Paddle requires a ``dp`` mesh axis for it.
- ``dist.parallelize`` walks ``named_sublayers()``, which leaves out the model's own parameters
  (the docstring Llama's LM head ``weight``): whoever applies the config shards those itself,
  on their stage's mesh (:attr:`ParallelizeConfig.model_params`).
- The plan's sequence-parallel hooks become ``SequenceParallelBegin/End/Enable/Disable`` (a
  hook with no Paddle plan of its own, such as gathering a layer's *output*, a
  ``PrepareLayerInput/Output`` around Paddle's own ``c_split``/``c_concat``), its reshard hooks
  ``PrepareLayerInput/Output`` of a small reshard function: :class:`Style` names them.

- Local views and local token lookups (``plan.local_view``, ``plan.vocab_lookup``) have no key:
  their parameters get no entry, and ``autodist.apply_local_views(model, plan)``, called before
  ``dist.parallelize``, shards them and installs those sub-layers
  (:attr:`ParallelizeConfig.local_layers`; ``applier/modes/exported_views.py``).

Anything the config cannot express exactly (a placement no style produces, expert parallelism,
a VPP schedule) is an :class:`ExportError` listing every such thing, never a silently different
config. Imports nothing but the standard library and the plan types.

Example::

    >>> from autodist.schemas import load_plan
    >>> config = parallelize_config(load_plan("plans/gpt/plan_2x8dev_mp4.json"))
    >>> config.sharding_level, config.entries[0].key, config.entries[0].plans[0].name
    (0, 'blocks.0.mlp.fc_in', 'ColWiseParallel')
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass

from autodist.schemas.checks import shard_dim
from autodist.schemas.parallel_dims import runtime_refusals
from autodist.schemas.plan import Plan, Reshard, StageHandoff

#: Paddle's sequence-parallel plan for each set of hooks one layer carries.
_SEQUENCE_PARALLEL_PAIRS = {
    frozenset({("post", "sequence_parallel_begin")}): "SequenceParallelBegin",
    frozenset({("pre", "sequence_parallel_end")}): "SequenceParallelEnd",
    frozenset({("pre", "sequence_parallel_begin"), ("post", "sequence_parallel_end")}): "SequenceParallelEnable",
    frozenset({("pre", "sequence_parallel_end"), ("post", "sequence_parallel_begin")}): "SequenceParallelDisable",
}
#: Each single sequence-parallel hook: a Paddle plan where one exists, else a helper doing what
#: Paddle's pair plans do on that side (``c_split`` / ``c_concat``).
_SEQUENCE_PARALLEL_SINGLE = {
    ("post", "sequence_parallel_begin"): "SequenceParallelBegin",
    ("pre", "sequence_parallel_end"): "SequenceParallelEnd",
    ("pre", "sequence_parallel_begin"): "split_sequence_input",
    ("post", "sequence_parallel_end"): "gather_sequence_output",
}
#: The styles that are not a class of ``paddle.distributed`` but a ``PrepareLayerInput`` /
#: ``PrepareLayerOutput`` of a small function, and which of the two.
HELPER_STYLES = {
    "split_sequence_input": "PrepareLayerInput",
    "gather_sequence_output": "PrepareLayerOutput",
    "reshard_input": "PrepareLayerInput",
    "reshard_output": "PrepareLayerOutput",
}


class ExportError(ValueError):
    """The plan holds something ``dist.parallelize`` cannot express; lists every such thing."""


@dataclass(frozen=True)
class Style:
    """One of Paddle's plans for a layer: ``name`` is a class of ``paddle.distributed``
    (``ColWiseParallel``, ``RowWiseParallel``, ``SequenceParallelBegin`` ...) or one of
    :data:`HELPER_STYLES`; ``placements`` (plan notation, one per mesh axis) for the reshards."""

    name: str
    placements: tuple[str, ...] = ()


@dataclass(frozen=True)
class ConfigEntry:
    """One ``parallelize_plan`` entry: a layer FQN (or ``layer.param``) and the plans applied to it."""

    key: str
    plans: tuple[Style, ...]


@dataclass(frozen=True)
class ParallelizeConfig:
    """A plan in ``dist.parallelize`` words, keys still plain FQNs (:func:`paddle_key` makes
    Paddle's regular expressions of them)."""

    #: One per layer (or ``layer.param``) that gets a plan, in plan order.
    entries: list[ConfigEntry]
    #: Every layer name the plan knows, and each layer's parameter names (to check that a key
    #: names exactly the layers meant, as Paddle reads it: :func:`paddle_key_matches`).
    layers: set[str]
    tensor_attrs: dict[str, set[str]]
    #: ``dp_config.sharding_level``; None without a dp mesh axis (no ``dp_config`` then).
    sharding_level: int | None
    #: ``pp_config.split_spec``: the layer ending each stage but the last.
    split_points: list[str]
    #: The model's own parameters (no dot in the name), which ``dist.parallelize`` does not
    #: visit: name -> (stage, placements without the pp axis).
    model_params: dict[str, tuple[int, list[str]]]
    #: The sub-layers that run on local tensors (``plan.local_view``, ``plan.vocab_lookup``),
    #: for which ``dist.parallelize`` has no key: ``autodist.apply_local_views(model, plan)``
    #: shards their parameters and installs them, before ``dist.parallelize`` runs. Their
    #: parameters have no entry here.
    local_layers: list[str]


def parallelize_config(plan: Plan) -> ParallelizeConfig:
    """``plan`` in ``dist.parallelize`` words; :class:`ExportError` naming every parameter,
    hook or strategy it cannot express."""
    problems: list[str] = []
    local_params = set(local_parameters(plan))
    entries = _param_entries(plan, local_params, problems) + _hook_entries(plan)
    if plan.strategy.sharding_stage and "dp" not in plan.mesh.axes:
        problems.append(f"ZeRO stage {plan.strategy.sharding_stage} without a dp mesh axis")
    problems += runtime_refusals(plan.strategy, "dist.parallelize")
    if problems:
        raise ExportError("; ".join(problems))
    return ParallelizeConfig(
        entries=entries,
        layers=_known_layers(plan),
        tensor_attrs=_tensor_attrs(plan),
        sharding_level=int(plan.strategy.sharding_stage) if "dp" in plan.mesh.axes else None,
        split_points=_split_points(plan),
        model_params={name: p for name, p in _model_params(plan).items() if name not in local_params},
        local_layers=[view.layer for view in plan.local_view] + [lookup.layer for lookup in plan.vocab_lookup],
    )


def local_parameters(plan: Plan) -> list[str]:
    """The parameters the plan's local views and local token lookups hold, in plan order: those
    ``autodist.apply_local_views`` shards itself, and the config leaves out."""
    names = [w.param for view in plan.local_view for w in view.weights]
    names += [lookup.weight for lookup in plan.vocab_lookup]
    return list(dict.fromkeys(names))


# -- parameters -> ColWise / RowWise entries ----------------------------------------------------------


def _style_of(shape: list[int], placement: str) -> str | None:
    """The Paddle plan that gives a parameter of ``shape`` this placement on ``mp``."""
    dim = shard_dim(placement)
    if dim is None:
        return None
    if (len(shape), dim) in ((2, 1), (1, 0)):
        return "ColWiseParallel"
    if (len(shape), dim) == (2, 0):
        return "RowWiseParallel"
    raise ValueError(placement)


def _param_entries(plan: Plan, local_params: set[str], problems: list[str]) -> list[ConfigEntry]:
    """ColWise/RowWise entries of every planned parameter but ``local_params`` (apply_local_views' own)."""
    names = plan.mesh.axes
    styles: dict[str, dict[str, str | None]] = defaultdict(dict)  # layer -> attr -> style
    for fqn, param in plan.params.items():
        if fqn in local_params:
            continue
        for dim, placement in zip(names, param.placements):
            if dim != "mp" and placement != "R":
                problems.append(f"{fqn}: {placement} on {dim} (dist.parallelize shards parameters over mp only)")
        if "mp" not in names or "." not in fqn:  # the model's own parameters: see _model_params
            continue
        placement = param.placements[names.index("mp")]
        try:
            style = _style_of(param.shape, placement)
        except ValueError:
            problems.append(f"{fqn}: {placement} on mp of a {len(param.shape)}-D parameter matches no Paddle style")
            continue
        layer, _, attr = fqn.rpartition(".")
        styles[layer][attr] = style
    entries = []
    for layer, attrs in styles.items():
        whole = _whole_layer_style(attrs)
        if whole:
            entries.append(ConfigEntry(layer, (Style(whole),)))
            continue
        entries += [ConfigEntry(f"{layer}.{attr}", (Style(s),)) for attr, s in attrs.items() if s]
    return entries


def _whole_layer_style(attrs: dict[str, str | None]) -> str | None:
    """The style to key by the layer itself: its weight's, when applying that style to the whole
    layer (weight and bias, nothing else) gives exactly the planned placements."""
    weight, others = attrs.get("weight"), set(attrs) - {"weight", "bias"}
    if weight is None or any(attrs[o] for o in others):
        return None
    bias = attrs.get("bias", "absent")
    if weight == "ColWiseParallel" and bias in ("ColWiseParallel", "absent"):
        return weight
    if weight == "RowWiseParallel" and bias in (None, "absent"):
        return weight
    return None


# -- hooks -> sequence parallel / prepare entries -----------------------------------------------------------


def _hook_entries(plan: Plan) -> list[ConfigEntry]:
    sequence: dict[str, set[tuple[str, str]]] = defaultdict(set)
    entries = []
    for hook in plan.hooks:
        if hook.action.startswith("sequence_parallel"):
            sequence[hook.layer].add((hook.when, hook.action))
        elif isinstance(hook, Reshard):
            helper = "reshard_input" if hook.when == "pre" else "reshard_output"
            entries.append(ConfigEntry(hook.layer, (Style(helper, tuple(hook.placements)),)))
        # stage_handoff hooks are what pp_config's split points do.
    for layer, kinds in sequence.items():
        pair = _SEQUENCE_PARALLEL_PAIRS.get(frozenset(kinds))
        plans = (Style(pair),) if pair else tuple(Style(_SEQUENCE_PARALLEL_SINGLE[k]) for k in sorted(kinds))
        entries.append(ConfigEntry(layer, plans))
    return entries


# -- keys: Paddle's regular expressions ------------------------------------------------------------------


def _known_layers(plan: Plan) -> set[str]:
    """Every layer name the plan knows (owners of parameters, blocks and hook sites)."""
    fqns = set(plan.params) | {t for p in plan.params.values() for t in p.tied_to}
    return {f.rpartition(".")[0] for f in fqns} | {b.layer for b in plan.blocks} | {h.layer for h in plan.hooks}


def _tensor_attrs(plan: Plan) -> dict[str, set[str]]:
    """layer -> names of its parameters, as Paddle's key matching looks at them."""
    attrs: dict[str, set[str]] = defaultdict(set)
    for fqn in set(plan.params) | {t for p in plan.params.values() for t in p.tied_to}:
        layer, _, attr = fqn.rpartition(".")
        attrs[layer].add(attr)
    return attrs


def paddle_key_matches(key: str, layer: str, attrs: set[str]) -> bool:
    """Whether Paddle's ``TensorParallel.match_layer`` applies ``key`` to sub-layer ``layer``
    (which has tensor attributes ``attrs``), following its code in paddle 3.3. A key that is not
    a valid regular expression matches nothing (Paddle would raise)."""
    attr = key.split(".")[-1]
    if key.endswith(f".{attr}") and attr in attrs:
        key = key.replace(f".{attr}", "")
    try:
        found = re.match(key, layer)
    except re.error:
        return False
    return key == layer or (found is not None and found.end() - found.start() == len(layer))


def paddle_key(pattern: str, attr: str | None = None) -> str:
    """The regular expression ``dist.parallelize`` reads for a layer name or collapsed layer
    ``pattern``, every name part escaped; ``attr`` names one parameter of the layer.

    Dots between names are written ``[.]``, not ``\\.``: Paddle takes the text after a key's
    last ``.`` as a parameter name and deletes ``.<name>`` from the key when the layer has such a
    tensor, which must only ever happen to the ``attr`` written after the one plain dot.

    >>> paddle_key("llama.layers.*.mlp.up_proj"), paddle_key("layers.{0-1,3}.fc", "weight")
    ('llama[.]layers[.][0-9]+[.]mlp[.]up_proj', 'layers[.](?:0|1|3)[.]fc.weight')
    """
    parts = []
    for part in pattern.split("."):
        ranges = re.fullmatch(r"\{([0-9,\-]+)\}", part)
        if part == "*":
            parts.append("[0-9]+")
        elif ranges:
            parts.append("(?:" + "|".join(_expand(ranges.group(1))) + ")")
        else:
            parts.append(re.escape(part))
    key = "[.]".join(parts)
    return key if attr is None else f"{key}.{attr}"


def entry_key(config: ParallelizeConfig, name: str) -> str:
    """Paddle's key for one entry's plain FQN ``name`` (a layer, or ``layer.param``)."""
    if name in config.layers:
        return paddle_key(name)
    layer, _, attr = name.rpartition(".")
    return paddle_key(layer, attr)


def _expand(ranges: str) -> list[str]:
    """``"0-2,8"`` -> ``["0", "1", "2", "8"]``."""
    out = []
    for part in ranges.split(","):
        a, _, b = part.partition("-")
        out += [str(i) for i in range(int(a), int(b or a) + 1)]
    return out


def _model_params(plan: Plan) -> dict[str, tuple[int, list[str]]]:
    """The model's own parameters (no dot in the FQN): name -> (stage, placements without the pp dim)."""
    names = plan.mesh.axes
    return {
        fqn: (p.stage, [x for d, x in zip(names, p.placements) if d != "pp"])
        for fqn, p in sorted(plan.params.items())
        if "." not in fqn
    }


# -- pipeline ---------------------------------------------------------------------------------------


def _split_points(plan: Plan) -> list[str]:
    """The layer ending each stage but the last: the plan's stage hand-off sites, or else the
    last block of each stage."""
    if plan.strategy.pp == 1:
        return []
    handoffs = sorted((h for h in plan.hooks if isinstance(h, StageHandoff)), key=lambda h: h.to_stage)
    if handoffs:
        return [h.layer for h in handoffs]
    last: dict[int, str] = {}
    for block in plan.blocks:
        last[block.stage] = block.layer
    return [last[s] for s in range(plan.strategy.pp - 1)]
