"""Shared test set-up: the ``gpu`` marker's skip, single-device reference runs shared by
every multi-process test file of one session (each configuration is trained once), and a
clean process environment for every test."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(autouse=True)
def restore_environment():
    """Undo what a test leaves in ``os.environ``. Paddle itself writes process-wide switches
    there (``dist.ShardingStage3`` sets ``skip_sharding3_output_reshard=1``), and the harness
    hands ``os.environ`` to every rank it starts: a ZeRO-3 test run in-process once made later
    dp x mp jobs fail in AdamW with "Tensor Axis is sharded by two different mesh dimensions"."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture(autouse=True)
def restore_global_mesh():
    """Undo a global mesh a test leaves behind. ``dist.parallelize`` with a pipeline config sets
    Paddle's process-wide mesh (``auto_parallel.interface._g_mesh``); later in-process tests then
    see a ``pp`` mesh and Paddle's recompute asks for a process group that was never created."""
    import sys

    interface = sys.modules.get("paddle.distributed.auto_parallel.interface")
    saved = getattr(interface, "_g_mesh", None)
    yield
    interface = sys.modules.get("paddle.distributed.auto_parallel.interface")
    if interface is not None:
        interface._g_mesh = saved


@pytest.hookimpl(tryfirst=True)
def pytest_xdist_make_scheduler(config, log):
    """``--dist loadfile`` (``make test``) as harness/scheduling.py sends it: some files to one
    worker together, the multi-process ones first."""
    if config.getvalue("dist") != "loadfile":
        return None
    from harness.scheduling import make_scheduler

    return make_scheduler(config, log)


def pytest_collection_modifyitems(config, items):
    """In a pytest-xdist worker, the tests in harness/scheduling.py's sending order. Skip ``@pytest.mark.gpu``
    tests on machines without a CUDA device, saying why. Paddle is imported only when such a
    test was collected, so the rest of the suite does not pay for it."""
    if hasattr(config, "workerinput"):
        from harness.scheduling import in_sending_order

        items[:] = in_sending_order(items)
    gpu_items = [item for item in items if item.get_closest_marker("gpu")]
    if not gpu_items:
        return
    import paddle

    if paddle.device.cuda.device_count() > 0:
        return
    skip = pytest.mark.skip(
        reason="needs a CUDA device: paddle.device.cuda.device_count() == 0 here "
        "(the CPU wheel lacks the kernels or the cross-mesh reshard this test exercises)"
    )
    for item in gpu_items:
        item.add_marker(skip)


@pytest.fixture(scope="session")
def reference_runs(tmp_path_factory):
    """:class:`harness.runner.ReferenceRuns`: single-device results, computed once per
    (workload, optimizer, steps, seed) for the whole session."""
    from harness.runner import ReferenceRuns

    return ReferenceRuns(tmp_path_factory.mktemp("reference"))
