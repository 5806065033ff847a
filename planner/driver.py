"""The offline phase, driven from one place: load -> trace -> graph -> analyse -> cost -> search -> emit.

Every caller plans through here: the ``autodist-plan`` command, ``check`` and ``graph``,
:func:`autodist.plan` from Python, the benchmarks and the tests. Each stage is one function of
its own module; this module only runs them in order, names each step for :class:`Progress`, and
hands each stage's result to the next:

============  ==========================================  =================================
stage         call                                        hands on
============  ==========================================  =================================
load          :func:`load.load_target`                    ``LoadedModel`` (model, input specs)
trace         :func:`trace.trace_model`                   ``TracedProgram`` (PIR ops, layer per op)
graph         :func:`graph.build_graph`                   ``nx.DiGraph``
analyse       :func:`recognise.analysis.analyze`          ``ModelAnalysis`` (blocks, roles)
cost          :func:`cost.search.price`                   ``PricedModel`` (cost + implicit comm)
search        :func:`cost.search.search`                  ``SearchResult`` (best, alternatives)
emit          :func:`emit.build_plan`                     ``schemas.Plan``
============  ==========================================  =================================

Example::

    >>> from autodist.planner.cost.search import SearchRequest
    >>> made = plan_target("plans/llama_docstring/model.py", None, SearchRequest(devices_per_node=4),
    ...                    {"target": "plans/llama_docstring/model.py"})   # doctest: +SKIP
    >>> made.plan.strategy.dp * made.plan.strategy.mp                        # doctest: +SKIP
    4
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Callable, Sequence

if TYPE_CHECKING:
    import networkx as nx
    import paddle

    from autodist.planner.cost.search import PricedModel, SearchRequest, SearchResult
    from autodist.planner.load import LoadedModel
    from autodist.planner.recognise.analysis import ModelAnalysis
    from autodist.planner.trace import TracedProgram
    from autodist.schemas import Plan
    from autodist.schemas.plan import LocalView, Recompute, Schedule, ShardingStage, Strategy
    from autodist.schemas.vocabulary import TrainingDType

from autodist.planner.progress import Progress

#: The stages in the order :func:`plan_model` runs them (``bench/plan_time.py`` times each).
STAGES = ("load", "trace", "graph", "analyse", "cost", "search", "emit")


@dataclass
class Traced:
    """A model traced to its dataflow graph (what ``autodist-plan graph`` prints)."""

    program: TracedProgram
    graph: nx.DiGraph
    #: The input specs it was traced with (the local-view proof traces the model again at a
    #: batch of its own: :func:`autodist.planner.local_view_proof.rebatched`).
    input_specs: list = field(default_factory=list)


@dataclass
class PlannedModel:
    """A plan and what it was made from (the CLI prints warnings and ``--explain`` from them)."""

    plan: Plan
    analysis: ModelAnalysis
    result: SearchResult
    traced: TracedProgram
    #: The cost stage's result: the model priced, and analysed, under each way a strategy runs it.
    priced: PricedModel | None = None
    #: Each sub-layer kind the plan keeps gathered or replicated: why, where in the model's code,
    #: and the smallest rewrite where one is known (:func:`_kept_whole`; warnings and ``--explain``).
    kept_whole: list[str] = field(default_factory=list)
    #: Each Paddle SPMD rule that crashed while planning, and where (a warning each; the layout
    #: is planned as if the op needed whole inputs: :func:`.recognise.spmd.crashes_noted`).
    crashes: list[str] = field(default_factory=list)
    #: How the model was loaded where that was not as usual (:attr:`.load.LoadedModel.notes`: built
    #: eagerly); in the plan's notes and a warning each.
    loading: list[str] = field(default_factory=list)


def load(target: str, input_specs: Sequence[str] | None = None, progress: Progress | None = None) -> LoadedModel:
    """Stage 1: import ``target`` and build its model lazily (see :mod:`autodist.planner.load`)."""
    from autodist.planner.load import load_target

    with (progress or _QUIET).step(f"loading {target}"):
        return load_target(target, list(input_specs) if input_specs else None)


def trace(model: paddle.nn.Layer, input_specs: list, progress: Progress | None = None) -> Traced:
    """Stages 2 and 3: trace ``model`` to PIR and build its dataflow graph."""
    from autodist.planner.graph import build_graph
    from autodist.planner.trace import trace_model

    from autodist.planner.load import user_code

    progress = progress or _QUIET
    with progress.step(f"tracing {type(model).__name__}"), user_code(type(model).__name__):
        program = trace_model(model, input_specs)
    with progress.step("building the graph"):
        return Traced(program=program, graph=build_graph(program), input_specs=list(input_specs))


def analyse(model: paddle.nn.Layer, traced: Traced, progress: Progress | None = None) -> ModelAnalysis:
    """Stage 4: recognise the blocks and the role of every linear."""
    from autodist.planner.recognise.analysis import analyze

    with (progress or _QUIET).step("recognising blocks"):
        analysis = analyze(traced.program, traced.graph, model)
    if traced.program.units:  # the plan says what was traced
        analysis.notes.insert(0, traced.program.fallback_text())
    return analysis


def plan_model(
    model: paddle.nn.Layer,
    input_specs: list,
    request: SearchRequest,
    arguments: dict[str, str],
    progress: Progress | None = None,
    rules: dict[str, str] | None = None,
    *,
    local_view: bool = True,
) -> PlannedModel:
    """Stages 2-7 for a model object: trace, graph, analyse, cost, search, emit.

    ``arguments`` go into the plan's provenance as given (the CLI passes its options).
    ``rules``: ``{layer glob: "colwise" | "rowwise" | "replicate"}`` merged into the analysis
    (:mod:`autodist.planner.recognise.rules`) and recorded in the provenance.
    ``local_view``: run the sub-layers (attention, MLP) with a fused column projection on local
    tensors where the planner proves it (:mod:`autodist.planner.local_view_proof`), and a vocabulary-split
    token lookup where its layer can (``plan.vocab_lookup``).
    Raises :class:`~autodist.planner.errors.PlannerError` for anything the user can fix.
    """
    from autodist.planner.recognise.spmd import crashes_noted

    progress = progress or _QUIET
    traced = trace(model, input_specs, progress)
    with crashes_noted() as crashes:  # recognition replays Paddle's SPMD rules too
        analysis = analyse(model, traced, progress)
    return plan_analysed(
        analysis, traced, request, arguments, progress, rules, model=model, local_view=local_view, crashes=crashes
    )


def plan_analysed(
    analysis: ModelAnalysis,
    traced: Traced,
    request: SearchRequest,
    arguments: dict[str, str],
    progress: Progress | None = None,
    rules: dict[str, str] | None = None,
    *,
    model: paddle.nn.Layer | None = None,
    local_view: bool = True,
    crashes: Sequence[str] = (),
) -> PlannedModel:
    """Stages 5-7 for an analysed model: cost, search, emit (:func:`plan_model` without the
    tracing, for callers that plan one model for several requests). ``rules`` change
    ``analysis`` (its blocks' roles). ``local_view`` (with the ``model``, whose sub-layers are
    run to prove it): as :func:`plan_model`; off, the token lookup stays in the global view too.
    ``crashes``: the SPMD rule crashes met while analysing; with those met here, the plan's notes
    and the warnings say them."""
    from autodist.planner.recognise.rule_worker import RULES
    from autodist.planner.recognise.spmd import crashes_noted

    try:
        with crashes_noted() as costing:  # pricing replays Paddle's SPMD rules per mp
            made = _plan_analysed(analysis, traced, request, arguments, progress, rules, model, local_view)
    finally:
        RULES.close()  # its child ends with the plan
    crashes = [*crashes, *costing]
    if crashes:  # the plan was made: say the crashes in its notes (kept in order, once each)
        import msgspec

        notes = list(dict.fromkeys([*made.plan.notes, *crashes]))
        made = replace(made, plan=msgspec.structs.replace(made.plan, notes=notes), crashes=crashes)
    return made


def _plan_analysed(
    analysis: ModelAnalysis,
    traced: Traced,
    request: SearchRequest,
    arguments: dict[str, str],
    progress: Progress | None,
    rules: dict[str, str] | None,
    model: paddle.nn.Layer | None,
    local_view: bool,
) -> PlannedModel:
    """:func:`plan_analysed`'s stages, the rule crashes they meet left to it."""
    from autodist.planner.cost.search import check_fixed_degrees, kernels_for, price
    from autodist.planner.emit import build_plan

    progress = progress or _QUIET
    if rules:
        from autodist.planner.recognise.rules import apply_rules, canonical_rules

        rules = apply_rules(analysis, rules)
        arguments = {**arguments, "rules": canonical_rules(rules)}
    if not local_view:  # --no-local-view: nothing runs on local tensors, the token lookup neither
        analysis = replace(analysis, local_lookup=None, local_lookup_refusal="local tensors are off: --no-local-view")
    local_view = local_view and model is not None  # a view is proven by running the model's sub-layer
    with progress.step("pricing the model"):
        priced = price(analysis, kernels_for(analysis, request), local_view)
    check_fixed_degrees(priced.cost, request)
    with progress.step(f"searching strategies for {request.world} devices"):
        result = _searched(priced, request, model)
    views = None
    if local_view and model is not None:
        from autodist.planner.local_view_proof import rebatched

        # traced again at a batch of its own, once, when a proof needs it (in the proof's child)
        again = functools.cache(lambda: rebatched(model, traced.input_specs, traced.program.layer_calls))
        while True:
            with progress.step("proving local views"):
                views = _proven_views(analysis, model, result.best.strategy, traced.program.layer_calls, again)
            # The search priced every candidate as a local view (PricedModel); one whose proof
            # failed runs gathered, so it is priced gathered and the search runs again without it.
            unproven = priced.assumed_local(result.best.strategy) - {view.layer for view in views[0]}
            if not unproven:
                break
            priced = replace(priced, local_views=priced.local_views - unproven)
            with progress.step("searching again, the unproven local views gathered"):
                result = _searched(priced, request, model)
    _refuse_crashes(analysis, model, views, result.best.strategy)
    if result.setup is not None:  # the dtype priced: the request's, else the model's (provenance says which)
        arguments = {**arguments, "dtype": result.setup.dtype}
    proven = frozenset(view.layer for view in views[0]) if views else frozenset()
    with progress.step("writing the plan"):  # the analysis the search priced the strategy with
        plan = build_plan(priced.analysis_of(result.best.strategy, proven), result, request, arguments, views)
    kept = _kept_whole(
        analysis, model, plan.strategy.mp, views[1] if views else [], {view.layer for view in plan.local_view}
    )
    return PlannedModel(
        plan=plan, analysis=analysis, result=result, traced=traced.program, priced=priced, kept_whole=kept
    )


