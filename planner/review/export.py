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
- ``dp_config.sharding_level`` is the ZeRO stage; Paddle requires a ``dp`` mesh dim for it.
- ``dist.parallelize`` walks ``named_sublayers()``, which leaves out the model's own parameters
  (the docstring Llama's LM head ``weight``): the module's ``parallelize`` shards those itself,
  on their stage's mesh, before calling it.
- The plan's sequence-parallel hooks become ``SequenceParallelBegin/End/Enable/Disable`` (a
  hook with no Paddle plan of its own, such as gathering a layer's *output*, a
  ``PrepareLayerInput/Output`` around Paddle's own ``c_split``/``c_concat``), its reshard hooks
  ``PrepareLayerInput/Output`` with a small function written into the module.

Anything the config cannot express exactly (a placement no style produces) is an error, never
a silently different config.

Example::

    >>> from autodist.schemas import load_plan
    >>> print(export_parallelize(load_plan("plan.json"), "plan.json"))   # doctest: +SKIP
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from dataclasses import dataclass

from autodist.schemas import Plan, shard_dim

from autodist.planner.review.format import collapse, natural_key

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
    if plan.strategy.sharding_stage and "dp" not in plan.mesh.dim_names:
        problems.append(f"ZeRO stage {plan.strategy.sharding_stage} without a dp mesh dim")
    if problems:
        raise ExportError("; ".join(problems))
    mp_plan = _collapse_entries(entries, _known_layers(plan), _tensor_attrs(plan))
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
    names = plan.mesh.dim_names
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
            entries.append(ConfigEntry(hook.layer, (f"dist.{prepare}({helper}({_placements_source(hook.placements)}))",)))
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
    (which has tensor attributes ``attrs``), following its code in paddle 3.3."""
    attr = key.split(".")[-1]
    if key.endswith(f".{attr}") and attr in attrs:
        key = key.replace(f".{attr}", "")
    found = re.match(key, layer)
    return key == layer or (found is not None and found.end() - found.start() == len(layer))


def _collapse_entries(
    entries: list[ConfigEntry], layers: set[str], attrs_of: dict[str, set[str]]
) -> dict[str, tuple[str, ...]]:
    """Entries with the same plans over numbered layers become one key (``layers.*.mlp.up_proj``,
    or ``layers.(0|1).mlp.up_proj`` for a subset), kept only when the key, read as Paddle reads
    it, names exactly the intended layers among those the plan knows; otherwise one key each."""
    by_key: dict[str, tuple[str, ...]] = {}
    for entry in entries:  # a layer may get a style and a hook: both apply
        by_key[entry.key] = by_key.get(entry.key, ()) + entry.plans
    universe = set(by_key) | layers
    config: dict[str, tuple[str, ...]] = {}
    for row in collapse(by_key, universe=universe):
        key = re.sub(r"\{([0-9,\-]+)\}", lambda m: "(" + "|".join(_expand(m.group(1))) + ")", row.pattern)
        intended = {m.rpartition(".")[0] if m not in layers else m for m in row.members}
        matched = {layer for layer in layers if paddle_key_matches(key, layer, attrs_of.get(layer, set()))}
        if len(row.members) > 1 and matched != intended:
            for member in row.members:
                config[member] = row.value
        else:
            config[key] = row.value
    return dict(sorted(config.items(), key=lambda kv: natural_key(kv[0])))


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
    names = plan.mesh.dim_names
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
    s = plan.strategy
    lines = [
        f'"""dist.parallelize config equivalent to the autodist plan {source}.',
        "",
        f"Model {plan.model.class_name}, mesh {' x '.join(plan.mesh.dim_names)} = "
        f"{' x '.join(map(str, plan.mesh.shape))}, dp{s.dp} mp{s.mp} pp{s.pp}, ZeRO stage {s.sharding_stage}.",
        "Generated by `autodist-plan export --to paddle-parallelize`; regenerate it rather than edit it.",
        *(
            [f"The plan runs {s.micro_batches} micro-batches per step; dist.parallelize leaves that to the training loop."]
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
        f"MESH = dist.ProcessMesh({_nested(plan.mesh.process_ids, plan.mesh.shape)}, "
        f"dim_names={json.dumps(list(plan.mesh.dim_names))})",
        "",
        "CONFIG = {",
    ]
    if "dp" in plan.mesh.dim_names:
        lines.append(f'    "dp_config": {{"sharding_level": {s.sharding_stage}}},')
    if mp_plan:
        lines.append('    "mp_config": {')
        lines.append('        "parallelize_plan": {')
        for key, plans in mp_plan.items():
            value = plans[0] if len(plans) == 1 else "[" + ", ".join(plans) + "]"
            lines.append(f'            "{key}": {value},')
        lines.append("        },")
        lines.append("    },")
    if splits:
        lines.append('    "pp_config": {')
        lines.append('        "split_spec": {')
        lines += [f'            "{layer}": dist.SplitPoint.END,' for layer in splits]
        lines.append("        },")
        lines.append("    },")
    lines += ["}"]
    if own:
        stage_mesh = 'MESH.get_mesh_with_dim("pp", stage)' if "pp" in plan.mesh.dim_names else "MESH"
        lines += [
            "",
            "#: The model's own parameters, which dist.parallelize does not visit (it walks named_sublayers()):",
            "#: name -> (pipeline stage, placements).",
            "MODEL_PARAMETERS = {",
            *[f'    "{name}": ({stage}, {placements}),' for name, (stage, placements) in own.items()],
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
