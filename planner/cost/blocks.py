"""The cost description the search works on: per-block coefficients, independent of batch size.

A :class:`ModelCost` is what the cost model needs to know about a model, distilled from the
traced graph by :mod:`autodist.planner.cost.graph_cost` (or written by hand in tests). Every
quantity is a coefficient per token (proportional to b*s) or per token times sequence length
(proportional to b*s^2, the attention core), so one trace at any input shape prices every
micro-batch size and sequence length.

Activation memory follows Korthikanti et al., "Reducing Activation Recomputation in Large
Transformer Models" (2022), section 4: a tensor saved for backward *inside* the tensor-parallel
region (after a column-parallel linear, before the row-parallel one) is split over mp; one
*outside* it (norm inputs, dropout masks, inputs of column-parallel linears) is whole on every
mp rank unless sequence parallelism splits it along the sequence.

Example::

    >>> saved = Saved(floats=34.0, masks=0.0)
    >>> saved.bytes(2)
    68.0
"""

from __future__ import annotations

from dataclasses import dataclass, field

from autodist.schemas.local_view import kv_replicated, kv_segments_whole, rank_positions
from autodist.schemas.plan import LocalWeight
from autodist.schemas.vocabulary import TrainingDType


@dataclass(frozen=True)
class Saved:
    """Elements saved for backward: floating point (training dtype) and one-byte masks."""

    floats: float = 0.0
    masks: float = 0.0

    def bytes(self, float_bytes: int) -> float:
        return self.floats * float_bytes + self.masks

    def __add__(self, other: Saved) -> Saved:
        return Saved(self.floats + other.floats, self.masks + other.masks)

    def scaled(self, factor: float) -> Saved:
        return Saved(self.floats * factor, self.masks * factor)


@dataclass(frozen=True)
class Gemm:
    """One matmul with a weight, per token: (tokens x k) @ (k x n) on one device.

    ``split`` says how mp divides it: ``column`` (n / mp), ``row`` (k / mp), ``vocab`` (n / mp when
    the vocabulary divides by mp) or ``none``.
    """

    n: int
    k: int
    split: str = "none"


@dataclass(frozen=True)
class Moved:
    """Elements per token that memory-bound ops (everything but matmuls) read and write in the
    forward pass, by where they sit: whole on every mp rank, split over mp, or per token x
    sequence (attention scores, split over mp)."""

    outside: float = 0.0
    inside: float = 0.0
    inside_seq: float = 0.0
    vocab: float = 0.0  # logits-shaped (the last dim is the vocabulary): split with the vocabulary
    ops: int = 0  # how many ops (each pays the device's fixed cost per op)


