"""autodist: plan a PaddlePaddle model's parallelism offline, apply the plan on every rank.

``import autodist`` is cheap: ``apply_plan`` is loaded on first use, so the import pulls in
neither Paddle nor the planner.

Example::

    from autodist import apply_plan
    model, optimizer, loader = apply_plan(model, optimizer, loader, "plan.json")
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"
__all__ = ["apply_plan", "load_plan", "PlanError", "__version__"]


def __getattr__(name: str) -> Any:
    if name == "apply_plan":
        from autodist.applier import apply_plan

        return apply_plan
    if name in ("load_plan", "PlanError"):
        import autodist.schemas

        return getattr(autodist.schemas, name)
    raise AttributeError(f"module 'autodist' has no attribute {name!r}")
