"""The plan format, schema v2: the types *are* the schema.

A plan is plain data. Every Struct here forbids unknown fields, so a typo in a hand-edited
plan is an error rather than a silently ignored key; constraints that a single field can
express (a placement string, a positive degree) live in the type annotations, and
``msgspec`` enforces them on decode. The few rules that tie several fields together are in
:mod:`autodist.schemas.checks`.

Example::

    >>> from autodist.schemas import Plan, load_plan
    >>> plan = load_plan("plans/gpt/plan_2x8dev_mp4.json")
    >>> plan.mesh.axes, plan.params["blocks.0.attn.qkv_proj.weight"].placements
    (['dp', 'mp'], ['R', 'S(1)'])
"""

from __future__ import annotations

import typing
from typing import Annotated, Final, Literal

import msgspec

from autodist.schemas.vocabulary import DTYPE_BYTES, PLACEMENT_PATTERN, DType, MeshAxis, TrainingDType  # noqa: F401 (re-exported)

FORMAT: Final = "autodist.plan"
#: Version 2: hooks are a tagged union (no ``placements`` on a stage hand-off, no ``to_stage`` on a
#: reshard). ``load_plan`` still reads version 1 files (:func:`autodist.schemas.io.upgrade`).
VERSION = 2

# -- small annotated types -------------------------------------------------------------------


def _whole(pattern: str) -> msgspec.Meta:
    """A string constraint matching all of the string. (In Python's ``re``, ``$`` also matches
    before a trailing newline, so ``"R\\n"`` would pass ``^R$``; the lookahead refuses it. The
    pattern reads the same in JSON Schema's regex dialect.)"""
    return msgspec.Meta(pattern=rf"^(?:{pattern})$(?!\n)")


_IDENTIFIER = r"[A-Za-z_][A-Za-z0-9_]*"
_SEGMENT = rf"(?:{_IDENTIFIER}|[0-9]+)"

#: A placement on one mesh axis: ``"R"`` replicate, ``"P"`` partial (pending sum), ``"S(k)"``
#: shard tensor dim ``k``. Short strings keep plans readable and diffs small.
Placement = Annotated[str, _whole(PLACEMENT_PATTERN)]
#: The largest integer a plan or checkpoint may hold: exact in every JSON reader (a double's
#: 53 bits), far above any count or size (a 401-digit integer crashed ``show``, ``diff`` and ``render``).
MAX_INT = 2**53
PositiveInt = Annotated[int, msgspec.Meta(ge=1, le=MAX_INT)]
NonNegativeInt = Annotated[int, msgspec.Meta(ge=0, le=MAX_INT)]
#: A traced dim: a size, or ``-1`` for a dynamic one.
Dim = Annotated[int, msgspec.Meta(ge=-1, le=MAX_INT)]
NonNegativeFloat = Annotated[float, msgspec.Meta(ge=0)]
#: A parameter or layer FQN: ASCII identifiers and indices joined by dots
#: (``layers.0.mlp.up_proj.weight``). Plans are untrusted input: a name with quotes, spaces,
#: control characters or regex syntax is refused, so names are safe to print and to write into
#: generated code and markup (which still write them as escaped literals).
Fqn = Annotated[str, _whole(rf"{_SEGMENT}(?:\.{_SEGMENT})*")]
#: An FQN, or ``""`` for the model itself.
LayerFqn = Annotated[str, _whole(rf"(?:{_SEGMENT}(?:\.{_SEGMENT})*)?")]
#: A Python identifier in ASCII: class names, input names.
Identifier = Annotated[str, _whole(_IDENTIFIER)]
#: A keyword argument's name, or ``""`` for a positional one.
KeywordName = Annotated[str, _whole(rf"(?:{_IDENTIFIER})?")]
#: An attribute of a layer, or of an object it holds, one level down: ``num_heads``, ``config.num_attention_heads``.
AttributePath = Annotated[str, _whole(rf"{_IDENTIFIER}(?:\.{_IDENTIFIER})?")]
#: Free text (reasons, notes, versions): anything but control characters (C0, DEL, C1).
Text = Annotated[str, _whole(r"[^\x00-\x1f\x7f-\x9f]*")]
Sha256 = Annotated[str, _whole(r"[0-9a-f]{64}")]
#: What each constrained string means, by its regex, for error messages (msgspec names the regex).
PATTERN_MEANINGS = {
    typing.get_args(tp)[1].pattern: meaning
    for tp, meaning in [
        (Placement, "a placement: R, P or S(<dim>)"),
        (Fqn, "a name: ASCII identifiers and indices joined by dots, e.g. layers.0.mlp.weight"),
        (LayerFqn, 'a layer name (ASCII identifiers and indices joined by dots) or "" for the model'),
        (Identifier, "an ASCII identifier"),
        (KeywordName, 'an ASCII identifier or "" (a positional argument)'),
        (AttributePath, "an attribute: an ASCII identifier, or two joined by a dot (config.num_heads)"),
        (Text, "text without control characters"),
        (Sha256, "64 lowercase hex digits"),
    ]
}

