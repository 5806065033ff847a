"""A plan as Paddle's own ``dist.parallelize`` config, so it can be adopted in hand-written code.

``export_parallelize(plan)`` returns the source of a Python module defining ``MESH``, ``CONFIG``
and ``parallelize(model, optimizer)``. How Paddle reads the config (paddle 3.3,
``paddle/distributed/auto_parallel/intermediate/``) decides what is written:

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
  (the docstring Llama's LM head ``weight``): the module's ``parallelize`` shards those itself,
  on their stage's mesh, before calling it.
- The plan's sequence-parallel hooks become ``SequenceParallelBegin/End/Enable/Disable`` (a
  hook with no Paddle plan of its own, such as gathering a layer's *output*, a
  ``PrepareLayerInput/Output`` around Paddle's own ``c_split``/``c_concat``), its reshard hooks
  ``PrepareLayerInput/Output`` with a small function written into the module.

Anything the config cannot express exactly (a placement no style produces, a key that would
name other layers too) is an error, never a silently different config.

Plans are untrusted input: the module holds the plan's names only as literals (``repr`` of a
string; keys are regular expressions with every name part escaped), so importing it runs
nothing a plan says, whatever its names, class name or file name.

Example::

    >>> from autodist.schemas import load_plan
    >>> print(export_parallelize(load_plan("plan.json"), "plan.json"))   # doctest: +SKIP
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass

from autodist.schemas import Plan, shard_dim

from autodist.planner.review.format import collapse

#: Paddle's sequence-parallel plan for each set of hooks one layer carries.
_SEQUENCE_PARALLEL_PAIRS = {
    frozenset({("post", "sequence_parallel_begin")}): "SequenceParallelBegin",
    frozenset({("pre", "sequence_parallel_end")}): "SequenceParallelEnd",
    frozenset({("pre", "sequence_parallel_begin"), ("post", "sequence_parallel_end")}): "SequenceParallelEnable",
    frozenset({("pre", "sequence_parallel_end"), ("post", "sequence_parallel_begin")}): "SequenceParallelDisable",
}
#: Each single sequence-parallel hook: a Paddle plan where one exists, else the module's own
#: helper doing what Paddle's pair plans do on that side (``c_split`` / ``c_concat``).
_SEQUENCE_PARALLEL_SINGLE = {
    ("post", "sequence_parallel_begin"): "dist.SequenceParallelBegin()",
    ("pre", "sequence_parallel_end"): "dist.SequenceParallelEnd()",
    ("pre", "sequence_parallel_begin"): "dist.PrepareLayerInput(split_sequence_input)",
    ("post", "sequence_parallel_end"): "dist.PrepareLayerOutput(gather_sequence_output)",
}


class ExportError(ValueError):
    """The plan holds something ``dist.parallelize`` cannot express; lists every such thing."""


@dataclass(frozen=True)
class ConfigEntry:
    """One ``parallelize_plan`` entry before collapsing: a layer (or ``layer.param``) and the
    Python expressions of the plans applied to it."""

    key: str
    plans: tuple[str, ...]


def export_parallelize(plan: Plan, source: str = "plan.json") -> str:
    """The source of a Python module that configures ``dist.parallelize`` like ``plan``.

    Raises :class:`ExportError` naming every parameter or hook it cannot express.
    """
    problems: list[str] = []
    entries = _param_entries(plan, problems) + _hook_entries(plan)
    if plan.strategy.sharding_stage and "dp" not in plan.mesh.axes:
        problems.append(f"ZeRO stage {plan.strategy.sharding_stage} without a dp mesh axis")
    if plan.strategy.ep > 1:
        problems.append(f"expert parallelism (ep={plan.strategy.ep}): dist.parallelize has no key for it")
    if plan.strategy.virtual_stages > 1:
        problems.append(
            f"VPP with {plan.strategy.virtual_stages} chunks per stage: pp_config takes one split point "
            "per stage boundary (re-plan with --schedule 1F1B to export)"
        )
    if problems:
        raise ExportError("; ".join(problems))
    mp_plan = _collapse_entries(entries, _known_layers(plan), _tensor_attrs(plan), problems)
    if problems:
        raise ExportError("; ".join(problems))
    return _module_source(plan, source, mp_plan, _split_points(plan), _model_params(plan))


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


def _param_entries(plan: Plan, problems: list[str]) -> list[ConfigEntry]:
    names = plan.mesh.axes
    styles: dict[str, dict[str, str | None]] = defaultdict(dict)  # layer -> attr -> style
    for fqn, param in plan.params.items():
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
            entries.append(ConfigEntry(layer, (f"dist.{whole}()",)))
            continue
        entries += [ConfigEntry(f"{layer}.{attr}", (f"dist.{s}()",)) for attr, s in attrs.items() if s]
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
        elif hook.action == "reshard":
            prepare = "PrepareLayerInput" if hook.when == "pre" else "PrepareLayerOutput"
            helper = "reshard_input" if hook.when == "pre" else "reshard_output"
            entries.append(
                ConfigEntry(hook.layer, (f"dist.{prepare}({helper}({_placements_source(hook.placements)}))",))
            )
        # stage_handoff hooks are what pp_config's split points do.
    for layer, kinds in sequence.items():
        pair = _SEQUENCE_PARALLEL_PAIRS.get(frozenset(kinds))
        plans = (f"dist.{pair}()",) if pair else tuple(_SEQUENCE_PARALLEL_SINGLE[k] for k in sorted(kinds))
        entries.append(ConfigEntry(layer, plans))
    return entries


def _placements_source(placements: list[str]) -> str:
    def one(p: str) -> str:
        dim = shard_dim(p)
        return "dist.Replicate()" if p == "R" else "dist.Partial()" if p == "P" else f"dist.Shard({dim})"

    return "[" + ", ".join(one(p) for p in placements) + "]"


# -- collapsing entries into Paddle's regex keys ------------------------------------------------------------


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
    """The regular expression ``dist.parallelize`` reads for a collapsed layer ``pattern``,
    every name part escaped; ``attr`` names one parameter of the layer.

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