@dataclass(frozen=True)
class BlockCost:
    """One repeated block (a transformer layer), per token of one micro-batch.

    ``flops_*`` are forward FLOPs; ``allreduce_*`` are elements all-reduced over mp when the
    block's linears are split (forward: row-parallel outputs; backward: the inputs of
    column-parallel linears, once per distinct input), in ``*_count`` collectives (at least one
    when there are elements); ``gather_*`` elements all-gathered over mp (their whole size), in
    ``gather_*_count`` collectives: forward, the outputs of fused projections the plan gathers;
    backward, the gradients of row-parallel linears' whole inputs (what follows such a gather).
    """

    layer: str
    num_heads: int = 0
    num_kv_heads: int = 0
    intermediate_size: int = 0
    #: K and V reach the attention core split by heads over mp, so mp must divide ``num_kv_heads``;
    #: False when they are whole on every rank (multi-query K/V kept whole, a fused projection gathered).
    kv_split: bool = True
    params_split: int = 0  # elements divided over mp (column/row-parallel weights and biases)
    params_whole: int = 0  # elements every mp rank holds whole (norms, row-parallel biases)
    #: Elements of each fused multi-query ``q|k|v`` weight (or bias) of the block's local-view
    #: sub-layers (part of ``params_split``): at an mp its ``num_kv_heads`` do not divide
    #: (:func:`~autodist.schemas.local_view.kv_replicated`) each is held whole on every mp rank,
    #: its gradient all-reduced over mp each step (:func:`multi_query_whole`).
    multi_query_params: tuple[int, ...] = ()
    #: Each one's segments' sizes along its split dim (``LocalWeight.sizes``: q, k, v): a rank
    #: computes with its columns of it (:func:`multi_query_kept`).
    multi_query_sizes: tuple[tuple[int, ...], ...] = ()
    flops_per_token: float = 0.0  # proportional to b*s (matmuls with a weight)
    flops_per_token_seq: float = 0.0  # times b*s^2 (matmuls of two activations: attention)
    saved_outside: Saved = field(default_factory=Saved)  # per token, outside the mp region
    saved_inside: Saved = field(default_factory=Saved)  # per token, split over mp
    saved_inside_seq: Saved = field(default_factory=Saved)  # per token*s: attention scores
    allreduce_fwd_per_token: float = 0.0
    allreduce_bwd_per_token: float = 0.0
    allreduce_fwd_count: int = 0  # how many collectives carry them (each pays the latency)
    allreduce_bwd_count: int = 0
    gather_fwd_per_token: float = 0.0
    gather_bwd_per_token: float = 0.0
    gather_fwd_count: int = 0
    gather_bwd_count: int = 0
    #: The share of the attention core (``flops_per_token_seq``, its scores saved and moved) that
    #: runs whole on every mp rank: its q, k, v whole (a fused projection gathered, projections
    #: replicated); the rest runs on 1/mp of the heads (:func:`core_share`).
    core_whole: float = 0.0
    output_per_token: float = 0.0  # elements handed to the next block (pipeline p2p)
    param_tensors: int = 0  # parameters (each is a gradient all-reduce and an optimizer update)
    #: Elements of the block's largest parameter of ``params_split`` and of ``params_whole``:
    #: under ZeRO 3 an op's backward holds the parameter gathered over dp and its gradient whole
    #: over dp at once (step_time ``_largest_gathered``).
    largest_split: int = 0
    largest_whole: int = 0
    gemms: tuple[Gemm, ...] = ()  # the matmuls behind flops_per_token, when known (from a trace)
    attention_matmuls: int = 0  # matmuls of two activations behind flops_per_token_seq
    moved: Moved = field(default_factory=Moved)
    #: The attention core runs as one fused (flash) kernel: its FLOPs at the matmul roof, no
    #: seq x seq memory passes or saved scores, the scores recomputed in its backward; it reads
    #: and writes ``attention_io_per_token`` elements per token (q, k, v, output; split over mp).
    fused_attention: bool = False
    attention_io_per_token: float = 0.0
    #: An MoE's experts: how many, their elements (part of ``params_split``/``params_whole``,
    #: divided over ep too) and parameter tensors; the MoE layer's other parameters (the
    #: router's) likewise: under expert parallelism apply_plan sums their gradients itself before
    #: the optimizer step, the experts' over the dp ranks holding them. ``expert_dispatch`` gathers
    #: the MoE layer's input and ``expert_combine`` sums its output, ``dispatch_per_token``
    #: elements per token each (the hidden size); ``saved_router`` is what the MoE layer saves for
    #: backward outside its experts (router, token gathers, combine), per token: it runs on the ep
    #: group's tokens then (part of ``saved_outside``/``saved_inside`` already, for this rank's).
    experts: int = 0
    #: The experts are one layer's batched weights (``Experts.batched``): expert parallelism does
    #: not spread them (no rank can drop some), so ep stays 1.
    experts_batched: bool = False
    expert_params: int = 0
    expert_tensors: int = 0
    router_params: int = 0
    router_tensors: int = 0
    dispatch_per_token: float = 0.0
    saved_router: Saved = field(default_factory=Saved)
    #: Forward FLOPs per token of the MoE layer's shared experts (part of ``flops_per_token``):
    #: under expert parallelism the first rank of each ep group runs them on the group's ep x
    #: the tokens and the others not at all, so the most loaded rank does ep x this.
    shared_flops_per_token: float = 0.0
    #: Elements of the parameters of the block's local-view sub-layers (of ``params_split``, of
    #: ``params_whole``): under ZeRO 3 a view gathers them over dp for its call and holds the
    #: gathered values until its backward (applier/modes/local_calls.py ``param_local``).
    view_params_split: int = 0
    view_params_whole: int = 0
    view_param_tensors: int = 0
    #: The sub-layer selective recompute runs again (its attention, ``layer`` named inside the
    #: block), priced alone: its FLOPs, core and memory traffic are the forward its backward runs
    #: again, its forward collectives those that run again with it (none of a local view's: its
    #: all-reduces run once, outside the recompute); its ``saved_*`` are what the block no longer
    #: keeps (graph_cost._selective). None: the block has no attention sub-layer, nothing is
    #: recomputed (emit.recompute_layers says so in a note).
    selective: BlockCost | None = None


