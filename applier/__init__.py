"""Run-time phase: ``apply_plan`` on every rank. Light: no tracing, no networkx, no planner.

``import autodist.applier`` loads nothing heavy; Paddle is imported when ``apply_plan`` is
first looked up. (Paddle 3.3.1 itself imports ``click`` through ``httpx`` when click is
installed, so only a Paddle-free import can promise not to load it.)

Example::

    from autodist.applier import apply_plan
    model, optimizer, loader = apply_plan(model, optimizer, loader, "plan.json")
"""

from __future__ import annotations

from typing import Any

__all__ = ["apply_plan"]


def __getattr__(name: str) -> Any:
    if name == "apply_plan":
        from autodist.applier.apply import apply_plan

        return apply_plan
    raise AttributeError(f"module 'autodist.applier' has no attribute {name!r}")