def _proven_views(
    analysis: ModelAnalysis, model: paddle.nn.Layer, strategy: Strategy, calls: dict, again: Callable
) -> tuple[list[LocalView], list[str]]:
    """:func:`.local_view_proof.local_views`, run in a child forked from the planner
    (:mod:`.contained`): the proofs run the model's sub-layers forward and backward in Paddle, each
    kind in a child of its own (a crash there leaves that kind gathered), and a Paddle crash
    elsewhere in the proof leaves every candidate gathered, one note per kind naming the crash,
    instead of ending the planner. The proofs' side effects (random draws, lazy weights made, the
    retrace at a batch of its own, ``again``) stay in the child; what crosses back is the views and
    the notes."""
    from autodist.planner.contained import Crashed, run_forked
    from autodist.planner.local_view_proof import candidates, local_views

    try:
        return run_forked("the local-view proof", local_views, analysis, model, strategy, calls, again, nests=True)
    except Crashed as crash:
        by_kind: dict[str, list[str]] = {}  # how each candidate runs instead: the candidates
        for candidate in candidates(analysis, strategy.mp):
            by_kind.setdefault(candidate.otherwise, []).append(candidate.layer)
        return [], [
            f"local view: {layers[0]}{f' and {len(layers) - 1} more like it stay' if layers[1:] else ' stays'} "
            f"global ({otherwise}): {crash} in Paddle, so no local view was proven (a Paddle bug: please "
            "report it with the model)"
            for otherwise, layers in by_kind.items()
        ]


