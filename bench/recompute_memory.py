"""Activation memory that ``apply_plan``'s recompute saves: the docstring Llama on one CPU
rank, planned by ``autodist-plan --recompute none|selective|full`` and applied, one training
step each in a fresh process.

Measured with Paddle's host allocator statistics (``core.host_memory_stat_*_value``, bytes
the CPU allocator handed out): *held after forward* is what the forward pass leaves alive for
backward (the activations; the weights and inputs are subtracted), *peak* is the step's
highest allocation above the same baseline. The step's loss is printed too: equal in every
mode.

Run: ``make bench`` or ``.venv/bin/python bench/recompute_memory.py [--layers 4] [--hidden 512] [--markdown]``.
The numbers go to docs/benchmarks.md by hand, with the machine they came from.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODES = ("none", "selective", "full")


def config(args) -> dict[str, str]:
    sizes = dict(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=4 * args.hidden,
        num_heads=args.heads,
        num_layers=args.layers,
        seq_length=args.seq,
    )
    return {f"LLAMA_DOCSTRING_{k.upper()}": str(v) for k, v in sizes.items()}


def worker(plan_path: str, batch: int) -> None:
    """One step of the applied plan; prints a JSON line with the measurements."""
    import numpy as np
    import paddle
    from paddle.base import core

    from autodist import apply_plan

    sys.path.insert(0, str(ROOT / "plans" / "llama_docstring"))
    import model as llama

    paddle.seed(0)
    model = llama.build_model()
    optimizer = paddle.optimizer.SGD(learning_rate=0.1, parameters=model.parameters())
    model, optimizer, _ = apply_plan(model, optimizer, None, plan_path)
    seq, vocab = int(os.environ["LLAMA_DOCSTRING_SEQ_LENGTH"]), int(os.environ["LLAMA_DOCSTRING_VOCAB_SIZE"])
    tokens = np.random.RandomState(0).randint(0, vocab, size=(batch, seq + 1)).astype("int64")
    inputs, labels = paddle.to_tensor(tokens[:, :-1]), paddle.to_tensor(tokens[:, 1:])
    base = core.host_memory_stat_current_value("Allocated", 0)
    core.host_memory_stat_reset_peak_value("Allocated", 0)
    loss, _ = model(inputs, labels=labels)
    held = core.host_memory_stat_current_value("Allocated", 0) - base
    loss.backward()
    peak = core.host_memory_stat_peak_value("Allocated", 0) - base
    print(json.dumps({"held": held, "peak": peak, "loss": float(loss)}))


def measure(mode: str, args, env: dict[str, str], workdir: Path) -> dict:
    plan = workdir / f"plan_{mode}.json"
    planner = [
        str(Path(sys.executable).with_name("autodist-plan")),
        "plans/llama_docstring/model.py",
        "--devices",
        "1",
        "--device",
        "cpu",
        "--recompute",
        mode,
        "--global-batch-size",
        str(args.batch),
        "-q",
        "-o",
        str(plan),
    ]
    subprocess.run(planner, cwd=ROOT, env=env, check=True, stdout=subprocess.DEVNULL)
    out = subprocess.run(
        [sys.executable, __file__, "--worker", str(plan), "--batch", str(args.batch)],
        cwd=ROOT,
        env=env,
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    result = json.loads(out.strip().splitlines()[-1])
    result["layers_recomputed"] = len(json.loads(plan.read_text())["recompute"])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=8000)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--markdown", action="store_true")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.batch)
        return
    env = {**os.environ, **config(args)}
    with tempfile.TemporaryDirectory() as tmp:
        results = {mode: measure(mode, args, env, Path(tmp)) for mode in MODES}
    mib = lambda n: f"{n / 2**20:.1f}"  # noqa: E731
    print(
        f"docstring Llama, {args.layers} layers, hidden {args.hidden}, seq {args.seq}, batch {args.batch}, fp32, "
        f"1 CPU rank; {platform.processor() or platform.machine()}, Python {platform.python_version()}"
    )
    if args.markdown:
        print("\n| recompute | layers wrapped | held after forward MiB | peak MiB | loss |\n|---|---|---|---|---|")
    for mode, r in results.items():
        if args.markdown:
            print(f"| {mode} | {r['layers_recomputed']} | {mib(r['held'])} | {mib(r['peak'])} | {r['loss']:.6f} |")
        else:
            print(
                f"{mode:>9}: {r['layers_recomputed']} layers wrapped, held after forward {mib(r['held'])} MiB, "
                f"peak {mib(r['peak'])} MiB, loss {r['loss']:.6f}"
            )


if __name__ == "__main__":
    main()
