"""Turn the model analysis and the chosen strategy into a :class:`autodist.schemas.Plan`.

What goes where:

- mesh ``pp, dp, mp`` (dims of size one left out, at least one dim); ``R`` on pp and dp;
- on mp: column-parallel linears ``S(split_dim)`` (bias ``S(0)``), row-parallel ``S(split_dim)``
  (bias ``R``), the embedding split over the vocabulary and the LM head column-parallel when
  the vocabulary divides; everything else (norms, unmatched layers) replicated;
- pipeline stages: blocks split as evenly as possible (earlier stages take the extra block),
  what runs before the first block on stage 0, what runs after the last on the last stage, and a
  ``stage_handoff`` post-hook on each stage's last block;
- sequence parallelism: ``sequence_parallel_begin`` after the embedding, ``..._end`` / ``..._begin``
  around every sub-layer that mixes positions (attention), ``reshard`` around position-wise ones
  (MLP), ``sequence_parallel_end`` after the final norm — the hooks ``to_distributed`` installs;
- recompute: every block (``full``) or each block's attention sub-layer (``selective``);
- expert parallelism (``ep > 1``), and data parallelism of an MoE model without it (ep 1: the
  MoE layers then run on each rank's own tokens, see ``schemas.parallel_dims.runs_moe_locally``): an ``expert_dispatch``
  pre-hook and an ``expert_combine`` post-hook on each MoE layer (the parent of a block's
  experts container); every parameter under that layer whole on each rank (all ``R``, on mp
  too: with ep > 1 and mp > 1 every mp rank runs the MoE layer whole, no reshard hook inside it),
  its experts ``ExpertParallel`` (at ep 1 every rank holds them all);
- the data plan, the analysis's reshard hooks and implicit communication, notes, provenance.

Example::

    >>> priced = price(analysis)                                                     # doctest: +SKIP
    >>> result = search(priced, request)                                             # doctest: +SKIP
    >>> plan = build_plan(priced.analysis_of(result.best.strategy), result, request, {"target": "model.py"})  # doctest: +SKIP
    >>> plan.params["layers.0.self_attn.q_proj.weight"].placements  # doctest: +SKIP
    ['R', 'S(1)']
"""

from __future__ import annotations

import math
from importlib import metadata
from typing import Sequence

import msgspec
import networkx as nx
import paddle

from autodist.schemas.plan import ParallelStyle
from autodist.schemas.vocabulary import MESH_AXES, as_dtype
from autodist.schemas import (
    Alternatives,
    Block,
    Cluster,
    DataPlan,
    Hook,
    Reshard,
    SequenceParallelBegin,
    SequenceParallelEnd,
    StageHandoff,
    ExpertCombine,
    ExpertDispatch,
    InputSpec,
    LocalView,
    Mesh,
    ModelInfo,
    ParamPlan,
    Plan,
    Provenance,
    Strategy,
    VocabLookup,
)

from autodist.schemas.parallel_dims import runs_moe_locally
from autodist.schemas.local_view import mp_placement
from autodist.schemas.parallel_dims import local_views_refused
from autodist.schemas.schedules import block_stages

from autodist.planner.ops import SEQUENCE_MIXING_OPS, SHAPE_ONLY_OPS, short_op
from autodist.planner.recognise.analysis import (
    LinearUse,
    ModelAnalysis,
    attention_layer,
    params_before_blocks,
    params_read_on_both_sides,
)
from autodist.planner.cost.search import SearchRequest, SearchResult
from autodist.planner.recognise.reshards import reshard_hooks, vocab_parallel_problems


