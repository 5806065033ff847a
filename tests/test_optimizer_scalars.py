"""A 0-d parameter (HF CLIP's ``logit_scale``) updated through Paddle's ``dist.shard_optimizer``
as apply_plan wraps the optimizer (``applier/placement/optimizer.shard_optimizer``), on 2 gloo
ranks: AdamW with ``ClipGradByGlobalNorm``, as one device updates it. Before, the first step
raised in Paddle 3.3.1 (``IndexError`` reading ``param.shape[0]``; then, the clipped gradient made
``[1]``, ``param, grad, momentum1 and momentum2 have different ndim``)."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.multiprocess

RANK = """
import json
import paddle, paddle.distributed as dist
from types import SimpleNamespace
from autodist.applier.placement.optimizer import shard_optimizer

def step(distributed):
    p = paddle.create_parameter([], "float32", default_initializer=paddle.nn.initializer.Constant(2.0))
    x = paddle.arange(12, dtype="float32").reshape([3, 4]) / 10
    if distributed:
        mesh = dist.ProcessMesh([0, 1], dim_names=["mp"])
        p = dist.shard_tensor(p, mesh, [dist.Replicate()])
        x = dist.shard_tensor(x, mesh, [dist.Replicate()])
    opt = paddle.optimizer.AdamW(0.1, parameters=[p], weight_decay=0.01, grad_clip=paddle.nn.ClipGradByGlobalNorm(0.5))
    if distributed:
        opt = shard_optimizer(opt, SimpleNamespace(strategy=SimpleNamespace(sharding_stage=0)))
    for _ in range(2):
        (paddle.matmul(x, x.t()) * p.exp()).mean().backward()
        opt.step()
        opt.clear_grad()
    return float(p.numpy()), list(p.shape)

dist.init_parallel_env()
print(json.dumps({"distributed": step(True), "one": step(False)}))
"""


def test_a_0d_parameter_under_adamw_and_global_norm_clip_steps_as_on_one_device(tmp_path):
    from harness.launcher import launch_ranks

    job = launch_ranks(2, ["-c", RANK], workdir=tmp_path, timeout_s=120)
    job.raise_for_failure()
    for process in job.processes:
        report = json.loads(process.stdout.strip().splitlines()[-1])
        (value, shape), (want, want_shape) = report["distributed"], report["one"]
        assert shape == want_shape == [] and abs(value - want) < 1e-6 and value != 2.0, report
