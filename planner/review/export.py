"""A plan as Paddle's own ``dist.parallelize`` config, so it can be adopted in hand-written code.

``export_parallelize(plan)`` returns the source of a Python module defining ``MESH``, ``CONFIG``
and ``parallelize(model, optimizer)``. What each placement and hook becomes is decided once, in
:mod:`autodist.schemas.parallelize` (the PaddleFormers ``Trainer`` integration reads it too);
this module collapses its per-layer entries into Paddle's regular-expression keys and writes the
module text.

A plan's local views and local token lookups, which ``dist.parallelize`` has no key for, are
installed by the module's ``parallelize`` through ``autodist.apply_local_views(model, PLAN_FILE)``
before ``dist.parallelize`` runs (so the module needs autodist and the plan file at run time).
Anything else the config cannot express exactly (a placement no style produces, a key that would
name other layers too) is an error, never a silently different config.

For users who want Paddle alone, ``paddle_only=True`` (``export --paddle-only``) writes the
nearest global-view equivalent instead (:func:`global_view_equivalent`): each local view's fused
projections split by columns as planned, their outputs gathered over mp (the planner's own
``--no-local-view`` hooks), the sub-layer's core run whole on every mp rank; the token lookup in
the vocabulary-split table through Paddle's rule, which gathers the table. The module then needs
nothing but Paddle, and says above its config, per sub-layer, what it loses against the plan.

Plans are untrusted input: the module holds the plan's names only as literals (``repr`` of a
string; keys are regular expressions with every name part escaped), so importing it runs
nothing a plan says, whatever its names, class name or file name.

Example::

    >>> from autodist.schemas import load_plan
    >>> print(export_parallelize(load_plan("plan.json"), "plan.json"))   # doctest: +SKIP
"""

from __future__ import annotations

import math
import re

import msgspec

from autodist.schemas import ParamPlan, Plan, shard_dim
from autodist.schemas.vocabulary import DTYPE_BYTES
from autodist.schemas.parallelize import (
    HELPER_STYLES,
    ConfigEntry,
    ExportError,
    ParallelizeConfig,
    Style,
    paddle_key,
    paddle_key_matches,
    parallelize_config,
)

from autodist.planner.review.format import collapse

__all__ = ["ExportError", "export_parallelize", "global_view_equivalent", "paddle_key", "paddle_key_matches"]


def export_parallelize(plan: Plan, source: str = "plan.json", paddle_only: bool = False) -> str:
    """The source of a Python module that configures ``dist.parallelize`` like ``plan``;
    ``paddle_only``: like its nearest global-view equivalent (:func:`global_view_equivalent`),
    with no call into autodist, and a comment per sub-layer on what that loses.

    Raises :class:`ExportError` naming every parameter or hook it cannot express.
    """
    losses: list[str] = []
    if paddle_only:
        plan, losses = global_view_equivalent(plan)
    config = parallelize_config(plan)
    problems: list[str] = []
    mp_plan = _collapse_entries(config.entries, config.layers, config.tensor_attrs, problems)
    if problems:
        raise ExportError("; ".join(problems))
    own = {name: (stage, _placements_source(p)) for name, (stage, p) in config.model_params.items()}
    return _module_source(plan, source, mp_plan, config, own, losses)


def global_view_equivalent(plan: Plan) -> tuple[Plan, list[str]]:
    """``plan`` with nothing on local tensors, as the planner plans it with ``--no-local-view``
    under the same strategy, and one line per sub-layer on what that loses:

    - a local view with a fused projection (a weight of several ``segments``, ``q|k|v``): every
      weight placed as planned (in the model's own layout; a multi-query ``q|k|v`` held whole for
      the local view is split by columns again), and the fused projection's output gathered over
      mp (``gather_hook``), so the core after it runs whole on every mp rank;
    - one without (a sub-layer local only because ops Paddle's global view cannot keep split stop
      its split: ops with no SPMD rule, heads folded into the batch): replicated over mp, run
      whole on every mp rank (a joined view's row projection, outside it, stays split by rows:
      Paddle takes each rank's slice of its whole input);
    - a token lookup: in the global view, where Paddle's rule gathers the vocabulary-split table.

    The costs are per rank and step, from the plan's shapes: the tokens a rank reads per step
    (the plan's global batch over dp, times the traced sequence) and the parameters' dtype.

    >>> from autodist.schemas import load_plan                                   # doctest: +SKIP
    >>> gathered, losses = global_view_equivalent(load_plan("plan.json"))        # doctest: +SKIP
    """
    # here, not at the top: importing the command line must not import Paddle (its warnings are
    # silenced first: planner/quiet.py), and recognise imports it
    from autodist.planner.recognise.reshards import gather_hook

    axes, s = list(plan.mesh.axes), plan.strategy
    if not plan.local_view and not plan.vocab_lookup:
        return plan, []
    params, hooks, losses = dict(plan.params), list(plan.hooks), []
    mp_axis = axes.index("mp")
    spec = plan.model.input_specs[0].shape if plan.model.input_specs else [1, 1]
    batch, seq = (plan.data.global_batch_size or max(spec[0], 1)), max(spec[-1], 1)
    tokens = batch * seq // s.dp  # per rank and step
    for view in plan.local_view:
        fused = [(w, w.dim) for w in view.weights if w.segments > 1 and w.dim is not None]
        if not fused:
            for w in view.weights:
                params[w.param] = _on_mp(params[w.param], mp_axis, "R")
            losses.append(
                f"{view.layer}: replicated over mp (ops the global view cannot keep split stop its split): "
                f"every mp rank runs it whole, {s.mp}x a local view's FLOPs and activations, and holds its "
                "weights whole"
            )
            continue
        gathered: dict[str, tuple[int, int]] = {}  # fused projection -> its output's width, its segments
        for w, dim in fused:
            if w.replicated:  # held whole for the view (multi-query K and V): split as planned without it
                params[w.param] = _on_mp(params[w.param], mp_axis, f"S({dim})")
            # the weight's split dim and the bias's are the projection's output dim
            gathered[w.param.rpartition(".")[0]] = (plan.params[w.param].shape[dim], w.segments)
        hooks += [gather_hook(layer, f"{n} segments of {view.layer}", axes) for layer, (_, n) in gathered.items()]
        width = DTYPE_BYTES[plan.params[fused[0][0].param].dtype]
        received = sum(tokens * out * (s.mp - 1) // s.mp * width for out, _ in gathered.values())
        losses.append(
            f"{view.layer}: {', '.join(gathered)} split by columns, output all-gathered over mp "
            f"(+{_mib(received)} received per rank per step, forward, plus the recompute's when recomputed); "
            f"the core after it runs whole on all {s.mp} mp ranks: {s.mp}x a local view's core FLOPs and "
            "activations (all heads' scores on every rank)"
        )
    for lookup in plan.vocab_lookup:
        table = plan.params[lookup.weight]
        size = math.prod(table.shape) * DTYPE_BYTES[table.dtype]
        losses.append(
            f"{lookup.layer}: looked up in the global view, where Paddle's rule all-gathers the vocabulary-split "
            f"table {lookup.weight} before the lookup and again in its backward (+{_mib(2 * size * (s.mp - 1) // s.mp)} "
            "received per rank per step)"
        )
    equivalent = msgspec.structs.replace(plan, params=params, hooks=hooks, local_view=[], vocab_lookup=[])
    return equivalent, losses


def _on_mp(param: ParamPlan, mp_axis: int, placement: str) -> ParamPlan:
    placements = list(param.placements)
    placements[mp_axis] = placement
    return msgspec.structs.replace(param, placements=placements)


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.2f} MiB" if nbytes >= 2**20 else f"{nbytes} bytes"


