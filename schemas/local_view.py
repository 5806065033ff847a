"""The layout of a fused weight under a local-view sub-layer (``Plan.local_view``).

A fused ``q|k|v`` column of width ``3n`` split over ``mp`` ranks: rank ``r`` computes with
``q_r|k_r|v_r`` (the ``r``-th slice of each segment, each ``n/mp`` wide), the order the model's
own ``split`` expects at 1/mp width (a fused ``gate|up``: ``gate_r|up_r``, 2 segments). The
distributed parameter holds those slices rank after rank along the split dim, so its ordinary
``S(dim)`` shard on rank ``r`` is exactly rank ``r``'s; :func:`local_order` gives that layout from
the model's own, :func:`own_order` the way back (a checkpoint and a reader of the parameters want
the model's own layout).

    >>> from autodist.schemas import LocalWeight
    >>> qkv = LocalWeight(param="attn.qkv.weight", dim=1, segments=3)
    >>> local_order(qkv, 6, mp=2)      # q0 k0 v0 | q1 k1 v1, each segment 2 wide
    [0, 2, 4, 1, 3, 5]
    >>> [local_order(qkv, 6, 2)[i] for i in own_order(qkv, 6, 2)]
    [0, 1, 2, 3, 4, 5]

Segments may differ in size (``LocalWeight.sizes``), and some may be computed with whole on
every rank (``LocalWeight.replicated``: a multi-query ``q|k|v``'s one K and V head). Such a weight
is held replicated over mp in the model's own layout, not reordered (:func:`reordered`); each
rank takes its columns, :func:`rank_positions`, for the call:

    >>> mqa = LocalWeight(param="attn.qkv.weight", dim=1, segments=3, sizes=[4, 1, 1], replicated=[1, 2])
    >>> rank_positions(mqa, 6, mp=2, rank=1)      # q's second half, then k and v whole
    [2, 3, 4, 5]
"""

from __future__ import annotations

from autodist.schemas.plan import LocalBuffer, LocalWeight


