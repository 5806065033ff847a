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

import difflib
import fnmatch
import json
import re
from pathlib import Path
from typing import TYPE_CHECKING, Literal, cast

from autodist.planner.errors import PlannerError
from autodist.schemas import printable
from autodist.schemas.inputs import MAX_TOML_BYTES, InputFileError, parse_toml, read_input_file

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
_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")


class Rules(dict):
    """``{glob: word}``, remembering where each rule was written, so every message names the rule
    as the user wrote it: ``rules.toml line 2: "blocks.*.mlp.fc1" = "rowwise"``.

    >>> Rules({"b.*.fc1": "colwise"}, source="rules.toml", lines={"b.*.fc1": 2}).name("b.*.fc1")
    'rules.toml line 2: "b.*.fc1" = "colwise"'
    >>> Rules({"b.*.fc1": "colwise"}).name("b.*.fc1")
    'rule "b.*.fc1" = "colwise"'
    """

    def __init__(self, rules: dict | None = None, source: str = "", lines: dict[str, int] | None = None):
        super().__init__(rules or {})
        self.source = source
        self.lines = dict(lines or {})

    def name(self, glob: str) -> str:
        word = self[glob]
        rule = f"{json.dumps(glob)} = {json.dumps(word) if isinstance(word, str) else printable(repr(word))[:40]}"
        if glob in self.lines:
            return f"{self.source} line {self.lines[glob]}: {rule}"
        return f"{self.source}: {rule}" if self.source else f"rule {rule}"


def load_rules(path: str | Path) -> Rules:
    """``{glob: word}`` from a TOML file of ``"glob" = "word"`` lines (read within the bounds of
    :func:`autodist.schemas.inputs.parse_toml`), with each rule's line. Every bad rule is named."""
    try:
        data = read_input_file(path, what="rules file", max_bytes=MAX_TOML_BYTES)
        raw = parse_toml(data, str(path), what="rules file")
    except InputFileError as error:
        raise PlannerError(f"--rules {error}") from None
    text = data.decode("utf-8")
    lines = {glob: line for glob in raw if (line := _line_of(text, glob))}
    return Rules(raw, source=f"--rules {printable(str(path))}", lines=lines)


def parse_rules(raw: dict) -> Rules:
    """Validate ``{glob: word}`` (strings only, known words) and spell the words one way;
    raises one :class:`PlannerError` naming every bad rule."""
    rules, problems = _parsed(raw)
    if problems:
        _refuse(problems)
    return rules


def _parsed(raw: dict) -> tuple[Rules, list[str]]:
    """The rules with known words spelled one way, and a problem for each other rule."""
    raw = raw if isinstance(raw, Rules) else Rules(raw)
    known = f"a placement is one of {', '.join(sorted(WORDS))}"
    problems = [f"{raw.name(g)}: {known}" for g, word in raw.items() if not isinstance(word, str) or word not in WORDS]
    good = {glob: WORDS[word] for glob, word in raw.items() if isinstance(word, str) and word in WORDS}
    return Rules(good, raw.source, raw.lines), problems


def canonical_rules(rules: dict[str, str]) -> str:
    """The rules as one sorted line, for the plan's provenance (``check`` and ``make plans``
    re-plan with exactly these)."""
    return ";".join(f"{glob}={word}" for glob, word in sorted(rules.items()))


