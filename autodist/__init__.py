"""autodist: plan a PaddlePaddle model's parallelism offline, apply the plan on every rank.

``import autodist`` is cheap: ``apply_plan``, ``plan`` and the checkpoint functions are loaded
on first use, so the import pulls in neither Paddle nor the planner.

Example::

    import autodist
    from autodist import apply_plan, load_checkpoint, save_checkpoint
    with autodist.LazyGuard():                           # optional: no parameter memory yet
        model = build_model()
    model, optimizer, loader = apply_plan(model, optimizer, loader, "plan.json")
    load_checkpoint(model, optimizer, "ckpt")            # saved under any plan, or on one device
    save_checkpoint(model, optimizer, "ckpt", step=100)

    plan = autodist.plan(model, ["input_ids:int64:4x1024"], devices=8, nodes=2, device="h100-sxm")
    autodist.save_plan(plan, "plan.json")
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"
__all__ = [
    "apply_plan", "apply_local_views", "LazyGuard", "save_checkpoint", "load_checkpoint", "export_checkpoint",
    "CheckpointError", "close",
    "plan", "load_plan", "save_plan", "PlanError", "__version__",
]  # fmt: skip

_APPLIER = (
    "apply_plan", "apply_local_views", "LazyGuard", "save_checkpoint", "load_checkpoint", "export_checkpoint", "close",
)  # fmt: skip


def __getattr__(name: str) -> Any:
    if name in _APPLIER:
        import autodist.applier

        return getattr(autodist.applier, name)
    if name == "CheckpointError":
        from autodist.schemas.checkpoint import CheckpointError

        return CheckpointError
    if name == "plan":
        from autodist.planner.driver import plan

        return plan
    if name in ("load_plan", "save_plan", "PlanError"):
        import autodist.schemas

        return getattr(autodist.schemas, name)
    raise AttributeError(f"module 'autodist' has no attribute {name!r}")