#: Where a parameter's placements came from. The names follow Paddle's intermediate API
#: (``paddle.distributed.ColWiseParallel`` ...), plus the two kinds that have no style there.
#: The collectives a backend may lack, by name (a device profile's ``unsupported``; what each is in
#: words, and which strategies need it: schemas/parallel_dims.py).
BackendOperation = Literal["reduce_scatter", "all_to_all", "cross_mesh_reshard", "batched_p2p"]

ParallelStyle = Literal[
    "Replicate",  # untouched by tensor parallelism (norms, unmatched layers, dp-only plans)
    "ColWiseParallel",  # output features split over mp
    "RowWiseParallel",  # input features split over mp; output partial, summed by Paddle
    "VocabParallelEmbedding",  # embedding table split over the vocabulary
    "ColWiseParallelHead",  # LM head split over the vocabulary (its output stays sharded)
    "ExpertParallel",  # an expert held whole by the ranks its ep group gives it (strategy.ep)
]


class Base(msgspec.Struct, forbid_unknown_fields=True):
    """Common base: unknown fields are rejected."""


# -- model -------------------------------------------------------------------------------------


class InputSpec(Base):
    """One model input as the planner traced it; ``-1`` marks a dynamic dim."""

    name: Identifier
    dtype: DType
    shape: list[Dim]


class ModelInfo(Base):
    """What the plan was made for; the applier refuses a model whose fingerprint differs."""

    class_name: Identifier
    num_parameters: NonNegativeInt
    #: sha256 over sorted (parameter FQN, shape, dtype): the applier recomputes it cheaply.
    param_fingerprint: Sha256
    #: sha256 over the traced graph's structure (op names and edges): `check` re-traces for it.
    graph_fingerprint: Sha256
    #: FQN of the sub-layer that was traced ("" for the whole model); see the planner docs.
    traced_layer: LayerFqn = ""
    input_specs: list[InputSpec] = []


# -- cluster and mesh ----------------------------------------------------------------------------