def apply_rules(analysis: ModelAnalysis, rules: dict[str, str], mp: int = 2) -> Rules:
    """Merge ``rules`` (``{glob: word}``) into ``analysis.blocks`` (in place), then replay each changed block
    through Paddle's SPMD rules at degree ``mp``; returns the rules as applied (words spelled one
    way). Raises one :class:`PlannerError` naming every refused rule (file and line when read
    from a file): an unknown word, a glob that matches no layer (with the
    closest layer names), a layer outside the blocks, and a rule that would make Paddle
    communicate on its own (the op, the layer and the collective it would need)."""
    given = rules if isinstance(rules, Rules) else Rules(rules)
    rules, problems = _parsed(given)
    layers = sorted({fqn.rpartition(".")[0] for fqn, (shape, _) in analysis.params.items() if len(shape) == 2})
    original = {b.layer for b in analysis.blocks}
    blocks = _blocks_for(analysis)
    placeable = Rules({}, rules.source, rules.lines)  # the rules the replay checks: inside blocks
    for glob, word in rules.items():
        named = [lay for lay in layers if fnmatch.fnmatchcase(lay, glob)]
        outside = [lay for lay in named if not any(lay.startswith(b.layer + ".") for b in blocks)]
        if not named:
            problems.append(f"{rules.name(glob)}: matches no layer with a 2-D weight; {_closest(glob, layers)}")
        elif outside:
            problems.append(
                f"{rules.name(glob)}: {outside[0]} is outside the repeated blocks; rules place projections "
                "inside blocks (the embedding and LM head are placed by the planner)"
            )
        else:
            placeable[glob] = word
    refused: dict[tuple[str, ...], str] = {}  # a rule refused in every block is named once, for the first
    for block in blocks:
        for globs, problem in _apply_to_block(analysis, block, placeable, layers, mp):
            refused.setdefault(globs, problem)
    problems += refused.values()
    if problems:
        _refuse(_in_given_order(problems, given, rules))
    analysis.blocks = [b for b in blocks if b.layer in original or b.linears]
    covered = {lin.layer for b in analysis.blocks for lin in b.linears}
    analysis.unmatched = [layer for layer in analysis.unmatched if layer not in covered]
    return rules


def _apply_to_block(
    analysis: ModelAnalysis, block: BlockInfo, rules: Rules, layers: list[str], mp: int
) -> list[tuple[tuple[str, ...], str]]:
    """Set ``block``'s projections as ``rules`` say and replay it; ``(globs, problem)`` for each
    refusal, naming the rule that causes it: a rule the replay refuses on its own is named alone,
    with the first collective it would need; rules refused only together are named together."""
    inside = [lay for lay in layers if lay.startswith(block.layer + ".")]
    touching = [glob for glob in rules if any(fnmatch.fnmatchcase(lay, glob) for lay in inside)]
    if not touching:
        return []
    inferred = list(block.linears)
    refused: list[tuple[tuple[str, ...], str]] = []
    for glob in touching:
        problem = _set_roles(analysis, block, {glob: rules[glob]}, inside) or _first_collective(analysis, block, mp)
        if problem:
            refused.append(((glob,), f"{rules.name(glob)}: {problem} (in {block.layer})"))
        block.linears = list(inferred)
    if refused:
        return refused
    problem = _set_roles(analysis, block, {g: rules[g] for g in touching}, inside)
    together = problem or _first_collective(analysis, block, mp)
    if together:
        names = "; ".join(rules.name(g) for g in touching)
        return [(tuple(touching), f"{names}: each is accepted alone, but together {together} (in {block.layer})")]
    return []


def _set_roles(analysis: ModelAnalysis, block: BlockInfo, rules: dict[str, str], inside: list[str]) -> str:
    """Give the projections of ``block`` that ``rules`` name their roles (in place); a problem or ''."""
    from autodist.planner.recognise.analysis import LinearUse
    from autodist.planner.recognise.roles import projection_uses, split_dim, weight_use

    graph = analysis.graph
    uses = projection_uses(graph)
    for layer in inside:
        word = next((w for glob, w in rules.items() if fnmatch.fnmatchcase(layer, glob)), None)
        if word is None:
            continue
        role = _ROLE[word]
        weight = f"{layer}.weight"
        if weight not in uses:
            return f"the weight of {layer} is not used by a traced projection"
        weight_node, matmul = uses[weight]
        operand, transposed = weight_use(graph, weight_node, matmul)
        bias = f"{layer}.bias" if f"{layer}.bias" in analysis.params else None
        old = next((lin for lin in block.linears if lin.weight == weight), None)
        block.linears = [lin for lin in block.linears if lin.weight != weight]
        if role != "replicate":
            split = cast(Literal["column", "row"], role)  # the roles the words admit, less replicate
            fused = old.fused if old and old.role == role else 1
            name = old.name if old else layer
            block.linears.append(
                LinearUse(layer, weight, bias, split, split_dim(split, operand, transposed), fused, name)
            )
    block.linears.sort(key=lambda lin: uses[lin.weight][1])
    return ""


