"""A training script as users write one, run by ``autodist-run`` (tests/loops/test_elastic.py):
a DataLoader with its defaults (``--shuffle``: shuffled), AdamW, epochs, rank-0 logging, a
checkpoint every few steps that records where the loader stands, and a resume from the last
checkpoint whose loader starts at the first batch not trained on. Nothing in it knows about the
supervisor but ``--plan {plan}``.

TEST-ONLY faults, on the first launch only (a marker file says it happened): ``--kill-at STEP``
makes rank ``--kill-rank`` die of SIGKILL right after that step, or with ``--kill-in-save``
half-way through writing that step's checkpoint; ``--seconds-per-step`` stands in for the time a
real step takes (a tiny model's steps are over before the supervisor looks), until the test
leaves a file ``quick`` in ``--out`` (every event it waits for has happened)."""

import argparse
import json
import os
import signal
import time

import numpy as np
import paddle
import paddle.distributed as dist
import paddle.nn.functional as F
from models import gpt

import autodist

VOCAB, BATCH, SEQ = 64, 4, 8


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--plan")
    parser.add_argument("--ckpt", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--shuffle", action="store_true")
    parser.add_argument("--every", type=int, default=3)
    parser.add_argument("--kill-at", type=int)
    parser.add_argument("--kill-rank", type=int, default=1)
    parser.add_argument("--kill-in-save", action="store_true")
    parser.add_argument("--seconds-per-step", type=float, default=0.0)
    args = parser.parse_args()
    if args.plan:
        dist.init_parallel_env()
    rank = dist.get_rank()
    paddle.seed(2024)
    model = gpt.build_model()
    opt = paddle.optimizer.AdamW(learning_rate=1e-2, parameters=model.parameters())
    samples = args.steps // args.epochs * BATCH
    tokens = np.random.RandomState(1).randint(0, VOCAB, size=(samples, SEQ + 1)).astype("int64")
    dataset = paddle.io.TensorDataset([paddle.to_tensor(tokens[:, :-1]), paddle.to_tensor(tokens[:, 1:])])
    loader = paddle.io.DataLoader(dataset, batch_size=BATCH, shuffle=args.shuffle)
    if args.plan:
        model, opt, loader = autodist.apply_plan(model, opt, loader, args.plan)
    step = 0
    if os.path.exists(os.path.join(args.ckpt, "checkpoint.json")):
        step = autodist.load_checkpoint(model, opt, args.ckpt, loader=loader).step
    for _ in range(step // len(loader), args.epochs):
        for x, y in loader:
            step += 1
            train_step(args, model, opt, loader, rank, step, x, y)
    autodist.save_checkpoint(model, opt, os.path.join(args.out, "final"), step=args.steps)


def train_step(args, model, opt, loader, rank: int, step: int, x, y) -> None:
    loss = F.cross_entropy(model(x).reshape([-1, VOCAB]), y.reshape([-1]))
    loss.backward()
    opt.step()
    opt.clear_grad()
    if not os.path.exists(os.path.join(args.out, "quick")):
        time.sleep(args.seconds_per_step)  # TEST-ONLY: a real step's time, so the supervisor sees each checkpoint
    if rank == 0:
        with open(os.path.join(args.out, "losses.jsonl"), "a") as f:
            f.write(json.dumps({"step": step, "loss": float(loss), "ranks": dist.get_world_size()}) + "\n")
    fault = step == args.kill_at and rank == args.kill_rank and first_time(args.out)
    if fault and not args.kill_in_save:
        os.kill(os.getpid(), signal.SIGKILL)
    if step % args.every == 0:
        if fault:
            die_half_way_through_the_save()
        autodist.save_checkpoint(model, opt, args.ckpt, step=step, loader=loader if args.plan else None)


def first_time(out: str) -> bool:
    marker = os.path.join(out, "killed")
    if os.path.exists(marker):
        return False
    open(marker, "w").close()
    return True


def die_half_way_through_the_save() -> None:
    """TEST-ONLY: this rank writes half of its first piece of the checkpoint, then dies."""
    import autodist.applier.checkpoint.save_load as checkpoint

    def half_then_die(folder, mine):
        if not mine:  # this rank writes no piece: it dies where it would have written
            os.kill(os.getpid(), signal.SIGKILL)
        folder.mkdir(parents=True, exist_ok=True)
        with open(folder / mine[0][-1].file, "wb") as f:
            data = mine[0][0].numpy().tobytes()
            f.write(data[: len(data) // 2])
        os.kill(os.getpid(), signal.SIGKILL)

    checkpoint._write_pieces = half_then_die


if __name__ == "__main__":
    main()