class DeviceProfile(Base):
    """One device kind's published figures; bandwidths are per direction, bytes/s."""

    name: Text
    memory_bytes: PositiveInt
    peak_flops: dict[TrainingDType, NonNegativeFloat]
    intra_node_bandwidth: NonNegativeFloat
    inter_node_bandwidth: NonNegativeFloat
    intra_node_latency_s: NonNegativeFloat
    inter_node_latency_s: NonNegativeFloat
    #: How much the latency of one ring step grows per rank of the group beyond two, seconds: a
    #: collective step over p ranks takes ``latency + (p - 2) x this`` (0 on the named GPUs; gloo
    #: on a shared CPU measured 4x the 2-rank latency per step over 4 ranks). ``calibrate`` fits it.
    intra_node_latency_per_rank_s: NonNegativeFloat = 0.0
    inter_node_latency_per_rank_s: NonNegativeFloat = 0.0
    #: What this device's collective backend cannot do (gloo on Paddle 3.3.1's CPU wheel lacks
    #: all four: schemas/parallel_dims.py); the search rejects strategies that need them, with the reason.
    unsupported: list[BackendOperation] = []
    #: Device memory bandwidth, bytes/s (0: unknown; memory-bound ops are then not priced).
    memory_bandwidth: NonNegativeFloat = 0.0
    #: Fraction of peak FLOP/s large matmuls sustain, and a fixed cost of every op in seconds
    #: (kernel launch, framework dispatch; the planner's roofline, ``autodist.planner.cost.compute``).
    matmul_efficiency: NonNegativeFloat = 0.5
    op_overhead_s: NonNegativeFloat = 0.0
    #: Framework time per op, in seconds, that a real training step shows beyond what the op-level
    #: timings price (eager / auto-parallel dispatch, and waiting for a core when ranks share
    #: them); fitted by ``autodist-plan calibrate --model`` on the plan's steps; 0 for the named
    #: GPU profiles. It prices every kind of strategy without a figure of its own below.
    dispatch_overhead_s: NonNegativeFloat = 0.0
    #: The same per kind of strategy, each fitted on a strategy of that kind (calibrate times
    #: the plan's siblings too: on gloo sharing 2 cores dp2 x mp2 left 2-3x the time per op of
    #: dp4 and of mp4); None: ``dispatch_overhead_s`` (the cost model's ``compute.as_run``).
    #: Without tensor parallelism (mp = 1: data, pipeline, expert parallelism):
    data_parallel_dispatch_overhead_s: NonNegativeFloat | None = None
    #: With tensor parallelism alone (dp = 1, mp > 1):
    tensor_parallel_dispatch_overhead_s: NonNegativeFloat | None = None
    #: With both (dp > 1, mp > 1):
    hybrid_dispatch_overhead_s: NonNegativeFloat | None = None
    #: Whether collectives run beside compute (NCCL on its own stream); gloo on CPU blocks the
    #: thread that computes, so nothing overlaps.
    comm_overlap: bool = True
    #: Fraction of compute speed lost while a collective runs beside it (0 to 1): NCCL's kernels
    #: hold SMs (one CTA per channel) and memory bandwidth, so communication hidden under compute
    #: still slows it (``step_time.overlapped``). The named GPU profiles: NCCL's channels over
    #: the GPU's SMs (planner/cost/hardware.py); 1 where nothing overlaps (``comm_overlap``
    #: false means 1 whatever this says); 0 by default, communication hidden for free.
    overlap_compute_loss: Annotated[float, msgspec.Meta(ge=0, le=1)] = 0.0
    #: Whether the device runs the fused kernels a model selects (flash attention for
    #: ``F.scaled_dot_product_attention``, fused RMSNorm): the GPUs; a CPU runs what the planner
    #: traced (matmul / softmax / matmul).
    fused_kernels: bool = True


class Cluster(Base):
    nodes: PositiveInt
    devices_per_node: PositiveInt
    device: DeviceProfile


class Mesh(Base):
    """The process mesh: ``process_ids`` in row-major order over ``shape``.

    The outermost axis is ``pp``, the innermost ``mp`` (kept inside a node). Axes of size one
    are left out, except that a mesh always has at least one axis.
    """

    axes: list[MeshAxis]
    shape: list[PositiveInt]
    process_ids: list[NonNegativeInt]


#: ZeRO stage over the dp group: 0 none, 1 optimizer states, 2 + gradients, 3 + parameters.
ShardingStage = Literal[0, 1, 2, 3]
#: How pipeline stages run (:attr:`Strategy.schedule`).
Schedule = Literal["none", "sequential", "1F1B", "VPP"]
#: Activation recompute (:attr:`Strategy.recompute`).
Recompute = Literal["none", "selective", "full"]