def build_plan(
    analysis: ModelAnalysis,
    result: SearchResult,
    request: SearchRequest,
    arguments: dict[str, str],
    views: tuple[list[LocalView], list[str]] | None = None,
) -> Plan:
    """The complete plan for ``result.best``'s strategy, from ``analysis``: the analysis as that
    strategy runs it, the one the search priced (``PricedModel.analysis_of``,
    planner/cost/strategy_analysis.py: a stopped sub-layer proven local split, each MoE layer
    whole where it runs locally, so no mp placement or reshard hook inside it). ``views``: the
    proven local views and the notes on those that are not (:func:`.local_view.local_views`);
    a local-view sub-layer's fused projections get no gather hook."""
    local_view, view_notes = views or ([], [])
    strategy = result.best.strategy
    local = frozenset(view.layer for view in local_view)
    mesh = build_mesh(strategy)
    notes: list[str] = []
    params = _placed_as_viewed(_param_plans(analysis, strategy, mesh.axes, notes), local_view, mesh.axes, notes)
    vocab_lookup = _vocab_lookups(analysis, strategy, params, notes)
    stages = block_stages(len(analysis.blocks), strategy.pp, strategy.virtual_stages)
    hooks = _stage_handoffs(analysis, stages) + _expert_hooks(analysis, strategy)
    fused_gathers = reshard_hooks(analysis, strategy.mp, mesh.axes, local)
    notes += view_notes
    if local_view:
        notes.append(
            f"local view: {len(local_view)} sub-layer(s) run on local tensors (plan.local_view), priced so: "
            "at 1/mp width (an attention's core on 1/mp of the heads), one all-reduce of the output forward and "
            "of the input gradient backward"
        )
    if strategy.mp > 1:
        hooks += _sequence_parallel_hooks(analysis, strategy, mesh.axes, fused_gathers, notes)
    notes += _tied_across_stages(analysis, strategy.pp)
    if strategy.micro_batches > 1 and strategy.schedule == "none":
        notes.append(
            f"micro_batches={strategy.micro_batches}: apply_plan accumulates gradients (the loader yields "
            f"{strategy.micro_batches} micro-batches per batch, the optimizer updates once per batch)"
        )
    notes += [unmatched_note(layer) for layer in unmatched(analysis, local_view)]
    notes += [outside_trace_note(layer, names) for layer, names in read_outside_trace(analysis).items()]
    recompute = recompute_layers(analysis, strategy.recompute, notes)
    notes += analysis.notes + result.notes
    return Plan(
        model=ModelInfo(
            class_name=analysis.class_name,
            num_parameters=sum(math.prod(shape) for shape, _ in analysis.params.values()),
            param_fingerprint=analysis.param_fingerprint,
            graph_fingerprint=analysis.graph_fingerprint,
            traced_layer=analysis.traced_layer,
            input_specs=[InputSpec(name=s.name, dtype=s.dtype, shape=list(s.shape)) for s in analysis.input_specs],
        ),
        cluster=Cluster(nodes=request.nodes, devices_per_node=request.devices_per_node, device=request.device),
        mesh=mesh,
        strategy=strategy,
        params=params,
        blocks=[
            Block(layer=b.layer, kind=b.kind, stage=stage, **_experts(b)) for b, stage in zip(analysis.blocks, stages)
        ],
        hooks=hooks,
        local_view=local_view,
        vocab_lookup=vocab_lookup,
        recompute=recompute,
        data=DataPlan(
            shard_axes=["dp"] if strategy.dp > 1 else [],
            input_stage=0,
            label_stage=strategy.pp - 1,
            global_batch_size=result.setup.global_batch if result.setup else 0,
        ),
        implicit_comm=list(result.implicit_comm),
        kernels=result.kernels,
        estimate=result.best.estimate,
        alternatives=Alternatives(accepted=list(result.accepted), rejected=list(result.rejected)),
        notes=_unique(notes),
        provenance=Provenance(
            autodist_version=metadata.version("paddle-autodist"),
            paddle_version=paddle.__version__,
            arguments=dict(sorted(arguments.items())),
        ),
    )


def unmatched(analysis: ModelAnalysis, local_view: list[LocalView]) -> list[str]:
    """The layers no pattern matched whose own parameters stay replicated: ``analysis.unmatched``
    but those whose every own parameter a local view places (Swin's attention holding its
    relative-position-bias table, split by heads with it), and those whose parameters no traced
    op reads (:func:`read_outside_trace`, which says why in its own words)."""
    viewed = {w.param for view in local_view for w in view.weights}
    outside = read_outside_trace(analysis)
    return [
        layer
        for layer in analysis.unmatched
        if layer not in outside and not all(fqn in viewed for fqn in _own_params(analysis, layer))
    ]


