"""The loader ``apply_plan`` returns resumes where a checkpoint was taken (issue #35 item 4), in
one process: stopped after any step of three passes, shuffled or not, and resumed through
``load_checkpoint(..., loader=...)``, it reads exactly the batches the uninterrupted loader reads
next; what cannot resume is refused in one line, with nothing loaded. The multi-process proof
(killed, then resumed on fewer ranks under another plan) is in tests/loops/test_elastic.py.
"""

from __future__ import annotations

import numpy as np
import paddle
import pytest
from harness.plans import tensor_parallel_plan
from harness.workloads import BATCH, WORKLOADS, TokenDataset, make_optimizer

from autodist import CheckpointError, apply_plan, load_checkpoint, save_checkpoint

WORKLOAD = WORKLOADS["docstring_llama"]
PASSES, SAMPLES = 3, 6 * BATCH


def applied(shuffle: bool, samples: int = SAMPLES):
    """The docstring Llama, SGD and ``DataLoader(dataset, batch_size, shuffle=shuffle)`` applied."""
    model = WORKLOAD.build(2024)
    optimizer, _ = make_optimizer("sgd", model.parameters())
    loader = paddle.io.DataLoader(TokenDataset(WORKLOAD.vocab_size, samples, 2024), batch_size=BATCH, shuffle=shuffle)
    return apply_plan(model, optimizer, loader, tensor_parallel_plan(model))


def read(loader, start: int, stop: int | None = None) -> list[bytes]:
    """The batches a user's loop reads from step ``start`` (a resumed run's) to ``stop``."""
    seen, step = [], start
    for _ in range(start // len(loader), PASSES):
        for inputs, _ in loader:
            seen.append(inputs._local_value().numpy().tobytes())
            step += 1
            if step == stop:
                return seen
    return seen


@pytest.mark.parametrize("shuffle", [True, False], ids=["shuffled", "in-order"])
def test_a_resumed_loader_reads_what_the_uninterrupted_one_reads_next(tmp_path, shuffle):
    uninterrupted = read(applied(shuffle)[2], 0)
    assert len(uninterrupted) == PASSES * SAMPLES // BATCH and len(set(uninterrupted[:6])) == 6
    if shuffle:
        assert uninterrupted[:6] != uninterrupted[6:12], "the passes are not shuffled apart"
    for stop in range(1, len(uninterrupted)):
        model, optimizer, loader = applied(shuffle)
        before = read(loader, 0, stop)
        save_checkpoint(model, optimizer, tmp_path / f"at{stop}", step=stop, loader=loader)
        model, optimizer, loader = applied(shuffle)
        step = load_checkpoint(model, optimizer, tmp_path / f"at{stop}", loader=loader).step
        assert before + read(loader, step) == uninterrupted, f"stopped after step {stop}"


def test_what_cannot_resume_is_refused_in_one_line_with_nothing_loaded(tmp_path):
    model, optimizer, loader = applied(True)
    read(loader, 0, 2)
    save_checkpoint(model, optimizer, tmp_path / "without", step=2)
    save_checkpoint(model, optimizer, tmp_path / "with", step=2, loader=loader)
    _, _, in_order = applied(False)
    read(in_order, 0, 2)
    save_checkpoint(model, optimizer, tmp_path / "in-order", step=2, loader=in_order)
    plain = paddle.io.DataLoader(TokenDataset(WORKLOAD.vocab_size, SAMPLES, 2024), batch_size=BATCH, shuffle=True)
    with pytest.raises(CheckpointError, match="not the loader apply_plan returned") as refused:
        save_checkpoint(model, optimizer, tmp_path / "plain", step=2, loader=plain)
    assert "\n" not in str(refused.value) and not (tmp_path / "plain").exists()

    model, optimizer, loader = applied(True)
    start = {name: p.numpy().copy() for name, p in model.named_parameters()}
    cases = [
        ("without", loader, "saved without loader="),
        ("with", applied(True, samples=SAMPLES + BATCH)[2], "stood at batch 2 of 6 a pass, this loader has 7"),
        ("with", applied(False)[2], "the checkpoint's loader was shuffled, this one is not"),
        ("in-order", loader, "the checkpoint's loader was not shuffled, this one is shuffled"),
        ("with", plain, "not the loader apply_plan returned"),
    ]
    for folder, other, said in cases:
        with pytest.raises(CheckpointError, match=said) as refused:
            load_checkpoint(model, optimizer, tmp_path / folder, loader=other)
        assert "\n" not in str(refused.value)
        for name, p in model.named_parameters():
            np.testing.assert_array_equal(p.numpy(), start[name], err_msg=f"{folder}: {name} changed")
    assert read(loader, 0, 1) == read(applied(True)[2], 0, 1), "a refused load moved the loader"
