"""Norms of a tensor split over 2 gloo ranks equal one device's (exact_norm.py): Paddle 3.3.1
alone sums the halves' norms (``Partial(SUM)``) for the 2-norm, the 3-norm and the infinity
norms, whole or along the split dim, for ``F.normalize`` and for the 2-norm's gradient. The
user-loop proof (``clip_grad_norm_``) is tests/loops/test_loops.py's."""

from __future__ import annotations

import json

import pytest

from harness.launcher import launch_ranks

RANK = r"""
import json, sys
import numpy as np, paddle, paddle.distributed as dist
import paddle.nn.functional as F
from autodist.applier.modes.exact_norm import norm_exactly, restore

dist.init_parallel_env()
mesh = dist.ProcessMesh([0, 1], dim_names=["mp"])
paddle.seed(1)
x = paddle.randn([4, 6])

def whole(t):
    return dist.reshard(t, mesh, [dist.Replicate()]).numpy()

def errors():
    out = {}
    for name, placement in (("rows", dist.Shard(0)), ("columns", dist.Shard(1)), ("pending", dist.Partial())):
        d = dist.shard_tensor(x, mesh, [placement])
        for p in (2.0, 3.0, 1.0, float("inf"), -float("inf")):
            out[f"{name} norm p={p}"] = paddle.linalg.norm(d, p=p), paddle.linalg.norm(x, p=p)
            out[f"{name} norm p={p} axis=1"] = paddle.linalg.norm(d, p=p, axis=1), paddle.linalg.norm(x, p=p, axis=1)
        out[f"{name} normalize"] = F.normalize(d, axis=1), F.normalize(x, axis=1)
        w = dist.shard_tensor(x.clone(), mesh, [placement])
        w.stop_gradient = False
        paddle.linalg.norm(w).backward()
        plain = x.clone()
        plain.stop_gradient = False
        paddle.linalg.norm(plain).backward()
        out[f"{name} norm gradient"] = w.grad, plain.grad
    return {key: float(np.abs(whole(got) - want.numpy()).max()) for key, (got, want) in out.items()}

paddle_own = errors()
norm_exactly()
exact = errors()
restore()
if dist.get_rank() == 0:
    open(sys.argv[1], "w").write(json.dumps({"paddle": paddle_own, "exact": exact}))
"""


def test_norms_of_split_tensors_and_their_gradients_are_one_devices(tmp_path):
    job = launch_ranks(2, ["-c", RANK, str(tmp_path / "errors.json")], workdir=tmp_path, timeout_s=120)
    job.raise_for_failure()
    errors = json.loads((tmp_path / "errors.json").read_text())
    assert max(errors["exact"].values()) < 1e-5, {k: v for k, v in errors["exact"].items() if v >= 1e-5}
    wrong = sorted(k for k, v in errors["paddle"].items() if v > 1e-3)
    # What Paddle alone gets wrong, so the test shows what the patch is for: every split norm.
    # (A 1-norm is a sum, right; a norm along the rows' unsplit dim 1 is each rank's own rows.)
    along_split = {
        k
        for k in errors["paddle"]
        if k.startswith(("rows", "columns"))
        and "p=1.0" not in k
        and not (k.startswith("rows") and ("axis=1" in k or "normalize" in k))
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

    from autodist.applier.modes.exact_norm import refuse_clip_grad_norm, restore

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