def core_share(block: BlockCost, mp: int) -> float:
    """The part of ``block``'s attention core one of ``mp`` ranks runs: the whole of what reads
    whole values, 1/mp of the rest. The one rule for its FLOPs, scores and reads and writes.

    >>> core_share(BlockCost(layer="h.0"), 4), core_share(BlockCost(layer="h.0", core_whole=1.0), 4)
    (0.25, 1.0)
    """
    return block.core_whole + (1.0 - block.core_whole) / mp


def multi_query_whole(block: BlockCost, mp: int) -> tuple[int, ...]:
    """The elements of each of ``block``'s fused multi-query weights held whole on every one of
    ``mp`` ranks (``BlockCost.multi_query_params`` where their KV heads do not split over mp).

    >>> block = BlockCost(layer="h.0", num_kv_heads=1, multi_query_params=(1536,))
    >>> multi_query_whole(block, 2), multi_query_whole(block, 1)
    ((1536,), ())
    """
    return block.multi_query_params if kv_replicated(block.num_kv_heads, mp) else ()


def multi_query_kept(block: BlockCost, mp: int) -> float:
    """Elements of ``block``'s fused multi-query weights held whole on every one of ``mp`` ranks
    (:func:`multi_query_whole`) that one rank computes with: its columns ``q_r|k|v``
    (:func:`~autodist.schemas.local_view.rank_positions`), all its matmul keeps for the backward.
    Under ZeRO 3 the view gathers the whole weight over dp, takes those columns
    (``index_select``, whose backward needs no input values) and frees the rest (measured,
    docs/paddle-notes.md).

    >>> mqa = BlockCost(layer="h.0", num_kv_heads=1, multi_query_params=(480,), multi_query_sizes=((16, 4, 4),))
    >>> multi_query_kept(mqa, 2), multi_query_kept(mqa, 1)    # (8 + 4 + 4) of its 24 columns at mp 2
    (320.0, 0.0)
    """
    kept = 0.0
    for elements, sizes in zip(multi_query_whole(block, mp), block.multi_query_sizes):
        weight = LocalWeight(
            param=block.layer,
            segments=len(sizes),
            sizes=list(sizes),
            replicated=kv_segments_whole(block.num_kv_heads, mp),
        )
        kept += elements * len(rank_positions(weight, sum(sizes), mp, 0)) / sum(sizes)
    return kept


def view_params_per_rank(block: BlockCost, mp: int) -> float:
    """Elements of ``block``'s local-view parameters one of ``mp`` ranks holds: its slices of the
    split ones, the fused multi-query weights it holds whole (:func:`multi_query_whole`), the
    rest whole. What ZeRO 3 gathers over dp for the views.

    >>> view_params_per_rank(BlockCost(layer="h.0", view_params_split=4096, view_params_whole=64), 4)
    1088.0
    """
    whole = sum(multi_query_whole(block, mp))
    return (block.view_params_split - whole) / mp + whole + block.view_params_whole


def view_params_kept(block: BlockCost, mp: int) -> float:
    """Elements of ``block``'s local-view parameters, gathered over dp (:func:`view_params_per_rank`),
    that one of ``mp`` ranks computes with and so keeps for the backward: of a fused multi-query
    weight held whole, its columns alone (:func:`multi_query_kept`).

    >>> mqa = BlockCost(layer="h.0", num_kv_heads=1, multi_query_params=(480,), multi_query_sizes=((16, 4, 4),),
    ...                 view_params_split=480 + 64, view_params_whole=8)
    >>> view_params_per_rank(mqa, 2), view_params_kept(mqa, 2)
    (520.0, 360.0)
    """
    return view_params_per_rank(block, mp) - sum(multi_query_whole(block, mp)) + multi_query_kept(block, mp)