#: How parameters read only by the code between traced layers get split.
READ_IN_A_TRACED_LAYER = (
    "read each in the forward of a layer of its own that traces (experts as numbered layers, a LayerList of "
    "MLPs as Mixtral's, which the planner runs as an MoE layer), not sliced in a forward that does not trace"
)


def _kept_whole(
    analysis: ModelAnalysis, model: paddle.nn.Layer | None, mp: int, view_notes: list[str], local: set[str]
) -> list[str]:
    """One line per sub-layer kind that stays gathered or replicated: the planner's reason (what
    stopped the split, or why its local view was not proven), the forward of the sub-layer the
    reason names (``Class.forward at file:line``), and the smallest rewrite where one is known:
    by the op that stopped the split (:data:`~autodist.planner.recognise.spmd.REWRITES`), or
    reading sizes the trace does not know (an op of that layer with a -1 size). A layer whose
    parameters no traced op reads (:func:`~.emit.read_outside_trace`) names the forward of the
    layer holding it, where the code that reads them runs."""
    from autodist.planner.emit import outside_trace_note, read_outside_trace
    from autodist.schemas.describe import layers_text
    from autodist.planner.local_view_proof import candidates
    from autodist.planner.recognise.roles import sliced_weights
    from autodist.planner.recognise.spmd import REWRITES, RUN_TIME_SIZES, SLICED_WEIGHT, dynamic
    from autodist.planner.trace import forward_source, subscript_source

    def located(note: str, layer: str | None, rewrite: str) -> str:
        where = forward_source(model, layer) if model is not None and layer is not None else ""
        return note + (f"; model code: {where}" if where else "") + (f"; to split it: {rewrite}" if rewrite else "")

    def run_time_sizes(layer: str) -> bool:
        graph = analysis.graph
        return any(dynamic(graph.nodes[n]["shapes"] or []) for n in graph if graph.nodes[n]["layer"] == layer)

    lines = []
    alike: dict[tuple[str, ...], list[str]] = {}  # each kind of layer once: blocks.0-1.ffn.experts.mlp
    for layer, own in read_outside_trace(analysis).items():
        alike.setdefault(tuple(own), []).append(layer)
    for kind, layers in alike.items():
        note = outside_trace_note(layers_text(layers), list(kind))
        lines.append(located(note, layers[0].rpartition(".")[0], READ_IN_A_TRACED_LAYER))
    views_ran = bool(view_notes or local)  # then each candidate's note says how it runs, and why
    sliced = sliced_weights(analysis.graph)
    for note, (layer, op, local_view) in analysis.refusals.items():
        # its products multiply by a parameter's slices: no candidate of a local view, so no note of one
        read_in_slices = [w for w in sliced if w.rpartition(".")[0] == layer]
        if local_view and views_ran and not read_in_slices:
            continue
        rewrites = [RUN_TIME_SIZES] if run_time_sizes(layer) else [REWRITES.get(op, "")]
        if read_in_slices and model is not None:
            name = read_in_slices[0].rpartition(".")[2]
            rewrites.insert(0, SLICED_WEIGHT.format(name=name))
            note += f"; model code: {subscript_source(model, read_in_slices[0])}"
        lines.append(located(note, None if read_in_slices else layer, "; and ".join(r for r in rewrites if r)))
    unproven = [c for c in candidates(analysis, mp) if c.layer not in local] if mp > 1 else []
    for note in view_notes:  # a candidate stopped by an op with no rule keeps that op's rewrite
        found = next((c for c in unproven if note.startswith(f"local view: {c.layer} ")), None)
        stopped_by = found.sublayer.stopped_by if found else ""
        lines.append(located(note, found.layer if found else None, REWRITES.get(stopped_by, "")))
    return lines