def _collapse_entries(
    entries: list[ConfigEntry], layers: set[str], attrs_of: dict[str, set[str]], problems: list[str]
) -> dict[str, tuple[str, ...]]:
    """Entries with the same plans over numbered layers become one key (``layers[.][0-9]+[.]mlp``,
    or ``layers[.](?:0|1)[.]mlp`` for a subset), kept only when the key, read as Paddle reads it,
    names exactly the intended layers among those the plan knows; otherwise one key each. A key
    that cannot name its layer exactly is a problem, never a config that shards something else."""
    by_key: dict[str, tuple[str, ...]] = {}
    for entry in entries:  # a layer may get a style and a hook: both apply
        by_key[entry.key] = by_key.get(entry.key, ()) + entry.plans
    universe = set(by_key) | layers
    config: dict[str, tuple[str, ...]] = {}
    for row in collapse(by_key, universe=universe):
        if len(row.members) > 1:
            key = _key_for(row.pattern, row.members, layers, attrs_of)
            if key is not None:
                config[key] = row.value
                continue
        for member in row.members:
            key = _key_for(member, (member,), layers, attrs_of)
            if key is None:
                problems.append(f"{member}: no dist.parallelize key names exactly this layer")
            else:
                config[key] = row.value
    return config


def _key_for(pattern: str, members: tuple[str, ...], layers: set[str], attrs_of: dict[str, set[str]]) -> str | None:
    """Paddle's key for ``members`` (one collapsed ``pattern``), or None when, read as Paddle
    reads it, it would not name exactly their layers among ``layers``."""
    is_param = members[0] not in layers
    attr = pattern.rpartition(".")[2] if is_param else None
    key = paddle_key(pattern.rpartition(".")[0] if is_param else pattern, attr)
    intended = {m.rpartition(".")[0] if m not in layers else m for m in members}
    matched = {layer for layer in layers if paddle_key_matches(key, layer, attrs_of.get(layer, set()))}
    return key if matched == intended else None


def _expand(ranges: str) -> list[str]:
    """``"0-2,8"`` -> ``["0", "1", "2", "8"]``."""
    out = []
    for part in ranges.split(","):
        a, _, b = part.partition("-")
        out += [str(i) for i in range(int(a), int(b or a) + 1)]
    return out


def _model_params(plan: Plan) -> dict[str, tuple[int, str]]:
    """The model's own parameters (no dot in the FQN): name -> (stage, placements source
    without the pp dim)."""
    names = plan.mesh.axes
    return {
        fqn: (p.stage, _placements_source([x for d, x in zip(names, p.placements) if d != "pp"]))
        for fqn, p in sorted(plan.params.items())
        if "." not in fqn
    }


# -- pipeline ---------------------------------------------------------------------------------------


def _split_points(plan: Plan) -> list[str]:
    """The layer ending each stage but the last: the plan's stage hand-off sites, or else the
    last block of each stage."""
    if plan.strategy.pp == 1:
        return []
    handoffs = sorted((h for h in plan.hooks if h.action == "stage_handoff"), key=lambda h: h.to_stage)
    if handoffs:
        return [h.layer for h in handoffs]
    last: dict[int, str] = {}
    for block in plan.blocks:
        last[block.stage] = block.layer
    return [last[s] for s in range(plan.strategy.pp - 1)]


# -- the module text ----------------------------------------------------------------------------------------


def _nested(ids: list[int], shape: list[int]) -> list:
    if len(shape) == 1:
        return list(ids)
    step = len(ids) // shape[0]
    return [_nested(ids[i : i + step], shape[1:]) for i in range(0, len(ids), step)]


