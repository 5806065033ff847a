"""Attention, composed from projections, optional rotary embedding, the softmax core and the
output projection. Heads, GQA head repetition, KV-cache concatenation and the q/k/v split of a
fused projection are layout ops, which the matcher's view contracts, so one core serves MHA and
GQA, fused and unfused projections.

Example::

    >>> b = PatternBuilder()
    >>> out = Attention(fused_qkv=True, qkv_bias=True, o_bias=True, rope=False, mask=False).build(b, "attn", b.port("x"))
    >>> sorted(d["linear"] for _, d in b.graph.nodes(data=True) if d["op"] == "param" and "linear" in d)
    ['o', 'qkv']
"""

from __future__ import annotations

from dataclasses import dataclass

from autodist.planner.recognise.patterns.norm import RMS_NORM
from autodist.planner.recognise.patterns.parts import Part, PatternBuilder, linear

#: Rotary embedding in the ``rotate_half`` form: ``x * cos + rotate_half(x) * sin`` (the
#: half-swap and negation are layout / constant ops and vanish from the view).
ROPE = Part(
    "rope",
    nodes={"x_cos": "multiply", "x_sin": "multiply", "out": "add"},
    edges=(("x", "x_cos"), ("cos", "x_cos"), ("x", "x_sin"), ("sin", "x_sin"), ("x_cos", "out"),
           ("x_sin", "out")),
    inputs=("x", "cos", "sin"),
    output="out",
)

#: ``softmax(q @ k^T + mask) @ v`` with the scaling contracted away.
SOFTMAX_CORE_MASKED = Part(
    "softmax_core_masked",
    nodes={"scores": "matmul", "masked": "add", "probs": "softmax", "context": "matmul"},
    edges=(("q", "scores", 0), ("k", "scores", 1), ("scores", "masked"), ("mask", "masked"),
           ("masked", "probs"), ("probs", "context", 0), ("v", "context", 1)),
    inputs=("q", "k", "v", "mask"),
    output="context",
)

#: The same without a mask input (causal masks built from constants fold away).
SOFTMAX_CORE = Part(
    "softmax_core",
    nodes={"scores": "matmul", "probs": "softmax", "context": "matmul"},
    edges=(("q", "scores", 0), ("k", "scores", 1), ("scores", "probs"), ("probs", "context", 0),
           ("v", "context", 1)),
    inputs=("q", "k", "v"),
    output="context",
)


@dataclass(frozen=True)
class Attention:
    """One attention variant; :meth:`build` adds it to a pattern and returns its output.
    ``qk_norm``: q and k go through an RMSNorm over ``head_dim`` before RoPE (Gemma3, Qwen3)."""

    fused_qkv: bool
    qkv_bias: bool
    o_bias: bool
    rope: bool
    mask: bool
    qk_norm: bool = False

    @property
    def name(self) -> str:
        bits = ["qkv" if self.fused_qkv else "q|k|v"]
        bits += ["qkv_bias"] if self.qkv_bias else []
        bits += ["o_bias"] if self.o_bias else []
        bits += ["qk_norm"] if self.qk_norm else []
        bits += ["rope"] if self.rope else []
        bits += ["mask"] if self.mask else []
        return "attn(" + ",".join(bits) + ")"

    def build(self, b: PatternBuilder, prefix: str, x: str) -> str:
        if self.fused_qkv:
            q = k = v = b.add(linear("qkv", "column", self.qkv_bias, fused=3), f"{prefix}.qkv", x=x)
        else:
            q, k, v = (b.add(linear(n, "column", self.qkv_bias), f"{prefix}.{n}", x=x) for n in "qkv")
        if self.qk_norm:
            q = b.add(RMS_NORM, f"{prefix}.q_norm", x=q)
            k = b.add(RMS_NORM, f"{prefix}.k_norm", x=k)
        if self.rope:
            cos, sin = b.port(f"{prefix}.cos"), b.port(f"{prefix}.sin")
            q = b.add(ROPE, f"{prefix}.rope_q", x=q, cos=cos, sin=sin)
            k = b.add(ROPE, f"{prefix}.rope_k", x=k, cos=cos, sin=sin)
        if self.mask:
            context = b.add(SOFTMAX_CORE_MASKED, f"{prefix}.core", q=q, k=k, v=v, mask=b.port(f"{prefix}.mask"))
        else:
            context = b.add(SOFTMAX_CORE, f"{prefix}.core", q=q, k=k, v=v)
        return b.add(linear("o", "row", self.o_bias), f"{prefix}.o", x=context)


ATTENTIONS = tuple(
    Attention(fused, qkv_bias, o_bias, rope, mask, qk_norm)
    for fused in (False, True)
    for qkv_bias in (False, True)
    for o_bias in (False, True)
    for rope in (False, True)
    for mask in (False, True)
    for qk_norm in (False, True)
)