def _searched(priced: PricedModel, request: SearchRequest, model: paddle.nn.Layer | None) -> SearchResult:
    """The search's result; its refusal of an op in one layer (``PlannerError.layer``) names that
    layer's forward and source line, where the model is at hand (the search holds none)."""
    from autodist.planner.cost.search import search
    from autodist.planner.errors import PlannerError
    from autodist.planner.trace import forward_source

    try:
        return search(priced, request)
    except PlannerError as err:
        where = forward_source(model, err.layer) if model is not None and err.layer is not None else ""
        if not where:
            raise
        raise PlannerError(f"{err.message}; model code: {where}", err.detail, err.layer) from None


def _refuse_crashes(
    analysis: ModelAnalysis,
    model: paddle.nn.Layer | None,
    views: tuple[list[LocalView], list[str]] | None,
    strategy: Strategy,
) -> None:
    """Refuse, in one line, a model with an op Paddle cannot run on the distributed tensors
    apply_plan gives it (:mod:`~autodist.planner.recognise.crashes`) outside the sub-layers that
    run on local tensors (``views``: those proven under ``strategy``, and the notes of those that
    were not; None with local views off): naming the sub-layer, its forward's source line and the
    rewrite, and why no local view holds it (not proven, off, or not run by ``strategy``)."""
    from autodist.planner.errors import PlannerError
    from autodist.planner.recognise.crashes import distributed_crashes
    from autodist.planner.recognise.reshards import local_view_candidates
    from autodist.planner.trace import forward_source
    from autodist.schemas.parallel_dims import runs_local_views

    proven, notes = views or ([], [])
    found = [crash for graph in analysis.graphs for crash in distributed_crashes(graph)]  # training's too
    crashes = [c for c in found if not any(_inside(c.layer, v.layer) for v in proven)]
    if crashes:
        first = crashes[0]
        where = forward_source(model, first.layer) if model is not None else ""
        owners = [
            layer for b in analysis.blocks for layer, _ in local_view_candidates(b) if _inside(first.layer, layer)
        ]
        why = next((n for n in notes for owner in owners if n.startswith(f"local view: {owner} ")), "")
        if not owners:
            otherwise = "no sub-layer around it can run as a local view, on plain tensors, so"
        elif views is None:
            otherwise = (
                "its sub-layer can run on plain tensors only as a local view, which --no-local-view turns off, or"
            )
        elif not runs_local_views(strategy):
            otherwise = (
                "its sub-layer can run on plain tensors only as a local view, which runs under tensor and data "
                "parallelism alone (give --mp, no pipeline, sequence parallelism, ZeRO, recompute or "
                "micro-batches), or"
            )
        else:  # the reason, as local_views notes it: "local view: <layer> stays global (<how>): <reason>"
            reason = f" ({why.split(': ', 2)[-1]})" if why else ""
            otherwise = f"no local view of it was proven{reason}, so"
        raise PlannerError(
            f"{first.layer or 'the model'}{f' ({where})' if where else ''} takes {first.idiom}, and every "
            f"plan makes its inputs distributed: {otherwise} {first.rewrite}"
        )