def _style_source(style: Style) -> str:
    """The Python expression of one Paddle plan in the module (helpers: see ``_HELPERS``)."""
    if style.name not in HELPER_STYLES:
        return f"dist.{style.name}()"
    if style.name.startswith("reshard"):
        return f"dist.{HELPER_STYLES[style.name]}({style.name}({_placements_source(list(style.placements))}))"
    return f"dist.{HELPER_STYLES[style.name]}({style.name})"


def _placements_source(placements: list[str]) -> str:
    def one(p: str) -> str:
        return "dist.Replicate()" if p == "R" else "dist.Partial()" if p == "P" else f"dist.Shard({shard_dim(p)})"

    return "[" + ", ".join(one(p) for p in placements) + "]"


# -- collapsing entries into Paddle's regex keys ------------------------------------------------------------


def _collapse_entries(
    entries: list[ConfigEntry], layers: set[str], attrs_of: dict[str, set[str]], problems: list[str]
) -> dict[str, tuple[str, ...]]:
    """Entries with the same plans over numbered layers become one key (``layers[.][0-9]+[.]mlp``,
    or ``layers[.](?:0|1)[.]mlp`` for a subset), kept only when the key, read as Paddle reads it,
    names exactly the intended layers among those the plan knows; otherwise one key each. A key
    that cannot name its layer exactly is a problem, never a config that shards something else."""
    by_key: dict[str, tuple[str, ...]] = {}
    for entry in entries:  # a layer may get a style and a hook: both apply
        by_key[entry.key] = by_key.get(entry.key, ()) + tuple(_style_source(style) for style in entry.plans)
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
    plan: Plan,
    source: str,
    mp_plan: dict[str, tuple[str, ...]],
    config: ParallelizeConfig,
    own: dict[str, tuple[int, str]],
    losses: list[str],
) -> str:
    """The module text. Every value taken from the plan is written as a literal (``repr`` of a
    string, escaped regular expressions as keys): plans are untrusted input, and no plan text
    ever becomes code, not even inside the docstring."""
    s = plan.strategy
    splits, local = config.split_points, config.local_layers
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
        *(
            [
                f"{len(local)} sub-layers run on local tensors (Megatron's tensor parallelism), for which",
                "dist.parallelize has no key: autodist.apply_local_views installs them from PLAN_FILE",
                "(read from the working directory, on every rank) before dist.parallelize lays out the rest.",
                "",
            ]
            if local
            else []
        ),
        *(
            [
                "Paddle only (--paddle-only): the nearest global-view equivalent of a plan that runs sub-layers on",
                "local tensors; what each loses is said above CONFIG.",
                "",
            ]
            if losses
            else []
        ),
        "Use on every rank, in place of apply_plan:",
        "",
        "    model, optimizer = parallelize(model, optimizer)",
        '"""',
        "",
        *(["import autodist"] if local else []),
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
        *(
            ["#: Paddle only: what running these in the global view loses against the plan's local tensors:"]
            + [f"#: - {line}" for line in losses]
            if losses
            else []
        ),
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
        *(
            ["    autodist.apply_local_views(model, PLAN_FILE)  # the sub-layers on local tensors, first"]
            if local
            else []
        ),
    ]
    if own:
        lines += [
            "    for name, (stage, placements) in MODEL_PARAMETERS.items():",
            f"        setattr(model, name, dist.shard_tensor(getattr(model, name), {stage_mesh}, placements))",
        ]
    lines += ["    return dist.parallelize(model, optimizer, config=CONFIG)"]
    return "\n".join(lines) + "\n"