class Strategy(Base):
    dp: PositiveInt = 1
    mp: PositiveInt = 1
    pp: PositiveInt = 1
    sequence_parallel: bool = False
    #: ZeRO stage over the dp group: 0 none, 1 optimizer states, 2 + gradients, 3 + parameters.
    sharding_stage: ShardingStage = 0
    micro_batches: PositiveInt = 1
    #: How pipeline stages run: ``none`` without pp; ``sequential`` stage hand-off hooks in an
    #: ordinary training loop; ``1F1B`` / ``VPP`` Paddle's pipelining schedules.
    schedule: Schedule = "none"
    #: Activation recompute: ``full`` recomputes every block in backward, ``selective`` each
    #: block's attention sub-layer; the plan's ``recompute`` lists the layers.
    recompute: Recompute = "none"

    #: Model chunks each pipeline rank runs: 1, or more for ``VPP`` (the blocks' stages then
    #: cycle ``0, 1, ..., pp-1`` that many times).
    virtual_stages: PositiveInt = 1
    #: Expert parallelism: each MoE layer's experts (the blocks' ``experts``) spread over groups
    #: of ``ep`` neighbouring data-parallel ranks, each rank holding ``1/ep`` of them. The MoE
    #: layer runs on its group's tokens, gathered by its ``expert_dispatch`` hook; its
    #: ``expert_combine`` hook sums the group's partial outputs and keeps this rank's tokens.
    #: 1: every rank holds every expert. Divides ``dp``.
    ep: PositiveInt = 1


# -- what to do with the model ---------------------------------------------------------------------


class ParamPlan(Base):
    """How one parameter is laid out: its stage and one placement per mesh axis."""

    shape: list[NonNegativeInt]
    dtype: DType
    placements: list[Placement]
    stage: NonNegativeInt = 0
    style: ParallelStyle = "Replicate"
    #: Other FQNs that name the same Parameter object (tied weights): sharded once, kept one.
    tied_to: list[Fqn] = []
    #: Names in ``tied_to`` used on another pipeline stage than ``stage`` (an LM head sharing
    #: the embedding's table), with that stage: there they hold their own copy, and the
    #: gradients of the copies are summed before the optimizer step (Megatron-LM's way). The
    #: parameter's own name here is a tie by function call: the model's code reads it on that
    #: stage too (a head ``paddle.matmul(h, self.wte.weight, transpose_y=True)``), and there
    #: the name holds the copy.
    tied_stages: dict[Fqn, NonNegativeInt] = {}


class HookBase(Base, tag_field="action"):
    """A forward hook on a layer: run ``pre`` (on its input) or ``post`` (on its output).

    A plan's hooks are a tagged union on ``action``: each kind has the fields it needs and no
    others, so ``placements`` exists only on a reshard and ``to_stage`` only on a stage hand-off.

    Example::

        >>> import msgspec
        >>> hook = msgspec.json.decode(b'{"action": "stage_handoff", "layer": "layers.1", "when": "post", '
        ...                            b'"to_stage": 1}', type=Hook)
        >>> type(hook).__name__, hook.action, hook.to_stage
        ('StageHandoff', 'stage_handoff', 1)
    """

    layer: Fqn
    when: Literal["pre", "post"]

    @property
    def action(self) -> str:
        """The hook's kind, as the plan's JSON writes it (its tag)."""
        return str(self.__struct_config__.tag)


class Reshard(HookBase, tag="reshard"):
    """Reshard the layer's input (``pre``) or output (``post``) to ``placements`` (one per mesh
    axis) on its stage's mesh."""

    placements: list[Placement]
    #: Why the planner put it there (every kind has one).
    reason: Text = ""


class StageHandoff(HookBase, tag="stage_handoff"):
    """Move the layer's output, placements kept, onto stage ``to_stage``'s mesh."""

    to_stage: NonNegativeInt
    reason: Text = ""


class SequenceParallelBegin(HookBase, tag="sequence_parallel_begin"):
    """Transpose [b, s, h] -> [s, b, h] and split the sequence over mp, as Paddle's
    SequenceParallelBegin does."""

    reason: Text = ""