def _inside(layer: str, outer: str) -> bool:
    return layer == outer or layer.startswith(outer + ".")


def plan_target(
    target: str,
    input_specs: Sequence[str] | None,
    request: SearchRequest,
    arguments: dict[str, str],
    progress: Progress | None = None,
    rules: dict[str, str] | None = None,
    *,
    local_view: bool = True,
) -> PlannedModel:
    """The whole offline phase for a model file: load, then :func:`plan_model`."""
    loaded = load(target, input_specs, progress)
    made = plan_model(loaded.model, loaded.input_specs, request, arguments, progress, rules, local_view=local_view)
    if not loaded.notes:
        return made
    import msgspec

    plan = msgspec.structs.replace(made.plan, notes=[*loaded.notes, *made.plan.notes])
    return replace(made, plan=plan, loading=loaded.notes)


def plan(
    model: paddle.nn.Layer,
    input_spec: Sequence[paddle.static.InputSpec | str],
    *,
    devices: int | None = None,
    nodes: int | None = None,
    device: str | None = None,
    cluster: str | None = None,
    dp: int | None = None,
    mp: int | None = None,
    pp: int | None = None,
    sequence_parallel: bool | None = None,
    sharding_stage: ShardingStage | None = None,
    micro_batches: int | None = None,
    schedule: Schedule | None = None,
    global_batch_size: int | None = None,
    micro_batch_size: int | None = None,
    seq_len: int | None = None,
    dtype: TrainingDType | None = None,
    optimizer: str = "adam",
    recompute: Recompute = "none",
    rules: dict[str, str] | None = None,
    ep: int | None = 1,
    attention: str = "auto",
    local_view: bool = True,
) -> Plan:
    """Plan ``model`` from Python, as ``autodist-plan`` plans a model file (``autodist.plan``).

    ``input_spec``: ``paddle.static.InputSpec`` objects or ``"name:dtype:BxS"`` strings.
    The keywords are the command's options (``devices`` is ``--nproc-per-node``, alias
    ``--devices``: processes, one per device, per node; ``nodes`` is ``--nnodes``;
    ``device`` is ``--device``, a profile name (left out with no ``cluster``: this machine's GPU's
    profile, else ``cpu``, said in the plan's notes); ``cluster`` is ``--cluster``, a TOML file; ``devices``
    and ``nodes`` left out are the cluster file's, else 1; ``ep`` is ``--ep``, None for ``auto``;
    ``attention`` is ``--attention``: ``auto``, ``flash`` or ``eager``; ``local_view`` is
    ``--local-view/--no-local-view``).
    The plan equals the command's for the same model, but for ``provenance.arguments.target``,
    which names the model's class (``module:Class``) instead of a file. Raises ``PlannerError`` for anything the
    caller can fix. Save the plan with :func:`autodist.save_plan`. As quiet as the command: what
    Paddle and networkx print while planning is dropped (:mod:`autodist.planner.quiet`); what the
    model prints is kept.

    Example::

        >>> import autodist                                                     # doctest: +SKIP
        >>> plan = autodist.plan(model, ["input_ids:int64:4x1024"], devices=8, nodes=2,
        ...                      device="h100-sxm")                             # doctest: +SKIP
        >>> autodist.save_plan(plan, "plan.json")                               # doctest: +SKIP
    """
    from autodist.schemas import PlanError

    from autodist.planner.cost.hardware import cluster_shape, planned_device
    from autodist.planner.cost.search import SearchRequest
    from autodist.planner.errors import PlannerError
    from autodist.planner.load import parse_input_spec
    from autodist.planner.quiet import without_library_noise

    specs = [parse_input_spec(s) if isinstance(s, str) else s for s in input_spec]
    options: dict[str, Any] = dict(  # the request's fields, as typed in the signature above
        dp=dp,
        mp=mp,
        pp=pp,
        sequence_parallel=sequence_parallel,
        sharding_stage=sharding_stage,
        micro_batches=micro_batches,
        schedule=schedule,
        global_batch_size=global_batch_size,
        micro_batch_size=micro_batch_size,
        seq_len=seq_len,
        dtype=dtype,
        optimizer=optimizer,
        recompute=recompute,
        attention=attention,
    )
    devices, nodes = cluster_shape(cluster, devices, nodes)
    profile, device_note = planned_device(device, cluster, devices)
    request = SearchRequest(
        devices_per_node=devices,
        nodes=nodes,
        device=profile,
        ep=ep,
        device_note=device_note,
        **options,
    )
    # Provenance in the command's words (its option names, its value spelling).
    given = {
        "target": f"{type(model).__module__}:{type(model).__qualname__}",  # the class, as a TARGET spells it
        "devices": devices,
        "nodes": nodes,
        "device_name": device,
        "cluster_file": cluster,
        **options,
        "ep": None if ep == 1 else "auto" if ep is None else ep,
        "local_view": local_view,
    }
    if any(isinstance(s, str) for s in input_spec):
        given["input_specs"] = ",".join(s if isinstance(s, str) else _spec_text(s) for s in input_spec)
    arguments = {name: str(value) for name, value in sorted(given.items()) if value is not None}
    with without_library_noise(expected=(PlannerError, PlanError)):  # as quiet as the command line
        return plan_model(model, specs, request, arguments, rules=rules, local_view=local_view).plan


def _spec_text(spec: paddle.static.InputSpec) -> str:
    """An InputSpec as the command's ``--input-spec`` spells it: ``input_ids:int64:4x16``."""
    dtype = str(spec.dtype).replace("paddle.", "")
    return f"{spec.name}:{dtype}:{'x'.join(str(d) for d in spec.shape)}"


_QUIET = Progress(quiet=True)
