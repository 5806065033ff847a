"""User rules: tensor-parallel placements by layer FQN glob, in the words of Paddle's
``dist.parallelize`` (``colwise``, ``rowwise``, ``replicate``), for what inference does not
find. They are merged into the analysis's blocks and pass the same SPMD replay as inferred
placements: a rule that would make Paddle communicate on its own is refused with the reason.

A rules file (``--rules rules.toml``)::

    "blocks.*.mlp.fc1" = "colwise"
    "blocks.*.mlp.fc2" = "rowwise"

Example::

    >>> parse_rules({"blocks.*.mlp.fc1": "colwise", "blocks.*.mlp.fc2": "RowWiseParallel"})
    {'blocks.*.mlp.fc1': 'colwise', 'blocks.*.mlp.fc2': 'rowwise'}
    >>> canonical_rules({"b.*.fc2": "rowwise", "b.*.fc1": "colwise"})
    'b.*.fc1=colwise;b.*.fc2=rowwise'
"""

from __future__ import annotations

import fnmatch
from pathlib import Path
from typing import TYPE_CHECKING, Literal, cast

from autodist.planner.errors import PlannerError
from autodist.schemas.inputs import InputFileError, load_toml

if TYPE_CHECKING:
    from autodist.planner.recognise.analysis import BlockInfo, ModelAnalysis

#: dist.parallelize's words, and its class names for them.
WORDS = {
    "colwise": "colwise",
    "ColWiseParallel": "colwise",
    "rowwise": "rowwise",
    "RowWiseParallel": "rowwise",
    "replicate": "replicate",
}
_ROLE = {"colwise": "column", "rowwise": "row", "replicate": "replicate"}


def load_rules(path: str | Path) -> dict[str, str]:
    """``{glob: word}`` from a TOML file of ``"glob" = "word"`` lines."""
    try:
        raw = load_toml(path, what="rules file")
    except InputFileError as error:
        raise PlannerError(f"--rules {error}") from None
    return parse_rules(raw, str(path))


def parse_rules(raw: dict, source: str = "rules") -> dict[str, str]:
    """Validate ``{glob: word}`` (strings only, known words) and spell the words one way."""
    rules = {}
    for glob, word in raw.items():
        if not isinstance(word, str) or word not in WORDS:
            raise PlannerError(f"{source}: {glob!r} = {word!r}: a placement is one of {', '.join(sorted(WORDS))}")
        rules[glob] = WORDS[word]
    return rules


def canonical_rules(rules: dict[str, str]) -> str:
    """The rules as one sorted line, for the plan's provenance (``check`` and ``make plans``
    re-plan with exactly these)."""
    return ";".join(f"{glob}={word}" for glob, word in sorted(rules.items()))


def apply_rules(analysis: ModelAnalysis, rules: dict[str, str], mp: int = 2) -> None:
    """Merge ``rules`` (``{glob: word}``) into ``analysis.blocks`` (in place), then replay each changed block
    through Paddle's SPMD rules at degree ``mp``; raises :class:`PlannerError` naming the rule,
    the op and the collective when a rule would make Paddle communicate on its own."""
    from autodist.planner.recognise.analysis import LinearUse
    from autodist.planner.recognise.roles import projection_uses, split_dim, weight_use
    from autodist.planner.recognise.reshards import block_reshards
    from autodist.planner.recognise.spmd import is_planned

    if not rules:
        return
    rules = {glob: _ROLE[word] for glob, word in parse_rules(rules).items()}
    graph = analysis.graph
    uses = projection_uses(graph)
    layers = sorted({fqn.rpartition(".")[0] for fqn, (shape, _) in analysis.params.items() if len(shape) == 2})
    for glob in rules:
        if not any(fnmatch.fnmatchcase(layer, glob) for layer in layers):
            raise PlannerError(
                f"rule {glob!r}: matches no layer with a 2-D weight (e.g. {layers[0] if layers else 'none'})"
            )
    original = {b.layer for b in analysis.blocks}
    blocks = _blocks_for(analysis)
    outside = [
        lay
        for lay in layers
        if any(fnmatch.fnmatchcase(lay, g) for g in rules) and not any(lay.startswith(b.layer + ".") for b in blocks)
    ]
    if outside:
        raise PlannerError(
            f"rule for {outside[0]}: the layer is outside the repeated blocks; rules place projections "
            "inside blocks (the embedding and LM head are placed by the planner)"
        )
    for block in blocks:
        changed = False
        for layer in [lay for lay in layers if lay.startswith(block.layer + ".")]:
            role = next((r for glob, r in rules.items() if fnmatch.fnmatchcase(layer, glob)), None)
            if role is None:
                continue
            weight = f"{layer}.weight"
            if weight not in uses:
                raise PlannerError(f"rule for {layer}: its weight is not used by a traced projection")
            weight_node, matmul = uses[weight]
            operand, transposed = weight_use(graph, weight_node, matmul)
            bias = f"{layer}.bias" if f"{layer}.bias" in analysis.params else None
            old = next((lin for lin in block.linears if lin.weight == weight), None)
            block.linears = [lin for lin in block.linears if lin.weight != weight]
            if role != "replicate":
                split = cast(Literal["column", "row"], role)  # the roles load_rules admits, less replicate
                block.linears.append(
                    LinearUse(
                        layer,
                        weight,
                        bias,
                        split,
                        split_dim(split, operand, transposed),
                        old.fused if old and old.role == role else 1,
                        old.name if old else layer,
                    )
                )
            changed = True
        if changed:
            block.linears.sort(key=lambda lin: uses[lin.weight][1])
            problems = [r for r in block_reshards(analysis, block, mp) if r.collective and not is_planned(graph, r)]
            if problems:
                r = problems[0]
                raise PlannerError(
                    f"the rules for {block.layer} are refused: {graph.nodes[r.node]['op']} in {graph.nodes[r.node]['layer']} "
                    f"would need a {r.collective} of operand {r.operand} ({r.before.placement()} -> {r.after.placement()}) "
                    "that Paddle adds on its own; split the projections that feed it and the one that contracts it together"
                )
    analysis.blocks = [b for b in blocks if b.layer in original or b.linears]
    covered = {lin.layer for b in analysis.blocks for lin in b.linears}
    analysis.unmatched = [layer for layer in analysis.unmatched if layer not in covered]


def _blocks_for(analysis: ModelAnalysis) -> list[BlockInfo]:
    """The analysis's blocks, plus a block for each repeated layer inference left without one
    (so rules can split what nothing was recognised in), in program order."""
    from autodist.planner.recognise.analysis import BlockInfo

    known = {b.layer: b for b in analysis.blocks}
    for found in analysis.recognised:
        if found.layer not in known:
            block = BlockInfo(found.layer, "transformer_block", found.nodes, [], [], 0, 0, 0, 0, 0, "rules")
            known[found.layer] = block
    return sorted(known.values(), key=lambda b: min(b.nodes) if b.nodes else 0)