@dataclass(frozen=True)
class EdgeCost:
    """What sits before the first block (embedding) or after the last (final norm, LM head).

    ``params_vocab`` and ``flops_vocab_per_token`` are split over mp only when the vocabulary
    divides by mp (vocabulary-parallel embedding, column-parallel head); otherwise every mp rank
    holds and computes them whole. So split, the token lookup's table (``lookup_table``
    elements, the whole table's) is all-gathered over mp before each lookup and again in its
    backward, and held whole, with its whole gradient, on every mp rank; or, where the plan runs
    the lookup on local tensors (its layer can: ``lookup_output``, the output's elements per
    token; and the strategy does), its output is all-reduced once instead
    (:func:`autodist.planner.cost.comm.vocab_lookup_collective`); the column-parallel head's input
    gradient is all-reduced (``allreduce_bwd_per_token``).
    """

    params_vocab: int = 0
    params_whole: int = 0
    flops_vocab_per_token: float = 0.0
    flops_whole_per_token: float = 0.0
    saved_whole: Saved = field(default_factory=Saved)  # per token, whole on every mp rank
    saved_vocab: Saved = field(default_factory=Saved)  # per token, logits: split with the vocab
    lookup_table: int = 0  # elements of the table the token lookup reads (the embedding side)
    lookup_output: int = 0  # hidden width of its output when its layer can look up locally
    allreduce_bwd_per_token: float = 0.0  # with vocabulary parallelism only
    param_tensors: int = 0
    largest_vocab: int = 0  # elements of its largest parameter of ``params_vocab``
    largest_whole: int = 0  # and of ``params_whole`` (as ``BlockCost.largest_split``)
    gemms: tuple[Gemm, ...] = ()
    moved: Moved = field(default_factory=Moved)


@dataclass(frozen=True)
class ModelCost:
    """A model as the cost model sees it: blocks in forward order plus both edges."""

    blocks: tuple[BlockCost, ...]
    hidden_size: int
    vocab_size: int | None = None
    first: EdgeCost = field(default_factory=EdgeCost)
    last: EdgeCost = field(default_factory=EdgeCost)
    #: The input shape it was traced at; the search defaults the micro-batch size and sequence
    #: length to these.
    traced_batch: int = 1
    traced_seq: int = 1
    #: Elements of a weight both edges use (an LM head tied to the embedding): in ``first`` and
    #: ``last`` alike, because with pp > 1 the first and the last stage each hold it.
    tied_vocab_params: int = 0
    #: A projection contracting over the token axis (an MLP-Mixer's token MLP), if any: the
    #: sequence cannot be split between blocks (no sequence parallelism).
    token_mixing: str | None = None
    #: An op Paddle cannot run on distributed tensors (planner/ops.py ``local_only_use``) and its
    #: layer, ``"einsum in layers.0.attn"``: outside every MoE layer (no plan can run it, but as a
    #: local view), and inside one (only plans that run the MoE layers on local tensors can).
    local_only: str | None = None
    local_only_in_moe: str | None = None
    #: How to write ``local_only`` so that it runs (planner/ops.py ``Op.rewrite``): the refusal's advice.
    local_only_rewrite: str = ""
    #: The layer ``local_only`` lies in ('' the top level), for the refusal to name its source line.
    local_only_layer: str | None = None
    #: ``(k, why)`` for each cut before block ``k`` a pipeline cannot make (``ModelAnalysis.unchained``).
    unchained: tuple[tuple[int, str], ...] = ()
    notes: tuple[str, ...] = ()
    #: The dtype its parameters are in, what it trains in unless ``--dtype`` says otherwise (AMP);
    #: a cost written by hand, without a model: bf16.
    dtype: TrainingDType = "bf16"

    @property
    def has_experts(self) -> bool:
        """Whether any block holds an MoE layer's experts."""
        return any(b.experts for b in self.blocks)

    @property
    def num_params(self) -> int:
        edges = self.first.params_vocab + self.first.params_whole + self.last.params_vocab + self.last.params_whole
        return edges - self.tied_vocab_params + sum(b.params_split + b.params_whole for b in self.blocks)

    def forward_flops(self, tokens: float, seq_len: int) -> float:
        """Forward FLOPs of the whole model for ``tokens`` tokens of sequences of ``seq_len``."""
        per_token = sum(b.flops_per_token + b.flops_per_token_seq * seq_len for b in self.blocks)
        for edge in (self.first, self.last):
            per_token += edge.flops_vocab_per_token + edge.flops_whole_per_token
        return per_token * tokens
