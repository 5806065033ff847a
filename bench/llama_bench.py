"""What the multi-process benchmarks share: the docstring Llama they measure, its size options,
and the command line (``--worker JOB`` runs one rank; otherwise run the job and print the report).

Example (a benchmark script)::

    from llama_bench import bench_main
    bench_main(__doc__, worker, run, report, layers=4, hidden=256, vocab=1000, timeout=600)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the multi-process harness (launcher, plans, data)


def load_model():
    """The module of ``plans/llama_docstring/model.py`` (``build_model(**config)``)."""
    from harness.workloads import load_model_file

    return load_model_file("plans/llama_docstring/model.py", "llama_docstring_model")


def model_config(args) -> dict:
    """``build_model`` keywords from the size options (intermediate size twice the hidden)."""
    return dict(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
        num_heads=args.heads, num_layers=args.layers, seq_length=args.seq,
    )  # fmt: skip


def parameter_count(args) -> int:
    h, i, v = args.hidden, 2 * args.hidden, args.vocab
    return args.layers * (4 * h * h + 3 * h * i + 2 * h) + 2 * v * h + h


def bench_main(doc: str, worker: Callable, run: Callable, report: Callable, *, layers: int, hidden: int,
               vocab: int, timeout: float, switches: dict[str, str] | None = None) -> None:  # fmt: skip
    """Parse the size options (defaults given) and the benchmark's own ``switches`` (flag: help),
    then run one rank or the whole benchmark."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--layers", type=int, default=layers)
    parser.add_argument("--hidden", type=int, default=hidden)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=vocab)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=timeout)
    parser.add_argument("--markdown", action="store_true", help="print a table for docs/benchmarks.md")
    for flag, text in (switches or {}).items():
        parser.add_argument(flag, action="store_true", help=text)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker)
        return
    print(report(args, run(args), args.markdown))
