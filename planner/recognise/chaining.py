"""Where a pipeline may cut a model: before a block whose inputs are exactly what a stage gets.

The pipeline runtime (``applier/modes/pipeline.py``, docs/pipelines.md) runs the model's own
forward on every stage. A stage after a cut gets two things: the first tensor the previous
block returned (it replaces the first tensor input of the stage's first block), and the
model's inputs, from which the model's own code between the blocks recomputes masks, position
ids and rotary tables. The blocks of other stages return their first input unchanged, and the
layers holding the parameters used before the first block (the embeddings) return the received
activation. Nothing else crosses a cut.

So a cut before block ``k`` runs the model exactly when, in the traced dataflow:

- block ``k``'s first tensor input is block ``k - 1``'s first tensor output (the same value);
- that value is read after the cut by block ``k`` alone;
- every other value read after the cut (by block ``k``, later blocks, or the code after them)
  was made after the cut, or is *recomputed* on every stage: a model input, a buffer, or made
  outside every block and every skipped layer from recomputed values only;
- a parameter read after the cut is a block's at or after ``k``, or one outside the blocks read
  after the last block (the last stage holds it).

An encoder-decoder breaks it: T5's and Whisper's decoder blocks read the encoder's output beside
their own previous hidden state, and the first decoder block starts from the decoder's token
embedding, not from the last encoder block; Perceiver IO's decoder cross-attends from learned
queries to the encoder's output. A value the code between the blocks computed where the model
was traced block by block (a ``glue`` node, its origin unseen) is not proven recomputed either.
The search prices no pipeline that cuts where this fails, and ``--pp`` is refused with the
reason (``cost/search.py``).
"""

from __future__ import annotations

from collections.abc import Sequence

import networkx as nx
import paddle

from autodist.planner.errors import source_place
from autodist.planner.graph import operand_sources
from autodist.planner.ops import GLUE, short_op

Place = tuple[int, int]

_PARAMETER = "builtin.parameter"


def unchained_cuts(
    graph: nx.DiGraph,
    blocks: Sequence[tuple[str, frozenset[int]]],
    first_tensors: dict[str, tuple[Place | None, Place | None]],
    skipped: frozenset[str],
    model: paddle.nn.Layer,
) -> dict[int, str]:
    """``{k: why}`` for every cut before block ``k`` (``1 <= k < len(blocks)``) that a pipeline
    cannot make, by the rule in the module docstring.

    ``blocks``: each block's layer and graph nodes, in forward order; ``first_tensors``: the
    trace's (``TracedProgram.first_tensors``); ``skipped``: the layers a later stage skips (those
    holding the parameters used before the first block, ``analysis.params_before_blocks``).
    """
    block_of = {node: j for j, (_, nodes) in enumerate(blocks) for node in nodes}
    recomputed = _recomputed(graph, block_of, skipped)
    last_end = max(blocks[-1][1]) if blocks and blocks[-1][1] else -1
    owners = [layer + "." for layer, _ in blocks]

    def crosses(k: int, start: int, handed: Place, reader: int, source: int, result: int) -> bool:
        """Whether ``reader`` (after the cut before block ``k``) reads what no stage after it has."""
        data = graph.nodes[source]
        if data["op"] == _PARAMETER and data["param"] is not None:
            owner = next((j for j, prefix in enumerate(owners) if data["param"].startswith(prefix)), None)
            return reader <= last_end if owner is None else owner < k
        handed_on = (source, result) == handed and block_of.get(reader) == k
        return source < start and not recomputed[source] and not handed_on

    cuts = {}
    for k in range(1, len(blocks)):
        start = min(blocks[k][1])
        uncalled = [layer for layer, _ in blocks[k - 1 : k + 1] if layer not in first_tensors]
        if uncalled:
            cuts[k] = (
                f"a pipeline cannot cut before {blocks[k][0]}: {uncalled[0]} is not called as a layer (the model "
                "calls what it holds), so a stage can neither start nor stop there"
            )
            continue
        handed, first_in = first_tensors[blocks[k - 1][0]][1], first_tensors[blocks[k][0]][0]
        if handed is None or first_in != handed:
            cuts[k] = (
                f"a pipeline cannot cut before {blocks[k][0]} ({_place(model, blocks[k][0])}): its first input is "
                f"{_described(graph, first_in, blocks, block_of)}, not the first output of {blocks[k - 1][0]}, "
                "which is what a stage hands on"
            )
            continue
        crossing = next(
            (
                (reader, source, result)
                for reader in sorted(n for n in graph.nodes if n >= start)
                for source, result in operand_sources(graph, reader).values()
                if crosses(k, start, handed, reader, source, result)
            ),
            None,
        )
        if crossing is not None:
            reader, source, result = crossing
            reading = blocks[block_of[reader]][0] if reader in block_of else graph.nodes[reader]["layer"]
            where = (
                "held where a stage after the cut does not hold it (a pipeline holds a parameter with its "
                "block, or outside the blocks on the first or the last stage)"
                if graph.nodes[source]["op"] == _PARAMETER
                else "made before the cut"
            )
            cuts[k] = (
                f"a pipeline cannot cut before {blocks[k][0]}: {reading or 'the model'} "
                f"({_place(model, reading)}) reads {_described(graph, (source, result), blocks, block_of)}, "
                f"{where}; a stage gets only the previous block's first output (as its first block's first "
                "input) and the model's inputs"
            )
    return cuts