def read_outside_trace(analysis: ModelAnalysis) -> dict[str, list[str]]:
    """The unmatched layers none of whose own parameters a traced op reads -> those parameters'
    names: the code between the traced blocks reads them (a model traced block by block: HF DBRX's
    ``DbrxExperts.forward`` views its batched expert weights ``w1``, ``v1``, ``w2`` per expert
    and hands each slice to ``DbrxExpertGLU``, whose traced forward reads the slices, not its own
    parameters), and runs as written, on the whole parameters every rank holds."""
    graph = analysis.graph
    read = {
        fqn
        for node, data in graph.nodes(data=True)
        if data.get("param") and graph.out_degree(node)
        for fqn in (data["param"], *analysis.tied.get(data["param"], ()))
    }
    outside = {}
    for layer in analysis.unmatched:
        own = _own_params(analysis, layer)
        if own and not any(fqn in read for fqn in own):
            outside[layer] = [fqn.rpartition(".")[2] for fqn in own]
    return outside


def _own_params(analysis: ModelAnalysis, layer: str) -> list[str]:
    return [fqn for fqn in analysis.params if fqn.rpartition(".")[0] == layer]


def outside_trace_note(layer: str, names: list[str]) -> str:
    """The note (and, with the code that reads them, the command's warning) on a layer whose
    parameters no traced op reads.

    >>> outside_trace_note("ffn.experts.mlp", ["w1", "w2"]).partition(": the code")[0]
    'layer ffn.experts.mlp: no traced op reads its parameters (w1, w2)'
    """
    return (
        f"layer {layer}: no traced op reads its parameters ({', '.join(names)}): the code between the traced "
        "layers does, as written, so they stay replicated"
    )


def unmatched_note(layer: str) -> str:
    """The note (and the command's warning) on a layer no pattern matched ('' the top level's own
    parameters: timm's ``cls_token``).

    >>> unmatched_note("")
    "the model's top level: no pattern matched it; its parameters stay replicated"
    """
    where = f"layer {layer}" if layer else "the model's top level"
    return f"{where}: no pattern matched it; its parameters stay replicated"


def recompute_layers(analysis: ModelAnalysis, mode: str, notes: list[str]) -> list[str]:
    """The layers apply_plan recomputes: every block (``full``), or the sub-layer holding each
    block's attention projections (``selective``, :func:`attention_layer`; a block that computes
    attention inline has none, and a note says so)."""
    if mode == "full":
        return [block.layer for block in analysis.blocks]
    if mode != "selective":
        return []
    layers = []
    for block in analysis.blocks:
        attention = attention_layer(block)
        if attention is not None:
            layers.append(attention)
        else:
            notes.append(
                f"recompute selective: {block.layer} has no attention sub-layer to recompute; it is not recomputed"
            )
    return layers


def build_mesh(strategy: Strategy) -> Mesh:
    """Mesh axes ``pp, dp, mp`` with size > 1 (``["dp"]`` of ``[1]`` for one device).

    >>> build_mesh(Strategy(dp=2, mp=2)).axes
    ['dp', 'mp']
    """
    dims = [(name, getattr(strategy, name)) for name in MESH_AXES if getattr(strategy, name) > 1] or [("dp", 1)]
    world = math.prod(size for _, size in dims)
    return Mesh(axes=[n for n, _ in dims], shape=[s for _, s in dims], process_ids=list(range(world)))


# -- parameters ----------------------------------------------------------------------------------------


