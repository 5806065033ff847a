"""A strategy in words, said the same way by the planner's search, its commands and benches.

Low-level vocabulary like the placements (:mod:`autodist.schemas.vocabulary`): the search names
rejected strategies with it, the review commands show plans with it; and runs of layers
(``blocks.0-11``), which the search's reasons and the review commands name alike.
"""

from __future__ import annotations

from typing import Literal

from autodist.schemas.plan import Strategy


def strategy_text(strategy: Strategy, form: Literal["long", "short"] = "long") -> str:
    """A strategy in words: every choice it makes, said the same way by every command.

    ``"long"`` for a summary (``show``, the plan command), ``"short"`` for one row of a table
    (``--explain``, rejected strategies); both name the same fields in the same order.

    >>> s = Strategy(dp=2, mp=4, pp=2, sequence_parallel=True, sharding_stage=1, micro_batches=4, schedule="VPP",
    ...              virtual_stages=2, recompute="full")
    >>> strategy_text(s)
    'dp2 · mp4 · pp2, sequence parallel on, ZeRO stage 1, 4 micro-batches, schedule VPP (2 chunks per stage), recompute full'
    >>> strategy_text(s, "short")
    'dp2 mp4 pp2 sp zero1 m4 VPP v2 recompute-full'
    >>> strategy_text(Strategy(dp=8), "short"), strategy_text(Strategy(dp=8))
    ('dp8 mp1 pp1 m1', 'dp8 · mp1 · pp1, sequence parallel off, ZeRO stage 0, 1 micro-batch')
    >>> strategy_text(Strategy(dp=4, ep=2), "short")
    'dp4 mp1 pp1 m1 ep2'

    """
    sp, zero, m, v = (
        strategy.sequence_parallel,
        strategy.sharding_stage,
        strategy.micro_batches,
        strategy.virtual_stages,
    )
    axes = [f"dp{strategy.dp}", f"mp{strategy.mp}", f"pp{strategy.pp}"]
    words: list[tuple[str, str | None]] = [  # (long, short); the short form leaves out what is off
        (" · ".join(axes), " ".join(axes)),
        (f"sequence parallel {'on' if sp else 'off'}", "sp" if sp else None),
        (f"ZeRO stage {zero}", f"zero{zero}" if zero else None),
        (f"{m} micro-batch{'es' if m != 1 else ''}", f"m{m}"),
    ]
    if strategy.schedule != "none":
        words.append(
            (
                f"schedule {strategy.schedule}" + (f" ({v} chunks per stage)" if v > 1 else ""),
                strategy.schedule + (f" v{v}" if v > 1 else ""),
            )
        )
    if strategy.recompute != "none":
        words.append((f"recompute {strategy.recompute}", f"recompute-{strategy.recompute}"))
    if strategy.ep > 1:
        words.append((f"experts over {strategy.ep} dp ranks (ep{strategy.ep})", f"ep{strategy.ep}"))
    if form == "long":
        return ", ".join(long for long, _ in words)
    return " ".join(short for _, short in words if short)


def index_ranges(indices: list[int]) -> str:
    """``[0, 1, 2, 3, 8]`` -> ``"0-3,8"``."""
    spans: list[list[int]] = []
    for i in sorted(set(indices)):
        if spans and i == spans[-1][1] + 1:
            spans[-1][1] = i
        else:
            spans.append([i, i])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)


def layers_text(layers: list[str]) -> str:
    """Layers that differ in one index only, named at once; others listed.

    >>> layers_text([f"blocks.{i}" for i in range(12)]), layers_text(["h.0", "h.2", "h.3"])
    ('blocks.0-11', 'h.0,2-3')
    >>> layers_text(["encoder.0", "decoder.0"]), layers_text(["h.0", "h.0.mlp"])
    ('encoder.0, decoder.0', 'h.0, h.0.mlp')
    """
    split = [layer.split(".") for layer in layers]
    if len(layers) > 1 and len({len(parts) for parts in split}) == 1:
        varying = {i for parts in split for i, part in enumerate(parts) if part != split[0][i]}
        i = min(varying, default=0)
        if len(varying) == 1 and all(parts[i].isascii() and parts[i].isdigit() for parts in split):
            parts = list(split[0])
            parts[i] = index_ranges([int(p[i]) for p in split])
            return ".".join(parts)
    return ", ".join(layers)
