"""Norms and log-sum-exps of a tensor split over 2 gloo ranks equal one device's
(exact_reductions.py): Paddle 3.3.1 alone sums the halves' norms (``Partial(SUM)``) for the
2-norm, the 3-norm and the infinity norms, whole or along the split dim, for ``F.normalize`` and
for the 2-norm's gradient, and the halves' log-sum-exps, for a z-loss's gradient too; its
``cumsum`` along a negative axis runs on each rank's half (and aborts at the split last dim). The
user-loop proof (``clip_grad_norm_``) is tests/loops/test_loops.py's."""

from __future__ import annotations

import json

import pytest

from harness.launcher import launch_ranks

RANK = r"""
import json, sys
import numpy as np, paddle, paddle.distributed as dist
import paddle.nn.functional as F
from autodist.applier.modes.exact_reductions import norm_exactly, restore

dist.init_parallel_env()
mesh = dist.ProcessMesh([0, 1], dim_names=["mp"])
paddle.seed(1)
x = paddle.randn([4, 6])

def whole(t):
    return dist.reshard(t, mesh, [dist.Replicate()]).numpy()

def errors(patched):
    out = {}
    for name, placement in (("rows", dist.Shard(0)), ("columns", dist.Shard(1)), ("pending", dist.Partial())):
        d = dist.shard_tensor(x, mesh, [placement])
        for p in (2.0, 3.0, 1.0, float("inf"), -float("inf")):
            out[f"{name} norm p={p}"] = paddle.linalg.norm(d, p=p), paddle.linalg.norm(x, p=p)
            out[f"{name} norm p={p} axis=1"] = paddle.linalg.norm(d, p=p, axis=1), paddle.linalg.norm(x, p=p, axis=1)
        out[f"{name} normalize"] = F.normalize(d, axis=1), F.normalize(x, axis=1)
        for axis, keep in ((1, False), (-1, True), (0, False), (None, False), ([0, 1], True)):
            out[f"{name} logsumexp axis={axis} keepdim={keep}"] = (
                paddle.logsumexp(d, axis=axis, keepdim=keep), paddle.logsumexp(x, axis=axis, keepdim=keep))
        for axis in (-2, -1, 0, 1) if patched else ():  # Paddle's own: the test below
            out[f"{name} cumsum axis={axis}"] = paddle.cumsum(d, axis), paddle.cumsum(x, axis)
        masked = paddle.where(paddle.arange(6) < 3, x, paddle.full_like(x, -float("inf")))
        out[f"{name} logsumexp of -inf halves"] = (
            paddle.logsumexp(dist.shard_tensor(masked, mesh, [placement]), axis=1), paddle.logsumexp(masked, axis=1))
        w = dist.shard_tensor(x.clone(), mesh, [placement])
        w.stop_gradient = False
        paddle.linalg.norm(w).backward()
        plain = x.clone()
        plain.stop_gradient = False
        paddle.linalg.norm(plain).backward()
        out[f"{name} norm gradient"] = w.grad, plain.grad
        w = dist.shard_tensor(x.clone(), mesh, [placement])
        w.stop_gradient = False
        plain = x.clone()
        plain.stop_gradient = False
        (paddle.logsumexp(w, axis=1) ** 2).sum().backward()  # a z-loss
        (paddle.logsumexp(plain, axis=1) ** 2).sum().backward()
        out[f"{name} logsumexp gradient"] = w.grad, plain.grad
    return {key: float(np.abs(whole(got) - want.numpy()).max()) for key, (got, want) in out.items()}

paddle_own = errors(False)
norm_exactly()
exact = errors(True)
restore()
if dist.get_rank() == 0:
    open(sys.argv[1], "w").write(json.dumps({"paddle": paddle_own, "exact": exact}))
"""