class SequenceParallelEnd(HookBase, tag="sequence_parallel_end"):
    """Gather the sequence over mp and transpose [s, b, h] -> [b, s, h], as Paddle's
    SequenceParallelEnd does."""

    reason: Text = ""


class ExpertDispatch(HookBase, tag="expert_dispatch"):
    """Before an MoE layer (``pre``): gather the tokens of the rank's ep group, so the layer
    routes them all with its own code; the experts under ``experts`` that the rank does not
    hold answer zero (strategy.ep)."""

    #: The container of the layer's experts (a block's ``experts``).
    experts: LayerFqn
    #: Shared experts: MLPs under the layer, outside ``experts``, that every token goes through
    #: and whose output is added to the routed experts' (Qwen2-MoE's ``shared_expert``). Only
    #: the first rank of each ep group runs them; on the others they answer zeros, so the
    #: combine's sum counts them once.
    shared: list[LayerFqn] = []
    reason: Text = ""


class ExpertCombine(HookBase, tag="expert_combine"):
    """After an MoE layer (``post``): sum the ep group's partial outputs (each rank's experts'
    share) and keep this rank's tokens."""

    reason: Text = ""


#: Any hook of a plan; ``action`` tells which.
Hook = typing.Union[Reshard, StageHandoff, SequenceParallelBegin, SequenceParallelEnd, ExpertDispatch, ExpertCombine]
#: The hook type of each ``action``.
HOOK_TYPES: dict[str, type[HookBase]] = {
    str(cls.__struct_config__.tag): cls
    for cls in (Reshard, StageHandoff, SequenceParallelBegin, SequenceParallelEnd, ExpertDispatch, ExpertCombine)
}


class LocalWeight(Base):
    """A parameter of a local-view sub-layer (:class:`LocalView`) and the slice of it each rank
    computes with."""

    param: Fqn
    #: The weight dim split over mp (its ``ParamPlan`` placement on mp is ``S(dim)``, ``R`` with
    #: ``replicated`` segments); None: whole on every rank.
    dim: NonNegativeInt | None = None
    #: Projections fused along ``dim`` (3 for ``q|k|v``): rank ``r`` computes with the ``r``-th
    #: slice of *each* segment, in segment order (``q_r|k_r|v_r``), the layout the model's own
    #: split expects at 1/mp width. The distributed parameter holds the ranks' slices one after
    #: another along ``dim``, so its shard on rank ``r`` is exactly that.
    segments: PositiveInt = 1
    #: The segments' sizes along ``dim`` when they differ (Falcon's multi-query ``q|k|v``:
    #: ``[heads * head_dim, head_dim, head_dim]``); [] for ``segments`` equal ones.
    sizes: list[PositiveInt] = []
    #: The segments every rank computes with whole instead of its slice, by position (``[1, 2]``:
    #: a multi-query projection's k and v, one KV head shared by all the query heads, Megatron's
    #: way). A weight with any is held replicated over mp in the model's own layout (its
    #: ``ParamPlan`` placement on mp is ``R``): each rank takes its columns for the call
    #: (``q_r|k|v``), and its gradient, each rank's share, is summed over mp.
    replicated: list[NonNegativeInt] = []
    #: Added once into the sub-layer's output (the row projection's bias): each rank adds 1/mp of
    #: it, so the ranks' partial outputs sum to the whole; its gradient is the whole one on every rank.
    summed: bool = False


class LocalBuffer(Base):
    """A tensor of a local-view sub-layer that is no parameter (a registered buffer: timm BEiT's
    zero ``k_bias``, concatenated between ``q_bias`` and ``v_bias`` into its fused projection's
    bias) cut to each rank's heads for the call: rank ``r`` computes with the ``r``-th of ``mp``
    equal slices along ``dim``, as it does with a parameter split there (``LocalWeight`` of one
    segment). The buffer itself stays whole on every rank; it carries no gradient."""

    name: Fqn
    dim: NonNegativeInt
    #: Its whole shape, as proven (the applier refuses a model whose buffer differs).
    shape: list[PositiveInt]