def _placed_as_viewed(
    params: dict[str, ParamPlan], local_view: list[LocalView], axes: Sequence[str], notes: list[str]
) -> dict[str, ParamPlan]:
    """``params`` with each local-view weight placed on mp as its view computes with it
    (:func:`~autodist.schemas.local_view.mp_placement`). Two differ from the analysis's
    placements: a weight whose segments some rank computes with whole (``LocalWeight.replicated``:
    a multi-query ``q|k|v``'s K and V) is replicated over mp, in the model's own layout, each rank
    taking its columns for the call (applier/modes/local_calls.py; the estimate prices it so, the
    cost model reads the same rule, :func:`~autodist.planner.recognise.reshards.multi_query_weights`);
    a per-head parameter the proof split by heads (Swin's relative-position-bias table, GPT-OSS's
    sinks: no projection's, so the analysis left it whole) is split over mp along its heads.
    One note each says so."""
    mp = axes.index("mp") if "mp" in axes else None
    held: list[str] = []
    per_head: list[str] = []
    for weight in (w for view in local_view for w in view.weights):
        planned, want = params[weight.param], mp_placement(weight)
        if mp is None or planned.placements[mp] == want:
            continue
        (held if want == "R" else per_head).append(weight.param)
        placements = [want if axis == "mp" else p for axis, p in zip(axes, planned.placements)]
        style = "Replicate" if want == "R" else "ColWiseParallel"  # a per-head table's output: its heads
        params[weight.param] = msgspec.structs.replace(planned, placements=placements, style=style)
    if held:
        notes.append(
            f"local view: {len(held)} fused weight(s) with K and V computed whole ({held[0]} first) are held whole "
            "on every mp rank (Megatron's multi-query layout: each rank's query heads against the whole K and V), "
            "priced so: their whole parameter, gradient and optimizer memory on each mp rank, and an all-reduce "
            "over mp of their whole gradient in each micro-batch's backward"
        )
    if per_head:
        notes.append(
            f"local view: {len(per_head)} per-head parameter(s) ({per_head[0]} first) split over mp by heads, "
            "each rank holding its heads' entries (proven with the sub-layer); priced whole on every rank"
        )
    return params


def _param_plans(analysis: ModelAnalysis, strategy: Strategy, axes: Sequence[str], notes: list[str]) -> dict:
    mp_placements = _mp_placements(analysis, strategy.mp, notes)
    stage_of = _param_stages(analysis, strategy.pp, strategy.virtual_stages)
    both_sides = params_read_on_both_sides(analysis) if strategy.pp > 1 else frozenset()
    moe_layers = _moe_layers(analysis, strategy)
    plans = {}
    for fqn in sorted(analysis.params):
        shape, dtype = analysis.params[fqn]
        mp_placement, style = _expert_style(fqn, moe_layers) or mp_placements.get(fqn, ("R", "Replicate"))
        plans[fqn] = ParamPlan(
            shape=list(shape),
            dtype=as_dtype(dtype),
            placements=[mp_placement if axis == "mp" else "R" for axis in axes],
            stage=stage_of[fqn],
            style=style,
            tied_to=sorted(analysis.tied.get(fqn, [])),
            tied_stages=_tied_stages(analysis, fqn, strategy.pp)
            | ({fqn: strategy.pp - 1} if fqn in both_sides else {}),
        )
    return plans


def _mp_placements(analysis: ModelAnalysis, mp: int, notes: list[str]) -> dict[str, tuple[str, ParallelStyle]]:
    """``{param FQN: (placement on mp, style)}`` for the tensor-parallel parameters."""
    if mp == 1:
        return {}
    placements: dict[str, tuple[str, ParallelStyle]] = {}
    for block in analysis.blocks:
        for linear in block.linears:
            placements.update(_linear_placements(linear, analysis.params, mp, notes))
    split = _vocab_splits(analysis, mp, notes)
    if analysis.embedding in split:
        placements[analysis.embedding] = (f"S({split[analysis.embedding]})", "VocabParallelEmbedding")
    head = analysis.lm_head
    if head is not None and head.weight in split and head.weight not in placements:
        head_placements = _linear_placements(head, analysis.params, mp, notes)
        placements.update({fqn: (p, "ColWiseParallelHead") for fqn, (p, _) in head_placements.items()})
    return placements


