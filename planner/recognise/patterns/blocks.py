"""Whole-block patterns: a pre-norm transformer block composed from one norm, one attention and
one MLP variant (``x + attn(norm(x))``, then ``h + mlp(norm(h))``), and standalone patterns of a
single part for tests and for layers outside blocks.

Every combination of the variants in :mod:`.norm`, :mod:`.attention` and :mod:`.mlp` is a
candidate; the matcher keeps only those whose op counts equal the block's before it runs any
isomorphism search, so the size of the library costs almost nothing.

Example::

    >>> [p.kind for p in block_patterns() if p.description.startswith("rms_norm+attn(q|k|v,rope,mask)+mlp(swiglu_op)")][:1]
    ['llama_decoder']
"""

from __future__ import annotations

import functools
from collections import Counter
from dataclasses import dataclass
from typing import Callable

import networkx as nx

from autodist.planner.recognise.patterns.attention import ATTENTIONS, Attention
from autodist.planner.recognise.patterns.mlp import MLPS, Mlp
from autodist.planner.recognise.patterns.norm import LAYER_NORM, NORMS
from autodist.planner.recognise.patterns.parts import PARAM, PORT, Part, PatternBuilder, residual


@dataclass(frozen=True)
class Pattern:
    """A pattern for the matcher: ``build`` adds its parts to a :class:`PatternBuilder`.
    ``histogram`` counts its compute ops (everything but ports and parameters), the cheap
    necessary condition checked before any search; ``graph`` is built only when needed."""

    kind: str
    description: str
    build: Callable[[PatternBuilder], object]

    @functools.cached_property
    def histogram(self) -> Counter:
        dry_run = PatternBuilder(graph=None)
        self.build(dry_run)
        return dry_run.histogram

    @functools.cached_property
    def graph(self) -> nx.DiGraph:
        builder = PatternBuilder()
        self.build(builder)
        return builder.graph


def compute_histogram(graph: nx.DiGraph) -> Counter:
    """``Counter`` of op names over the compute nodes of a pattern or view graph."""
    return Counter(d["op"] for _, d in graph.nodes(data=True) if d["op"] not in (PORT, PARAM, "input"))


def block_kind(norm: Part, attention: Attention, mlp: Mlp, sandwich: bool = False) -> str:
    """A family name for reports: what a reader would call a block with these parts."""
    if sandwich and attention.qk_norm:
        return "gemma3_decoder"
    if norm is LAYER_NORM and mlp.kind == "gelu":
        return "gpt_block"
    if attention.fused_qkv and mlp.kind == "fused_swiglu":
        return "phi3_decoder"
    if not attention.fused_qkv and mlp.kind.startswith("swiglu"):
        return "llama_decoder"
    return "transformer_block"


def pre_norm_block(norm: Part, attention: Attention, mlp: Mlp, sandwich: bool = False) -> Pattern:
    """``h = x + attn(norm(x))``, then ``h + mlp(norm(h))``; ``sandwich`` adds a norm on each
    sub-layer's output before its residual add (Gemma's post-attention / post-feedforward norms)."""
    def build(b: PatternBuilder) -> None:
        x = b.port("hidden")
        attn = attention.build(b, "attn", b.add(norm, "norm_attn", x=x))
        attn = b.add(norm, "norm_attn_out", x=attn) if sandwich else attn
        h = b.add(residual(), "residual_attn", x=x, y=attn)
        ffn = mlp.build(b, "mlp", b.add(norm, "norm_mlp", x=h))
        ffn = b.add(norm, "norm_mlp_out", x=ffn) if sandwich else ffn
        b.add(residual(), "residual_mlp", x=h, y=ffn)

    description = f"{norm.name}{'(sandwich)' if sandwich else ''}+{attention.name}+{mlp.name}"
    return Pattern(block_kind(norm, attention, mlp, sandwich), description, build)


@functools.lru_cache(maxsize=1)
def block_patterns() -> tuple[Pattern, ...]:
    """All block candidates (graphs built lazily, the first time a histogram fits)."""
    return tuple(pre_norm_block(n, a, m, sandwich)
                 for sandwich in (False, True) for n in NORMS for a in ATTENTIONS for m in MLPS)


def mlp_pattern(mlp: Mlp) -> Pattern:
    """An MLP alone, e.g. to match a layer that is just an MLP."""
    return Pattern("mlp", mlp.name, lambda b: mlp.build(b, "mlp", b.port("x")))


def part_pattern(part: Part) -> Pattern:
    """A single part alone (a norm layer, ...), its inputs as ports."""
    return Pattern(part.name, part.name, lambda b: b.add(part, part.name, **{n: b.port(n) for n in part.inputs}))
