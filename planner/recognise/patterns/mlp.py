"""Feed-forward parts: SwiGLU (as Paddle's ``swiglu`` op or as ``silu(gate) * up``), SwiGLU with
one fused gate|up projection, and the GPT-style GELU MLP.

Example::

    >>> b = PatternBuilder()
    >>> out = SWIGLU_SILU.build(b, "mlp", b.port("x"))
    >>> sorted(d["op"] for _, d in b.graph.nodes(data=True) if d.get("part") == "swiglu_silu")
    ['multiply', 'silu']
"""

from __future__ import annotations

from dataclasses import dataclass

from autodist.planner.recognise.patterns.parts import Part, PatternBuilder, linear

_SWIGLU_OP = Part("swiglu_op", {"act": "swiglu"}, (("gate", "act", 0), ("up", "act", 1)), ("gate", "up"), "act")
_GELU = Part("gelu", {"act": "gelu"}, (("x", "act"),), ("x",), "act")


def _gated(name: str, activation: str) -> Part:
    """``activation(gate) * up``."""
    return Part(name, {activation: activation, "act": "multiply"},
                (("gate", activation), (activation, "act"), ("up", "act")), ("gate", "up"), "act")


_GATED = {"swiglu_silu": _gated("swiglu_silu", "silu"), "fused_swiglu": _gated("swiglu_silu", "silu"),
          "geglu": _gated("geglu", "gelu"), "fused_geglu": _gated("geglu", "gelu")}


@dataclass(frozen=True)
class Mlp:
    """An MLP variant: ``kind`` is ``swiglu_op`` (Paddle's fused op), ``swiglu_silu``
    (``silu(gate) * up``), ``geglu`` (``gelu(gate) * up``), ``fused_swiglu`` / ``fused_geglu``
    (gate|up in one projection) or ``gelu`` (``fc_out(gelu(fc_in(x)))``)."""

    kind: str
    bias: bool = False

    @property
    def name(self) -> str:
        return f"mlp({self.kind}{',bias' if self.bias else ''})"

    def build(self, b: PatternBuilder, prefix: str, x: str) -> str:
        if self.kind == "gelu":
            hidden = b.add(linear("fc_in", "column", self.bias), f"{prefix}.fc_in", x=x)
            act = b.add(_GELU, f"{prefix}.act", x=hidden)
            return b.add(linear("fc_out", "row", self.bias), f"{prefix}.fc_out", x=act)
        if self.kind.startswith("fused_"):
            # gate and up are the two halves of one projection; the split is a layout op.
            gate = up = b.add(linear("gate_up", "column", self.bias, fused=2), f"{prefix}.gate_up", x=x)
        else:
            gate = b.add(linear("gate", "column", self.bias), f"{prefix}.gate", x=x)
            up = b.add(linear("up", "column", self.bias), f"{prefix}.up", x=x)
        act = b.add(_SWIGLU_OP if self.kind == "swiglu_op" else _GATED[self.kind], f"{prefix}.act", gate=gate, up=up)
        return b.add(linear("down", "row", self.bias), f"{prefix}.down", x=act)


SWIGLU_OP, SWIGLU_SILU, FUSED_SWIGLU = Mlp("swiglu_op"), Mlp("swiglu_silu"), Mlp("fused_swiglu")
GELU_MLP = Mlp("gelu", bias=True)
MLPS = tuple(Mlp(kind, bias) for kind in ("swiglu_op", "swiglu_silu", "fused_swiglu", "geglu", "fused_geglu", "gelu")
             for bias in (False, True))
