"""What the readable losses' wrappers cost per Tensor call (applier/ranks/readable/, "The cost").

``apply_plan`` wraps Paddle's scalar reductions (``_C_ops.mean``, ``mean_all``, ``sum``), a few
Tensor arithmetic methods (``+ - * /``, ``detach``, ``astype``, ...) and the reads (``float``,
``item``, ``numpy``, ``print``...) so that a loss is readable on any rank. Every wrapped call then
runs a Python function and, on its result, ``is_dist()``; noting a Partial scalar adds a local
reference. No communication. This measures, in one process (no distributed job: the wrappers run,
nothing is noted), the time per call of each wrapped operation on a small CPU tensor before and
after wrapping, and one forward + backward of the tests' GPT with and without the wrappers.

Run: ``.venv/bin/python bench/readable_overhead.py [--calls 20000] [--rounds 5] [--markdown]``. The numbers go
to docs/benchmarks.md by hand, with the machine they came from.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import paddle  # noqa: E402
import paddle.nn.functional as F  # noqa: E402


def per_call_us(fn, calls: int) -> float:
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls * 1e6)
    return best


def step_ms(model, tokens, labels, repeats: int = 20) -> float:
    def step():
        loss = F.cross_entropy(model(tokens).reshape([-1, 64]), labels.reshape([-1]))
        loss.backward()
        model.clear_gradients()

    step()
    return per_call_us(step, repeats) / 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=20000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args()
    from models.gpt import build_model

    from autodist.applier.ranks.readable import patching

    a, b = paddle.rand([4, 8]), paddle.rand([4, 8])
    ops = {
        "a + b": lambda: a + b,
        "a * 2.0": lambda: a * 2.0,
        "a.mean()": lambda: a.mean(),
        "a.sum()": lambda: a.sum(),
        "a.detach()": lambda: a.detach(),
    }
    paddle.seed(0)
    model = build_model()
    tokens, labels = paddle.randint(0, 64, [4, 8]), paddle.randint(0, 64, [4, 8])
    # Alternate unwrapped and wrapped rounds, keeping each one's best, so that a busy machine
    # slows both alike.
    before, after = dict.fromkeys(ops, float("inf")), dict.fromkeys(ops, float("inf"))
    step_before = step_after = float("inf")
    for _ in range(args.rounds):
        patching.unpatch()
        before = {name: min(before[name], per_call_us(fn, args.calls)) for name, fn in ops.items()}
        step_before = min(step_before, step_ms(model, tokens, labels))
        patching.patch()
        after = {name: min(after[name], per_call_us(fn, args.calls)) for name, fn in ops.items()}
        step_after = min(step_after, step_ms(model, tokens, labels))

    machine = f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, paddle {paddle.__version__}"
    rows = [(name, before[name], after[name]) for name in ops]
    if args.markdown:
        print(f"Machine: {machine}; best of {args.rounds} alternating rounds of 3 x {args.calls} calls, CPU.\n")
        print("| call | before (us) | wrapped (us) | added (us) |")
        print("|---|---|---|---|")
        for name, x, y in rows:
            print(f"| `{name}` | {x:.2f} | {y:.2f} | {y - x:+.2f} |")
        print(
            f"| GPT (tests/models/gpt.py) forward + backward, batch 4x8 (ms) | {step_before:.2f} | "
            f"{step_after:.2f} | {step_after - step_before:+.2f} |"
        )
    else:
        for name, x, y in rows:
            print(f"{name:12s} {x:7.2f} us -> {y:7.2f} us")
        print(f"GPT step {step_before:.2f} ms -> {step_after:.2f} ms ({machine})")


if __name__ == "__main__":
    main()
