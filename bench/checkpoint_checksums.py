"""What the checkpoints' sha256 checksums cost (docs/checkpoints.md, "Integrity"): save and
load of the docstring Llama after one AdamW step, in one process, with the checksums as shipped
and with them switched off (each shard's digest a constant, the load's content check skipped),
in alternating rounds, best of each.

Run: ``make bench`` or ``.venv/bin/python bench/checkpoint_checksums.py [--layers 8] [--hidden 512]
[--vocab 4000] [--rounds 3] [--markdown]``; the figures go to docs/benchmarks.md by hand, with
the machine they came from.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import tempfile
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path

from llama_bench import load_model, model_config, parameter_count  # also puts tests/ on sys.path


@contextmanager
def checksums_off():
    """TEST-ONLY: the save hashes nothing and the load checks no bytes (what the cost is of)."""
    import autodist.applier.checkpoint.save_load as checkpoint

    digest, content = checkpoint.shard_digest, checkpoint._ShardFiles.content_problems
    checkpoint.shard_digest = lambda *args: "0" * 64
    checkpoint._ShardFiles.content_problems = lambda self, meta, names: []
    try:
        yield
    finally:
        checkpoint.shard_digest, checkpoint._ShardFiles.content_problems = digest, content


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=4000)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args()
    import paddle

    from autodist import load_checkpoint, save_checkpoint

    def fresh(step: bool):
        with paddle.utils.unique_name.guard():
            paddle.seed(0)
            model = load_model().build_model(**model_config(args))
            optimizer = paddle.optimizer.AdamW(1e-3, parameters=model.parameters())
            if step:
                ids = paddle.randint(0, args.vocab, [2, args.seq])
                model(ids, labels=ids)[0].backward()
                optimizer.step()
                optimizer.clear_grad()
            return model, optimizer

    model, optimizer = fresh(step=True)
    folder = Path(tempfile.mkdtemp(prefix="ckpt_checksums_"))
    best = {key: float("inf") for key in ("save on", "save off", "load on", "load off")}
    try:
        for _ in range(args.rounds):
            for mode in ("on", "off"):
                with checksums_off() if mode == "off" else nullcontext():
                    path = folder / mode
                    start = time.perf_counter()
                    save_checkpoint(model, optimizer, path, step=1)
                    best[f"save {mode}"] = min(best[f"save {mode}"], time.perf_counter() - start)
                    target = fresh(step=True)
                    start = time.perf_counter()
                    load_checkpoint(target[0], target[1], path)
                    best[f"load {mode}"] = min(best[f"load {mode}"], time.perf_counter() - start)
        size = sum(f.stat().st_size for f in (folder / "on").rglob("*") if f.is_file())
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    machine = f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, paddle {paddle.__version__}"
    head = (
        f"Machine: {machine}; the docstring Llama at {args.layers} layers, hidden {args.hidden}, vocabulary "
        f"{args.vocab} ({parameter_count(args) / 1e6:.1f} M parameters, AdamW: {size / 2**20:.0f} MiB on disk); "
        f"one process, best of {args.rounds} alternating rounds."
    )
    rows = [(what, best[f"{what} off"], best[f"{what} on"]) for what in ("save", "load")]
    if args.markdown:
        print(head + "\n\n| | without checksums (s) | with sha256 (s) | ratio |\n|---|---|---|---|")
        for what, off, on in rows:
            print(f"| {what}_checkpoint | {off:.3f} | {on:.3f} | {on / off:.2f}x |")
    else:
        print(head)
        for what, off, on in rows:
            print(f"{what}: {off:.3f} s -> {on:.3f} s ({on / off:.2f}x)")


if __name__ == "__main__":
    main()