class LocalAttribute(Base):
    """An integer attribute the sub-layer's forward reads a size from (``self.num_heads``,
    ``self.split_size``, a projection's ``nf``, a child core attention's width, or one of an
    object the layer holds: ``self.config.num_attention_heads``, named
    ``config.num_attention_heads``), set to ``local`` for the duration of the call: those the
    planner's proof needs localised (planner/local_view_proof.py ``discover``)."""

    layer: Fqn
    name: AttributePath
    whole: PositiveInt
    local: PositiveInt


class CallInput(Base):
    """One argument of a local-view sub-layer's call, as the planner's trace saw it; the proof
    calls the sub-layer with the same ones (:func:`autodist.planner.local_view_proof.verify`) and the
    applier takes each rank's value of it by its ``role``:

    - ``hidden``: the first tensor input, the activation the view takes whole on every rank
      (random in the proof);
    - ``mask``: a bool tensor (a selector; causal in the proof), ``positions``: an integer tensor
      (``arange`` of the sequence in the proof), ``tensor``: a float or complex one, whatever it
      is for, an additive mask or a rotary table (random in the proof). Each is replicated over
      mp and carries no gradient;
    - ``literal``: ``value`` (None, a bool, a number, a string), passed as the trace passed it;
    - ``tuple`` / ``list``: its ``items`` (HF's ``position_embeddings=(cos, sin)``).
    """

    role: Literal["hidden", "mask", "positions", "tensor", "literal", "tuple", "list"]
    #: The keyword it is passed by; "" for a positional argument (the call's positional ones come
    #: first, in order).
    keyword: KeywordName = ""
    #: A tensor's traced shape (the plan's input specs' batch and sequence).
    shape: list[NonNegativeInt] = []
    dtype: DType | Literal[""] = ""
    #: A tensor's dim 0 follows the batch (by dataflow: it moved with the batch when the planner
    #: traced the model again at a batch of its own; ``[B, ...]`` or ``[B * H, ...]``): each rank
    #: takes its rows as the hidden input's local value holds them.
    batch: bool = False
    value: None | bool | int | float | Text = None
    items: list[CallInput] = []
    #: A per-head tensor, an ALiBi bias built outside the attention and passed in whole (MPT's
    #: ``[1, H, 1, S]``, BLOOM's ``[B * H, 1, S]``): the dim that holds its ``heads`` entries for
    #: each batch row (batch-major when it is dim 0 of a ``batch`` tensor). Each rank takes its
    #: heads' entries along it (:func:`autodist.schemas.local_view.head_positions`). None: not per head.
    heads_at: NonNegativeInt | None = None
    heads: NonNegativeInt = 0
    #: A float tensor that carries a gradient (BLOOM's residual, added to the output inside the
    #: attention), as the proof found each rank must take it: ``whole`` (it feeds the rank's heads,
    #: as the hidden input does: its gradient is the ranks' summed over mp, Megatron's ``f``) or
    #: ``share`` (1/mp of it: added to the output, the ranks' partial sums would add it mp times;
    #: its gradient is the whole one on every rank, as the output's, with no collective). "": it
    #: carries none, and the applier refuses one that does.
    gradient: Literal["", "whole", "share"] = ""