def _vocab_splits(analysis: ModelAnalysis, mp: int, notes: list[str]) -> dict[str, int]:
    """The vocabulary-parallel weights, ``{FQN: the dim split over mp}``: the token embedding's
    table on its vocabulary dim (``analysis.vocab_dim``), the LM head's weight on its output
    features; one weight when they are tied (by name, or by a function call reading the other
    layer's weight), whose uses must agree on the dim. Each is checked against Paddle's SPMD
    rules (:func:`.reshards.vocab_parallel_problems`): a weight one of its readers would gather,
    or not split over the vocabulary, stays replicated, and a note says why."""
    wanted: dict[str, int] = {}
    if analysis.embedding is not None:
        wanted[analysis.embedding] = analysis.vocab_dim
    head = analysis.lm_head
    head_dim = head.split_dim if head is not None and head.role == "column" else None  # its vocabulary dim
    if head is not None and head_dim is not None:
        if wanted.get(head.weight, head_dim) != head_dim:
            notes.append(
                f"{head.weight}: the token lookup reads its vocabulary on dim {wanted[head.weight]}, the LM head on "
                f"dim {head_dim}; no one split serves both, replicated"
            )
            del wanted[head.weight]
        else:  # a weight tied to the table is there already, on this dim
            wanted[head.weight] = head_dim
    if analysis.vocab_size is None or analysis.vocab_size % mp:
        if analysis.embedding is not None:
            notes.append(
                f"embedding {analysis.embedding}: vocabulary {analysis.vocab_size} does not divide by mp={mp}; replicated"
            )
        if head is not None and head_dim is not None:
            notes.append(
                f"LM head {head.weight}: vocabulary {analysis.vocab_size} does not divide by mp={mp}; replicated"
            )
        return {}
    for fqn, problems in vocab_parallel_problems(analysis, wanted, mp).items():
        if problems:
            notes.append(
                f"{fqn}: split on dim {wanted.pop(fqn)} over mp it is not vocabulary-parallel under Paddle's "
                f"SPMD rules ({'; '.join(problems)}); replicated"
            )
    return wanted


def _vocab_lookups(
    analysis: ModelAnalysis, strategy: Strategy, params: dict[str, ParamPlan], notes: list[str]
) -> list[VocabLookup]:
    """The token lookup run on local tensors, Megatron's way, when its table is split over the
    vocabulary (``S(0)`` on mp): where its layer can (:func:`.analysis.local_lookup`) and the
    strategy runs local tensors (:func:`~autodist.schemas.parallel_dims.runs_local_views`, the cost
    model's rule too). Elsewhere Paddle's rule gathers the whole table at every lookup, and a
    note says why it stays so."""
    table = analysis.embedding
    if table is None or params[table].style != "VocabParallelEmbedding":
        return []
    refused = local_views_refused(strategy)
    why = analysis.local_lookup_refusal or (f"it does not run on local tensors with {refused}" if refused else "")
    if analysis.local_lookup is None or why:
        notes.append(
            f"embedding {table}: split over the vocabulary, looked up in the global view, which all-gathers "
            f"the whole table in every forward and backward ({why})"
        )
        return []
    return [VocabLookup(layer=analysis.local_lookup, weight=table)]


def _linear_placements(
    linear: LinearUse, params: dict, mp: int, notes: list[str]
) -> dict[str, tuple[str, ParallelStyle]]:
    if linear.role == "replicate" or linear.split_dim is None:
        return {}
    shape = params[linear.weight][0]
    if shape[linear.split_dim] % mp:
        notes.append(
            f"{linear.weight}: dim {linear.split_dim} of size {shape[linear.split_dim]} does not divide by mp={mp}; replicated"
        )
        return {}
    style: ParallelStyle = "ColWiseParallel" if linear.role == "column" else "RowWiseParallel"
    placed = {linear.weight: (f"S({linear.split_dim})", style)}
    if linear.bias is not None:
        # A column split also splits the bias (one entry per output feature); a row-parallel
        # output is a partial sum, to which the whole bias is added once.
        placed[linear.bias] = ("S(0)" if linear.role == "column" else "R", style)
    return placed


def _param_stages(analysis: ModelAnalysis, pp: int, virtual_stages: int) -> dict[str, int]:
    """Stage per parameter: a block's on its block's stage; outside the blocks, stage 0 before
    them and the last stage after them (:func:`.analysis.params_before_blocks`, the cost model's rule too)."""
    if pp == 1:
        return {fqn: 0 for fqn in analysis.params}
    block_prefixes = [
        (b.layer + ".", stage)
        for b, stage in zip(analysis.blocks, block_stages(len(analysis.blocks), pp, virtual_stages))
    ]
    before = params_before_blocks(analysis)
    stages = {}
    for fqn in analysis.params:
        owner = next((stage for prefix, stage in block_prefixes if fqn.startswith(prefix)), None)
        stages[fqn] = owner if owner is not None else 0 if fqn in before else pp - 1
    return stages