def test_norms_and_logsumexps_of_split_tensors_and_their_gradients_are_one_devices(tmp_path):
    job = launch_ranks(2, ["-c", RANK, str(tmp_path / "errors.json")], workdir=tmp_path, timeout_s=120)
    job.raise_for_failure()
    errors = json.loads((tmp_path / "errors.json").read_text())
    assert max(errors["exact"].values()) < 1e-5, {k: v for k, v in errors["exact"].items() if v >= 1e-5}
    wrong = sorted(k for k, v in errors["paddle"].items() if not v <= 1e-3)  # nan too

    # What Paddle alone gets wrong, so the test shows what the patch is for: every norm and
    # log-sum-exp over the split dim. (A 1-norm is a sum, right; a reduction along the rows' dim
    # 1 or the columns' dim 0 is each rank's own, right.)
    def along_rows_own_dim(k):
        return any(f in k for f in ("axis=1", "axis=-1", "normalize", "halves", "logsumexp gradient"))

    along_split = {
        k
        for k in errors["paddle"]
        if k.startswith(("rows", "columns"))
        and "p=1.0" not in k
        and not (k.startswith("rows") and along_rows_own_dim(k))
        and not (k.startswith("columns") and "axis=0" in k)
    }
    assert along_split <= set(wrong), sorted(along_split - set(wrong))
    assert not any(k.startswith("pending") for k in wrong), wrong  # a pending sum Paddle completes itself


@pytest.mark.parametrize("norm_type", [2.0, 1.0, 0.0, float("inf")])
def test_a_refused_clip_grad_norm_raises_for_every_norm_type_and_other_norms_still_run(norm_type):
    """Where ranks hold gradients no placement describes (ep, pp), every ``norm_type`` of
    ``clip_grad_norm_`` is refused before it scales a gradient; its infinity norm runs through
    ``max``, not ``p_norm``, and went through unrefused before. Norms and maxima elsewhere run."""
    import paddle
    from paddle.nn.utils import clip_grad_norm_

    from autodist.applier.modes.exact_reductions import refuse_clip_grad_norm, restore

    w = paddle.create_parameter([3], "float32")
    (w * paddle.to_tensor([1.0, -4.0, 2.0])).sum().backward()
    refuse_clip_grad_norm("this rank's experts' gradients alone")
    try:
        with pytest.raises(ValueError, match="experts' gradients alone, so its norm is not the model's"):
            clip_grad_norm_([w], max_norm=1.0, norm_type=norm_type)
        assert w.grad.tolist() == [1.0, -4.0, 2.0]  # nothing scaled
        assert float(paddle.linalg.norm(w.grad, norm_type)) > 0 and float(w.grad.abs().max()) == 4.0
    finally:
        restore()
    assert float(clip_grad_norm_([w], max_norm=1.0, norm_type=norm_type)) > 0


PADDLE_CUMSUM = r"""
import sys
import numpy as np, paddle, paddle.distributed as dist

dist.init_parallel_env()
mesh = dist.ProcessMesh([0, 1], dim_names=["mp"])
paddle.seed(1)
x = paddle.randn([4, 6])
if sys.argv[1] == "exact":
    from autodist.applier.modes.exact_reductions import norm_exactly
    norm_exactly()
y = paddle.cumsum(dist.shard_tensor(x, mesh, [dist.Shard(0)]), -2)
error = np.abs(dist.reshard(y, mesh, [dist.Replicate()]).numpy() - paddle.cumsum(x, -2).numpy()).max()
print(f"error {error}", flush=True)
"""


@pytest.mark.parametrize("run", ["paddle", "exact"])
def test_cumsum_along_a_negative_axis_of_a_split_tensor_is_one_devices(run, tmp_path):
    """Paddle 3.3.1's ``cumsum(x, -2)`` of a tensor split along dim 0 runs on each rank's rows
    alone; its rule misreads negative axes (and writes out of bounds: a later op of the same
    process may crash, and ``cumsum(x, -1)`` of a split last dim aborts), so it runs alone here."""
    job = launch_ranks(2, ["-c", PADDLE_CUMSUM, run], workdir=tmp_path, timeout_s=120)
    job.raise_for_failure()
    error = float(job.processes[0].stdout.split("error ")[-1])
    assert error > 1 if run == "paddle" else error < 1e-6, error
