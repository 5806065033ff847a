"""Run-time phase: ``apply_plan`` on every rank, and checkpoints that survive re-planning.
Light: no tracing, no networkx, no planner.

``import autodist.applier`` loads nothing heavy; Paddle is imported when ``apply_plan`` or a
checkpoint function is first looked up. (Paddle 3.3.1 itself imports ``click`` through
``httpx`` when click is installed, so only a Paddle-free import can promise not to load it.)

Example::

    from autodist.applier import apply_plan, save_checkpoint
    model, optimizer, loader = apply_plan(model, optimizer, loader, "plan.json")
    save_checkpoint(model, optimizer, "ckpt", step=100)
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "apply_plan",
    "apply_local_views",
    "LazyGuard",
    "save_checkpoint",
    "load_checkpoint",
    "export_checkpoint",
    "close",
]


def __getattr__(name: str) -> Any:
    if name == "apply_plan":
        from autodist.applier.apply import apply_plan

        return apply_plan
    if name == "apply_local_views":
        from autodist.applier.modes.exported_views import apply_local_views

        return apply_local_views
    if name == "LazyGuard":
        from autodist.applier.placement.lazy import LazyGuard

        return LazyGuard
    if name == "close":
        from autodist.applier.apply import close

        return close
    if name in ("save_checkpoint", "load_checkpoint", "export_checkpoint"):
        from autodist.applier.checkpoint import save_load

        return getattr(save_load, name)
    raise AttributeError(f"module 'autodist.applier' has no attribute {name!r}")