def cut_problem(unchained: dict[int, str], stages: list[int]) -> str:
    """Why a pipeline cannot cut the blocks into ``stages`` (one per block, forward order): the
    first of its cuts in ``unchained`` (:func:`unchained_cuts`), or ''. The search asks it of
    every split it prices, ``autodist-plan check`` of a plan's own.

    >>> unchained = {2: "a pipeline cannot cut before dec.0: ..."}
    >>> cut_problem(unchained, [0, 1, 1, 1]), cut_problem(unchained, [0, 0, 1, 1])
    ('', 'a pipeline cannot cut before dec.0: ...')
    """
    return next((unchained[k] for k in range(1, len(stages)) if stages[k] != stages[k - 1] and k in unchained), "")


def _recomputed(graph: nx.DiGraph, block_of: dict[int, int], skipped: frozenset[str]) -> dict[int, bool]:
    """Per node: whether every stage computes it again from the model's inputs (node ids are
    program order, so a node's producers come before it)."""
    prefixes = tuple(layer + "." for layer in skipped)
    recomputed: dict[int, bool] = {}
    for node in sorted(graph.nodes):
        data = graph.nodes[node]
        if data["op"] == "pd_op.data":
            recomputed[node] = True  # a model input: it travels with the activation
        elif data["op"] == _PARAMETER:
            recomputed[node] = data["param"] is None  # a buffer, on every rank
        elif data["op"] == GLUE or node in block_of:
            recomputed[node] = False
        elif data["layer"] in skipped or data["layer"].startswith(prefixes):
            recomputed[node] = False
        else:
            recomputed[node] = all(recomputed[p] for p in graph.predecessors(node))
    return recomputed


def _described(
    graph: nx.DiGraph, value: Place | None, blocks: Sequence[tuple[str, frozenset[int]]], block_of: dict[int, int]
) -> str:
    """A value of the graph in words, by what made it."""
    if value is None or value[0] not in graph:
        return "no value the trace holds"
    data = graph.nodes[value[0]]
    if data["op"] == _PARAMETER:
        return f"parameter {data['param']}" if data["param"] else "a buffer"
    if data["op"] == GLUE:
        return (
            "a value the code between the traced blocks computed (the model was traced block by block), "
            "not proven to come from the model's inputs alone"
        )
    if data["op"] == "pd_op.data":
        return f"the model input {data['attrs'].get('name', '')}".rstrip()
    if value[0] in block_of:
        return f"a value {blocks[block_of[value[0]]][0]} computes ({short_op(data['op'])})"
    return f"a value {data['layer'] or 'the model'} computes ({short_op(data['op'])})"


def _place(model: paddle.nn.Layer, layer: str) -> str:
    """``file:line`` of ``layer``'s forward (the model's for ""), or its class name when Python
    cannot say."""
    owner = model.get_sublayer(layer) if layer else model
    try:
        file, line = source_place(type(owner).forward)
    except (OSError, TypeError):
        return f"{type(owner).__name__}.forward"
    return f"{type(owner).__name__}.forward, {file}:{line}"