class LocalView(Base):
    """A sub-layer that runs on local tensors (Megatron's tensor parallelism) instead of global-view
    DistTensors: each rank runs the model's own forward at 1/mp width on its heads' slices of the
    ``weights`` with the ``attributes`` set to their local values, and its output re-enters the
    global view as a partial sum (one all-reduce over mp), or, for one whose row projection lies
    outside it (``output`` ``joined``), as the rank's slice of its last dim. A sub-layer not listed
    runs in the global view. The planner lists one only after proving it (``verified``)."""

    layer: Fqn
    weights: list[LocalWeight]
    attributes: list[LocalAttribute] = []
    #: Its buffers each rank takes its heads' slice of (the others it reads whole, as they are).
    buffers: list[LocalBuffer] = []
    #: How it is called (the trace's call, proven with these arguments); [] for the hidden
    #: input alone. A call otherwise (another keyword, a tensor for a literal) is refused at run time.
    call: list[CallInput] = []
    #: Positions of items of its output tuple beside the hidden state (item 0) that a local view
    #: returns as None: per-head values such as eager attention's weights, which hold only a
    #: rank's heads, and which nothing read in the trace (HF: ``hidden_states, _ = self.self_attn(...)``).
    dropped_outputs: list[PositiveInt] = []
    #: How its output re-enters the global view: ``summed`` (its row projection inside it: the
    #: ranks' partial sums added by one all-reduce) or ``joined`` (the columns and the core only,
    #: its row projection a layer beside it, BERT's ``SelfOutput``: each rank's output is its heads,
    #: a slice of the last dim, handed back ``S(last)`` over mp to the row projection, whose
    #: ``S(0)`` weight makes Paddle's partial sum and all-reduce, Megatron's row-parallel linear).
    output: Literal["summed", "joined"] = "summed"
    #: The width its forward reads from its hidden input's shape (``B, T, C = x.shape``, then
    #: ``reshape([B, T, C])``): ``whole``, the input's own; or ``local``, the last dim read as 1/mp
    #: of it, the width each rank computes with (HF CLIP's, nanoGPT's and timm's attentions). The
    #: input itself stays whole; only that read of its shape changes, and only as proven.
    input_width: Literal["whole", "local"] = "whole"
    #: How the planner proved it: the local runs reassembled against the global run.
    verified: Text = ""


class VocabLookup(Base):
    """A token lookup in a vocabulary-split table run on local tensors, as Megatron-LM's
    ``VocabParallelEmbedding`` does, instead of through Paddle's ``embedding`` rule (which
    all-gathers the whole table before every lookup and again in its backward): each rank looks
    up the ids that fall in its rows of the table, the others answer zero, and one all-reduce over
    mp sums the ranks' outputs. Its backward needs no collective for the table: each rank's
    gradient lands on its own rows."""

    #: The ``nn.Embedding`` layer whose forward runs so (its own forward, not overridden).
    layer: Fqn
    #: Its table, ``[vocab, hidden]``: placed ``S(0)`` on mp (its ``ParamPlan``).
    weight: Fqn


class DataPlan(Base):
    """How the dataloader is split: over ``shard_axes`` of the first (inputs) and last (labels)
    stage meshes."""

    shard_axes: list[MeshAxis] = []
    input_stage: NonNegativeInt = 0
    label_stage: NonNegativeInt = 0
    #: Samples the loader yields per optimizer step, over all ranks (the input spec's batch or
    #: ``--global-batch-size``); ``apply_plan`` checks the loader against it. 0: not recorded.
    global_batch_size: NonNegativeInt = 0


class ImplicitComm(Base):
    """A collective Paddle inserts on its own because of the chosen placements."""

    layer: LayerFqn
    op: Text
    collective: Literal["all_gather", "all_reduce", "reduce_scatter", "all_to_all"]
    bytes_per_step: NonNegativeInt
    reason: Text


class Block(Base):
    """A repeated block the planner recognised, and the stage it runs on. ``kind``: a family name
    for reports, from the block's sub-layers (``llama_decoder``: q, k, v attention and a gate|up
    MLP; ``transformer_block`` when no family fits); nothing reads it to apply the plan."""

    layer: Fqn
    kind: Text
    stage: NonNegativeInt = 0
    #: The layer holding the block's experts (an MoE's ``LayerList``), "" without experts; how
    #: many there are, and to how many each token is routed.
    experts: LayerFqn = ""
    num_experts: NonNegativeInt = 0
    top_k: NonNegativeInt = 0


# -- estimates and alternatives ----------------------------------------------------------------------


class MemoryEstimate(Base):
    """Bytes per rank by kind (the most loaded rank)."""

    params: NonNegativeInt = 0
    grads: NonNegativeInt = 0
    optimizer: NonNegativeInt = 0
    activations: NonNegativeInt = 0
    total: NonNegativeInt = 0