def _tied_stages(analysis: ModelAnalysis, fqn: str, pp: int) -> dict[str, int]:
    """An embedding table that other names share (an LM head's tied weight): with pp > 1 the
    embedding runs on stage 0 and the head after the last block, so each head name gets its
    own copy on the last stage (the applier sums the copies' gradients, Megatron-LM style)."""
    if pp == 1 or fqn != analysis.embedding:
        return {}
    return {alias: pp - 1 for alias in sorted(analysis.tied.get(fqn, []))}


def _tied_across_stages(analysis: ModelAnalysis, pp: int) -> list[str]:
    """Say so in the notes when a table is tied across stages: by name (the embedding's table
    shared with the head's ``Parameter``) or by function call (read before and after the blocks)."""
    if pp == 1:
        return []
    embedding = analysis.embedding
    aliases = _tied_stages(analysis, embedding, pp) if embedding else {}
    notes = [
        f"{embedding} (stage 0) is tied to {', '.join(aliases)} on stage {pp - 1}: that stage holds a copy, and "
        "the schedule sums the two gradients before each optimizer step"
    ] * bool(aliases)
    for fqn in sorted(params_read_on_both_sides(analysis)):
        layers = sorted({fqn.rpartition(".")[0], *analysis.read_by.get(fqn, [])})
        readers = " and ".join(layer or "the model's own forward" for layer in layers)
        notes.append(
            f"{fqn} is read before the blocks and after them (by {readers}): a weight tied by function call; "
            f"stage 0 holds it, stage {pp - 1} a copy, and the schedule sums the two gradients before each "
            "optimizer step"
        )
    return notes


# -- hooks ------------------------------------------------------------------------------------------------


def _stage_handoffs(analysis: ModelAnalysis, stages: list[int]) -> list[Hook]:
    return [
        StageHandoff(
            layer=block.layer,
            when="post",
            to_stage=stages[i + 1],
            reason=f"last block of a chunk on stage {stage}: its output moves to stage {stages[i + 1]}",
        )
        for i, (block, stage) in enumerate(zip(analysis.blocks, stages))
        if i + 1 < len(stages) and stages[i + 1] != stage
    ]


def _moe_layers(analysis: ModelAnalysis, strategy: Strategy) -> dict[str, str]:
    """``{MoE layer: its experts container}`` when they run locally (:func:`runs_moe_locally`).
    The MoE layer is the container's parent (``layers.0.block_sparse_moe`` for
    ``layers.0.block_sparse_moe.experts``): the layer that routes the tokens to the experts."""
    if not runs_moe_locally(strategy, bool(analysis.moe_local_only)):
        return {}
    return {b.experts.moe_layer: b.experts.layer for b in analysis.blocks if b.experts}


def _expert_style(fqn: str, moe_layers: dict[str, str]) -> tuple[str, ParallelStyle] | None:
    """``(placement, style)`` of a parameter under an MoE layer (it runs whole on each rank's
    gathered tokens: ``R``; an expert's is ``ExpertParallel``), None for any other."""
    for layer, experts in moe_layers.items():
        if fqn.startswith(layer + "."):
            return "R", "ExpertParallel" if fqn.startswith(experts + ".") else "Replicate"
    return None