_HELPERS = {
    "split_sequence_input": '''

def split_sequence_input(process_mesh):
    """A PrepareLayerInput function: [b, s, h] -> [s/mp, b, h], as SequenceParallelEnable does."""

    def hook(layer, args):
        return c_split(args, process_mesh, True)

    return hook
''',
    "gather_sequence_output": '''

def gather_sequence_output(process_mesh):
    """A PrepareLayerOutput function: [s/mp, b, h] -> [b, s, h], as SequenceParallelEnable does."""

    def hook(layer, args, output):
        return c_concat(output, process_mesh, True)

    return hook
''',
    "reshard_input": '''

def reshard_input(placements):
    """A PrepareLayerInput function: reshard the layer's first input to ``placements``."""

    def make(process_mesh):
        def hook(layer, args):
            return (dist.reshard(args[0], process_mesh, placements), *args[1:])

        return hook

    return make
''',
    "reshard_output": '''

def reshard_output(placements):
    """A PrepareLayerOutput function: reshard the layer's output to ``placements``."""

    def make(process_mesh):
        def hook(layer, args, output):
            return dist.reshard(output, process_mesh, placements)

        return hook

    return make
''',
}


def _module_source(
    plan: Plan, source: str, mp_plan: dict[str, tuple[str, ...]], splits: list[str], own: dict[str, tuple[int, str]]
) -> str:
    """The module text. Every value taken from the plan is written as a literal (``repr`` of a
    string, escaped regular expressions as keys): plans are untrusted input, and no plan text
    ever becomes code, not even inside the docstring."""
    s = plan.strategy
    lines = [
        '"""dist.parallelize config equivalent to an autodist plan (PLAN_FILE, for a MODEL_CLASS).',
        "",
        f"Mesh {' x '.join(plan.mesh.axes)} = {' x '.join(str(int(n)) for n in plan.mesh.shape)}, "
        f"dp{int(s.dp)} mp{int(s.mp)} pp{int(s.pp)}, ZeRO stage {int(s.sharding_stage)}.",
        "Generated by `autodist-plan export --to paddle-parallelize`; regenerate it rather than edit it.",
        *(
            [
                f"The plan runs {int(s.micro_batches)} micro-batches per step; dist.parallelize leaves that to the training loop."
            ]
            if s.micro_batches > 1 and s.pp == 1
            else []
        ),
        "",
        "Use on every rank, in place of apply_plan:",
        "",
        "    model, optimizer = parallelize(model, optimizer)",
        '"""',
        "",
        "import paddle.distributed as dist",
    ]
    used = " ".join(p for plans in mp_plan.values() for p in plans)
    helpers = [name for name in sorted(_HELPERS) if re.search(rf"\b{name}\b", used)]
    if any(name.endswith("_sequence_input") or name.endswith("_sequence_output") for name in helpers):
        lines.append("from paddle.distributed.auto_parallel.intermediate.tensor_parallel import c_concat, c_split")
    lines += [_HELPERS[name].rstrip("\n") for name in helpers] + ([""] if helpers else [])
    lines += [
        "",
        f"PLAN_FILE = {source!r}",
        f"MODEL_CLASS = {plan.model.class_name!r}",
        "",
        f"MESH = dist.ProcessMesh({_nested([int(i) for i in plan.mesh.process_ids], plan.mesh.shape)!r}, "
        f"dim_names={list(plan.mesh.axes)!r})",
        "",
        "CONFIG = {",
    ]
    if "dp" in plan.mesh.axes:
        lines.append(f"    'dp_config': {{'sharding_level': {int(s.sharding_stage)}}},")
    if mp_plan:
        lines.append("    'mp_config': {")
        lines.append("        # keys are regular expressions over named_sublayers() names; [.] is a dot")
        lines.append("        'parallelize_plan': {")
        for key, plans in mp_plan.items():
            value = plans[0] if len(plans) == 1 else "[" + ", ".join(plans) + "]"
            lines.append(f"            {key!r}: {value},")
        lines.append("        },")
        lines.append("    },")
    if splits:
        lines.append("    'pp_config': {")
        lines.append("        'split_spec': {")
        lines += [f"            {layer!r}: dist.SplitPoint.END," for layer in splits]
        lines.append("        },")
        lines.append("    },")
    lines += ["}"]
    if own:
        stage_mesh = "MESH.get_mesh_with_dim('pp', stage)" if "pp" in plan.mesh.axes else "MESH"
        lines += [
            "",
            "#: The model's own parameters, which dist.parallelize does not visit (it walks named_sublayers()):",
            "#: name -> (pipeline stage, placements).",
            "MODEL_PARAMETERS = {",
            *[f"    {name!r}: ({int(stage)}, {placements})," for name, (stage, placements) in own.items()],
            "}",
        ]
    lines += [
        "",
        "",
        "def parallelize(model, optimizer=None):",
        '    """Set the mesh and parallelize ``model`` (and ``optimizer``) as the plan says."""',
        "    dist.auto_parallel.set_mesh(MESH)",
    ]
    if own:
        lines += [
            "    for name, (stage, placements) in MODEL_PARAMETERS.items():",
            f"        setattr(model, name, dist.shard_tensor(getattr(model, name), {stage_mesh}, placements))",
        ]
    lines += ["    return dist.parallelize(model, optimizer, config=CONFIG)"]
    return "\n".join(lines) + "\n"