class CommEstimate(Base):
    """Bytes sent per rank per training step, by what causes them."""

    mp: NonNegativeInt = 0
    dp: NonNegativeInt = 0
    pp: NonNegativeInt = 0
    #: Expert parallelism's gathers and sums (expert_dispatch and expert_combine, forward and backward).
    ep: NonNegativeInt = 0
    #: What Paddle inserts on its own beyond the plan's hooks: the ``implicit_comm`` entries
    #: together (the hooks' own gathers are in ``mp``).
    implicit: NonNegativeInt = 0


class Estimate(Base):
    step_time_s: NonNegativeFloat = 0.0
    tokens_per_s: NonNegativeFloat = 0.0
    mfu: NonNegativeFloat = 0.0
    memory: MemoryEstimate = msgspec.field(default_factory=MemoryEstimate)
    comm_bytes: CommEstimate = msgspec.field(default_factory=CommEstimate)


class Candidate(Base):
    strategy: Strategy
    estimate: Estimate


class Rejected(Base):
    strategy: Strategy
    reason: Text


class Alternatives(Base):
    accepted: list[Candidate] = []
    rejected: list[Rejected] = []


class Kernels(Base):
    """The kernels the estimate prices (the planner's ``--attention``; docs/plan-format.md)."""

    #: The attention cores: ``flash`` (one fused kernel: its FLOPs at the matmul roof, no
    #: seq x seq scores in memory or saved, the scores recomputed in its backward) or ``eager``
    #: (as traced: scores, softmax and mask as ops of their own, the probabilities saved).
    attention: Literal["flash", "eager"] = "eager"
    #: Why: what the model selects (a call the trace saw, a config flag), the option, or the device.
    reason: Text = ""
    #: Other fused kernels priced as one op each (``rms_norm``: each RMSNorm layer; ``rope``,
    #: ``swiglu``: traced as one op already).
    fused: list[Literal["rms_norm", "rope", "swiglu"]] = []


class Provenance(Base):
    autodist_version: Text
    paddle_version: Text
    #: The planner's arguments as given, so a plan can be re-made from itself.
    arguments: dict[Text, Text] = {}


# -- the plan ---------------------------------------------------------------------------------------


class Plan(Base, kw_only=True):
    """A complete, self-describing parallelisation plan for one model on one cluster.

    The fields are in the order a reader wants them, and a plan file keeps that order
    (:func:`~autodist.schemas.dump_plan`): what it is, for which model and cluster, the mesh and
    strategy and what they cost, then the details, and the alternatives last."""

    format: Literal["autodist.plan"] = FORMAT
    version: int = VERSION
    model: ModelInfo
    cluster: Cluster
    mesh: Mesh
    strategy: Strategy
    estimate: Estimate = msgspec.field(default_factory=Estimate)
    #: Human-readable remarks: unmatched layers, padding, anything a reviewer should know.
    notes: list[Text] = []
    data: DataPlan = msgspec.field(default_factory=DataPlan)
    blocks: list[Block] = []
    params: dict[Fqn, ParamPlan]
    hooks: list[Hook] = []
    #: Sub-layers that run on local tensors (:class:`LocalView`); every other sub-layer runs in
    #: the global view.
    local_view: list[LocalView] = []
    #: Token lookups in a vocabulary-split table that run on local tensors (:class:`VocabLookup`);
    #: every other lookup runs in the global view.
    vocab_lookup: list[VocabLookup] = []
    #: Layers whose forward is recomputed in backward (``strategy.recompute``), in model order.
    recompute: list[Fqn] = []
    implicit_comm: list[ImplicitComm] = []
    #: The kernels the estimate prices (attention flash or eager, fused norms).
    kernels: Kernels = msgspec.field(default_factory=Kernels)
    provenance: Provenance
    alternatives: Alternatives = msgspec.field(default_factory=Alternatives)