def _expert_hooks(analysis: ModelAnalysis, strategy: Strategy) -> list[Hook]:
    """The ``expert_dispatch`` / ``expert_combine`` pair around each MoE layer (block order)."""
    ep, hooks, local_only = strategy.ep, list[Hook](), analysis.moe_local_only
    if not runs_moe_locally(strategy, bool(local_only)):
        return []
    if strategy.dp > 1:
        local = (
            "dp: the layer runs on this rank's own tokens as plain tensors, its gradients summed over dp "
            "before the update (docs/paddle-notes.md, SPMD rules)",
            "dp: its output back as this rank's rows of the batch",
        )
    else:
        local = (
            f"an MoE layer holds an op Paddle 3.3 runs on plain tensors only ({local_only}): every MoE layer "
            "runs whole on every rank as plain tensors (docs/paddle-notes.md)",
            "its output back as the distributed tensor its input was",
        )
    for block in analysis.blocks:
        experts = block.experts
        if not experts:
            continue
        layer = experts.moe_layer
        if ep == 1:
            dispatch, combine = local
        else:
            dispatch = (
                f"ep={ep}: gather the tokens of this rank's ep group ({ep} dp ranks); the layer routes them "
                f"all with its own code and runs this rank's {experts.count // ep} of the {experts.count} experts"
                + ("; the group's first rank alone runs its shared experts" if experts.shared else "")
            )
            combine = (
                f"ep={ep}: sum the {ep} ranks' partial outputs (each its experts' share) and keep this rank's tokens"
            )
        hooks += [
            ExpertDispatch(
                layer=layer, when="pre", experts=experts.layer, shared=list(experts.shared), reason=dispatch
            ),
            ExpertCombine(layer=layer, when="post", reason=combine),
        ]
    return hooks


def _sequence_parallel_hooks(
    analysis: ModelAnalysis, strategy: Strategy, axes: Sequence[str], fused_gathers: list[Hook], notes: list[str]
) -> list[Hook]:
    """The sequence-parallel hooks, plus ``fused_gathers`` (the analysis's reshard hooks) adjusted
    to the [s, b, h] layout inside position-wise sub-layers."""
    if not strategy.sequence_parallel:
        return fused_gathers
    end_layer = (
        _layer_of(analysis.final_norm[0])
        if analysis.final_norm
        else (_layer_of(analysis.lm_head.weight) if analysis.lm_head else None)
    )
    embedding_layer = analysis.embedding_layer
    if not analysis.blocks or embedding_layer is None or end_layer is None:
        notes.append(
            "sequence parallel asked for, but the model has no embedding / blocks / final norm to "
            "anchor it: no sequence-parallel hooks"
        )
        return fused_gathers

    # Between the hooks activations are [s, b, h]: the batch (dim 1) over dp, the sequence over mp.
    def placements(mp_placement: str) -> list[str]:
        return [{"dp": "S(1)", "mp": mp_placement}.get(axis, "R") for axis in axes]

    combined = _embedding_combined(analysis, embedding_layer)
    hooks: list[Hook] = [
        SequenceParallelBegin(
            layer=_first_block(analysis),
            when="pre",
            reason=f"the embedding's output is added to {combined} before the first block: split the sequence there",
        )
        if combined
        else SequenceParallelBegin(
            layer=embedding_layer, when="post", reason="activations leave the embedding split over the sequence"
        )
    ]
    position_wise: list[str] = []
    for block in analysis.blocks:
        for layer in _tensor_parallel_sublayers(block):
            if _mixes_positions(analysis, block, layer):
                hooks += [
                    SequenceParallelEnd(
                        layer=layer, when="pre", reason="attention needs the whole sequence in [b, s, h]"
                    ),
                    SequenceParallelBegin(
                        layer=layer,
                        when="post",
                        reason="back to the sequence split: the partial sum becomes a reduce-scatter",
                    ),
                ]
            else:
                position_wise.append(layer + ".")
                hooks += [
                    Reshard(
                        layer=layer,
                        when="pre",
                        placements=placements("R"),
                        reason="position-wise: gather the sequence for the column-parallel input",
                    ),
                    Reshard(
                        layer=layer,
                        when="post",
                        placements=placements("S(0)"),
                        reason="back to the sequence split: the partial sum becomes a reduce-scatter",
                    ),
                ]
    hooks.append(
        SequenceParallelEnd(layer=end_layer, when="post", reason="the head and loss see whole sequences in [b, s, h]")
    )
    # A fused gate|up gather inside the MLP sees [s, b, h]: its batch dim is 1, not 0.
    inside = tuple(position_wise)
    return hooks + [
        msgspec.structs.replace(hook, placements=placements("R")) if hook.layer.startswith(inside) else hook
        for hook in fused_gathers
    ]


def _tensor_parallel_sublayers(block) -> list[str]:
    """The sub-layers of a block that own its split linears (``self_attn``, ``mlp``), in order."""
    parents = []
    for linear in block.linears:
        parent = _layer_of(linear.layer)
        if linear.role != "replicate" and parent not in parents:
            parents.append(parent)
    return parents