def _first_collective(analysis: ModelAnalysis, block: BlockInfo, mp: int) -> str:
    """The first collective Paddle would add on its own in ``block`` as placed now, in words, or ''."""
    from autodist.planner.recognise.reshards import block_reshards, gathered_linears
    from autodist.planner.recognise.spmd import is_planned

    graph = analysis.graph
    gathered = frozenset(lin.layer for lin in gathered_linears(block))  # the plan's reshard hooks
    reshards = block_reshards(analysis, block, mp, gathered)
    problems = [r for r in reshards if r.collective and not is_planned(graph, r)]
    if not problems:
        return ""
    r = problems[0]
    node = graph.nodes[r.node]
    collective = r.collective or ""
    article = "an" if collective[:1] in ("a", "e", "i", "o", "u") else "a"
    return (
        f"with it {node['op']} in {node['layer']} would need {article} {collective} of operand {r.operand} "
        f"({r.before.placement()} -> {r.after.placement()}) that Paddle adds on its own; split the projections "
        "that feed it and the one that contracts it together"
    )


def _closest(glob: str, layers: list[str]) -> str:
    """The layer names (or patterns, indices as ``*``) closest to a glob that matched none.

    >>> _closest("blocks.*.mpl.fc1", ["blocks.0.mlp.fc1", "blocks.1.mlp.fc1", "blocks.0.attn.qkv"])
    'did you mean "blocks.*.mlp.fc1"?'
    """
    patterns = sorted({".".join("*" if part.isdigit() else part for part in layer.split(".")) for layer in layers})
    candidates = patterns if "*" in glob else layers + patterns
    close = difflib.get_close_matches(glob, candidates, n=3, cutoff=0.6)
    best = difflib.SequenceMatcher(None, glob, close[0]).ratio() if close else 0.0
    close = [c for c in close if difflib.SequenceMatcher(None, glob, c).ratio() >= best - 0.05]
    if close:
        return "did you mean " + " or ".join(json.dumps(c) for c in close) + "?"
    shown = ", ".join(patterns[:6]) + (", ..." if len(patterns) > 6 else "")
    return f"the layers with 2-D weights are {shown or 'none'}"


def _line_of(text: str, key: str) -> int | None:
    """The line of ``text`` where the top-level TOML key ``key`` is given, or None."""
    spellings = [json.dumps(key), f"'{key}'"] + ([key] if _BARE_KEY.fullmatch(key) else [])
    pattern = re.compile(r"\s*(?:" + "|".join(re.escape(s) for s in spellings) + r")\s*=")
    return next((n for n, line in enumerate(text.splitlines(), 1) if pattern.match(line)), None)


def _in_given_order(problems: list[str], given: Rules, parsed: Rules) -> list[str]:
    """``problems`` (each starting with the name of its rule, as given or as parsed) in the order
    the rules were given: a file's lines."""
    position = {given.name(g): i for i, g in enumerate(given)}
    position |= {parsed.name(g): i for i, g in enumerate(given) if g in parsed}

    def place(problem: str) -> int:
        return next((i for name, i in position.items() if problem.startswith(f"{name}: ")), len(given))

    return sorted(problems, key=place)


def _refuse(problems: list[str], reason: str = "") -> None:
    """One :class:`PlannerError` for every bad rule: the first on the error line, all in detail."""
    suffix = f": {reason}" if reason else ""
    if len(problems) == 1:
        raise PlannerError(problems[0] + suffix)
    raise PlannerError(
        f"{len(problems)} rules are refused{suffix}", detail="\n".join(f"- {problem}" for problem in problems)
    )


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