def segment_sizes(weight: LocalWeight, size: int) -> list[int]:
    """The sizes of ``weight``'s segments along its dim of ``size``: ``weight.sizes``, else
    ``segments`` equal ones. Raises ValueError when they do not make up ``size``."""
    sizes = list(weight.sizes) or [size // weight.segments] * weight.segments
    if len(sizes) != weight.segments or sum(sizes) != size or any(s >= weight.segments for s in weight.replicated):
        raise ValueError(
            f"{weight.param}: a dim of {size} is not {weight.segments} segments of sizes {weight.sizes or 'equal'} "
            f"(replicated {weight.replicated})"
        )
    return sizes


def rank_positions(weight: LocalWeight, size: int, mp: int, rank: int) -> list[int]:
    """The positions of the model's own layout (along ``weight.dim``, of ``size``) that rank
    ``rank`` computes with, in the order its call sees them: of each segment in turn, its
    ``rank``-th slice, or the whole segment when ``replicated``. Raises ValueError when a split
    segment does not divide by ``mp``."""
    positions: list[int] = []
    start = 0
    for s, segment in enumerate(segment_sizes(weight, size)):
        if s in weight.replicated:
            positions += range(start, start + segment)
        elif segment % mp:
            raise ValueError(f"{weight.param}: a segment of {segment} does not split into {mp} equal slices")
        else:
            width = segment // mp
            positions += range(start + rank * width, start + (rank + 1) * width)
        start += segment
    return positions


def buffer_positions(buffer: LocalBuffer, mp: int, rank: int) -> list[int]:
    """The positions along ``buffer.dim`` that rank ``rank`` of ``mp`` computes with: its slice, as
    of a weight split there in one segment (:func:`rank_positions`).

    >>> k_bias = LocalBuffer(name="attn.k_bias", dim=0, shape=[8])
    >>> buffer_positions(k_bias, mp=2, rank=1)
    [4, 5, 6, 7]
    """
    return rank_positions(LocalWeight(param=buffer.name, dim=buffer.dim), buffer.shape[buffer.dim], mp, rank)


def head_positions(size: int, heads: int, mp: int, rank: int) -> list[int]:
    """The positions along a per-head input's dim of ``size`` (``CallInput.heads_at``: groups of
    ``heads`` entries, one per head, group after group) that rank ``rank`` of ``mp`` computes with:
    its heads' entries of each group. Raises ValueError when the dim is not whole groups of heads
    that split over ``mp``.

    >>> head_positions(4, 4, mp=2, rank=1)      # MPT's [1, H, 1, S] ALiBi, dim 1
    [2, 3]
    >>> head_positions(8, 4, mp=2, rank=1)      # BLOOM's [B * H, 1, S], dim 0, two batch rows
    [2, 3, 6, 7]
    """
    if heads <= 0 or size % heads or heads % mp:
        raise ValueError(f"a per-head dim of {size} is not groups of {heads} heads splitting over {mp} ranks")
    width = heads // mp
    return [group * heads + rank * width + i for group in range(size // heads) for i in range(width)]


def kv_replicated(num_kv_heads: int, mp: int) -> bool:
    """Whether a multi-query (grouped) attention's fused ``q|k|v`` run as a local view computes
    its K and V whole on every one of ``mp`` ranks (``LocalWeight.replicated``), so that the
    weight is held whole, its gradient summed over mp: when its KV heads do not split over mp.
    The one rule the planner's layout (planner/local_view_proof.py), hence emit's placement, and the
    cost model's price of such a weight (step_time.py) read.

    >>> kv_replicated(1, 2), kv_replicated(2, 2), kv_replicated(2, 4)
    (True, False, True)
    """
    return num_kv_heads % mp != 0


def kv_segments_whole(num_kv_heads: int, mp: int) -> list[int]:
    """The segments of a multi-query (grouped) attention's fused ``q|k|v`` (q of all the heads,
    then k and v of the KV heads) that each of ``mp`` ranks computes with whole
    (``LocalWeight.replicated``): k and v where :func:`kv_replicated`. The layout the planner
    proves (planner/recognise/reshards.py ``_fused``) and the one the cost model prices a rank's
    columns of (planner/cost/blocks.py ``multi_query_kept``).

    >>> kv_segments_whole(1, 2), kv_segments_whole(2, 2)
    ([1, 2], [])
    """
    return [1, 2] if kv_replicated(num_kv_heads, mp) else []


def mp_placement(weight: LocalWeight) -> str:
    """The placement on mp of a local-view weight's distributed parameter: ``R`` when every rank
    computes with it whole (``dim`` None, a summed bias) or holds it whole to take its columns
    (``replicated`` segments), else ``S(dim)``: its shard on rank ``r`` is what rank ``r``
    computes with. The one rule emit places by and the applier checks a plan against.

    >>> mp_placement(LocalWeight(param="attn.relative_position_bias_table", dim=1))
    'S(1)'
    >>> mp_placement(LocalWeight(param="attn.proj.bias", summed=True))
    'R'
    """
    return "R" if weight.dim is None or weight.replicated else f"S({weight.dim})"


def reordered(weight: LocalWeight) -> bool:
    """Whether the distributed parameter of ``weight`` holds the ranks' slices rank after rank
    (:func:`local_order`), not the model's own layout: a fused weight (along its dim) split over
    mp; one with ``replicated`` segments is held whole in the model's own layout."""
    return weight.segments > 1 and not weight.replicated


def local_order(weight: LocalWeight, size: int, mp: int) -> list[int]:
    """Position ``p`` of the ranks' layout holds element ``local_order(...)[p]`` of the model's own
    layout (along ``weight.dim``, of ``size``): :func:`rank_positions` of each rank in turn."""
    return [p for rank in range(mp) for p in rank_positions(weight, size, mp, rank)]


def own_order(weight: LocalWeight, size: int, mp: int) -> list[int]:
    """The inverse of :func:`local_order`: position ``i`` of the model's own layout is element
    ``own_order(...)[i]`` of the ranks' layout."""
    order = local_order(weight, size, mp)
    inverse = [0] * size
    for position, element in enumerate(order):
        inverse[element] = position
    return inverse


def attribute_owner(layer: object, name: str) -> tuple[object, str]:
    """The object holding attribute ``name`` of ``layer`` (a ``LocalAttribute`` name: ``num_heads``
    is the layer's own, ``config.num_attention_heads`` its config's) and the attribute's own name.
    Raises AttributeError when the layer holds no such object.

    >>> class Config: heads = 4
    >>> class Layer: config = Config()
    >>> owner, leaf = attribute_owner(Layer(), "config.heads"); type(owner).__name__, leaf
    ('Config', 'heads')
    """
    held, _, leaf = name.rpartition(".")
    return (getattr(layer, held) if held else layer), leaf


def hidden_output(output: object, dropped: list[int] | tuple[int, ...] = ()) -> tuple[object, int | None] | None:
    """Where the hidden state is in what a sub-layer returns: ``(tensor, None)`` for one tensor,
    ``(tensor, 0)`` for a tuple or list whose first item is it and whose other items are all
    None or ``dropped`` (the positions a local view returns as None: HF's ``(attn_output,
    attn_weights)`` when nothing reads the weights); None for anything else, which a local view
    cannot hand back (a cache or attention weights hold only the rank's heads).

    >>> hidden_output(("h", None)), hidden_output("h"), hidden_output(("h", "cache"))
    (('h', 0), ('h', None), None)
    >>> hidden_output(("h", "weights"), dropped=[1])
    ('h', 0)
    """
    if isinstance(output, (tuple, list)):
        others = [item for i, item in enumerate(output) if i > 0 and i not in dropped]
        if output and all(item is None for item in others) and output[0] is not None:
            return output[0], 0
        return None
    return output, None