def _first_block(analysis: ModelAnalysis) -> str:
    """The block the forward runs first: the one holding the earliest op of the program."""
    return min(analysis.blocks, key=lambda b: min(b.nodes, default=len(analysis.graph))).layer


def _embedding_combined(analysis: ModelAnalysis, embedding: str) -> str:
    """What the token embedding's output is combined with on its way to the first block, by
    dataflow: a layer's output (a position embedding, ``wpe``) or a tensor of more than one
    element that does not come from the embedding (a learned position table), named; '' when
    only the embedding's own values (scaled, dropped out, cast) reach the block. Split over the
    sequence after the embedding, such a sum would meet the other operand whole.

    >>> import networkx as nx
    >>> from types import SimpleNamespace
    >>> g = nx.MultiDiGraph()
    >>> g.add_node(0, layer="wte", op="pd_op.embedding", shapes=[[2, 8, 4]], param=None)
    >>> g.add_node(1, layer="wpe", op="pd_op.embedding", shapes=[[1, 8, 4]], param=None)
    >>> g.add_node(2, layer="", op="pd_op.add", shapes=[[2, 8, 4]], param=None)
    >>> g.add_node(3, layer="h.0.ln_1", op="pd_op.layer_norm", shapes=[[2, 8, 4]], param=None)
    >>> _ = g.add_edges_from([(0, 2), (1, 2), (2, 3)])
    >>> analysis = SimpleNamespace(graph=g, blocks=[SimpleNamespace(layer="h.0", nodes=frozenset({3}))])
    >>> _embedding_combined(analysis, "wte")
    'wpe'
    >>> g.remove_edge(1, 2); _embedding_combined(analysis, "wte")
    ''
    """
    graph, block = analysis.graph, _first_block(analysis)

    def inside(node: int, layer: str = embedding) -> bool:
        return graph.nodes[node]["layer"] == layer or graph.nodes[node]["layer"].startswith(layer + ".")

    first = {n for n in graph.nodes if inside(n, block)}

    # the nodes outside the blocks that carry the lookup's values (not its table, which a tied
    # head reads; not its shape, which a mask or position ids are made from) to the first block
    entries = {n for n in first if any(p not in first for p in graph.predecessors(n))}
    toward = set().union(*(nx.ancestors(graph, n) for n in entries))
    frontier = [n for n in graph.nodes if inside(n) and graph.nodes[n]["param"] is None]
    reached = set(frontier)
    while frontier:
        node = frontier.pop()
        for succ in graph.successors(node):
            if (
                succ not in reached
                and succ not in first
                and succ in toward
                and short_op(graph.nodes[succ]["op"]) not in SHAPE_ONLY_OPS
            ):
                reached.add(succ)
                frontier.append(succ)
    for node in sorted(reached):
        if inside(node):
            continue
        for source in sorted(set(graph.predecessors(node)) - reached):
            data = graph.nodes[source]
            shapes = [s for s in data.get("shapes") or [] if s is not None]
            if shapes and math.prod(max(d, 1) for d in shapes[0]) > 1:
                return data["layer"] or data.get("param") or short_op(data["op"])
    return ""


def _mixes_positions(analysis: ModelAnalysis, block, layer: str) -> bool:
    prefix = layer + "."
    return any(
        analysis.graph.nodes[n]["op"] in SEQUENCE_MIXING_OPS
        and (analysis.graph.nodes[n]["layer"] == layer or analysis.graph.nodes[n]["layer"].startswith(prefix))
        for n in block.nodes
    )


def _layer_of(fqn: str) -> str:
    """``"layers.0.mlp.up_proj.weight"`` -> ``"layers.0.mlp.up_proj"``."""
    return fqn.rpartition(".")[0]


def _unique(items: list[str]) -> list[str]:
    return list(dict.fromkeys(items))


def _experts(block) -> dict:
    """A plan block's ``experts``, ``num_experts`` and ``top_k`` (none without experts)."""
    experts = block.experts
    return dict(experts=experts.layer, num_experts=experts.count, top_k=experts.top_k) if experts else {}
