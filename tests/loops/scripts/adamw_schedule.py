"""Loop (a): AdamW, a warmup + cosine LR schedule, global-norm clipping, the loss logged on
rank 0, evaluation (loss and ``paddle.metric.accuracy``) every N steps, a checkpoint every N steps, and a resume from one.

Written as people write it; the only autodist lines are marked ``# autodist``.

    python adamw_schedule.py --out run                      # one device
    python -m paddle.distributed.launch --nproc_per_node 2 adamw_schedule.py --plan plan.json --out run
    ... --resume-from run/ckpt-3 --out run2                 # under any other plan
"""

import argparse
import json
import os

import numpy as np
import paddle
import paddle.distributed as dist
import paddle.nn.functional as F
from models.gpt import build_model

import autodist  # autodist

VOCAB, BATCH, SEQ = 64, 4, 8


def token_dataset(seed: int, batches: int) -> paddle.io.TensorDataset:
    tokens = np.random.RandomState(seed).randint(0, VOCAB, size=(batches * BATCH, SEQ + 1)).astype("int64")
    return paddle.io.TensorDataset([paddle.to_tensor(tokens[:, :-1]), paddle.to_tensor(tokens[:, 1:])])


def evaluate(model, loader) -> tuple[float, float]:
    """The mean loss and next-token accuracy over ``loader``."""
    model.eval()
    total, correct, count = 0.0, 0.0, 0
    with paddle.no_grad():
        for input_ids, labels in loader:
            logits = model(input_ids).reshape([-1, VOCAB])
            total += float(F.cross_entropy(logits, labels.reshape([-1])))
            correct += float(paddle.metric.accuracy(logits, labels.reshape([-1, 1])))
            count += 1
    model.train()
    return total / count, correct / count


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--plan")
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--eval-every", type=int, default=3)
    parser.add_argument("--save-every", type=int, default=3)
    parser.add_argument("--resume-from")
    args = parser.parse_args()
    if args.plan:
        dist.init_parallel_env()  # autodist (what paddle.distributed.launch users write anyway)
    rank = dist.get_rank()

    paddle.seed(2024)
    model = build_model()
    scheduler = paddle.optimizer.lr.LinearWarmup(
        paddle.optimizer.lr.CosineAnnealingDecay(learning_rate=1e-2, T_max=args.steps),
        warmup_steps=2,
        start_lr=1e-3,
        end_lr=1e-2,
    )
    opt = paddle.optimizer.AdamW(
        learning_rate=scheduler,
        parameters=model.parameters(),
        weight_decay=0.01,
        grad_clip=paddle.nn.ClipGradByGlobalNorm(clip_norm=1.0),
    )
    loader = paddle.io.DataLoader(token_dataset(1, args.steps), batch_size=BATCH, shuffle=False, drop_last=True)
    eval_loader = paddle.io.DataLoader(token_dataset(2, 2), batch_size=BATCH, shuffle=False, drop_last=True)
    if args.plan:
        model, opt, loader = autodist.apply_plan(model, opt, loader, args.plan)  # autodist

    start = 0
    if args.resume_from:
        start = autodist.load_checkpoint(model, opt, args.resume_from).step
    log: dict = {"losses": {}, "eval": {}, "accuracy": {}, "lr": {}}
    for step, (input_ids, labels) in enumerate(loader, start=1):
        if step <= start:
            continue
        logits = model(input_ids)
        loss = F.cross_entropy(logits.reshape([-1, VOCAB]), labels.reshape([-1]))
        loss.backward()
        opt.step()
        opt.clear_grad()
        if rank == 0:
            print(f"step {step} loss {float(loss):.5f} lr {scheduler.get_lr():.6f}")
            log["losses"][step] = float(loss)
            log["lr"][step] = scheduler.get_lr()
        scheduler.step()
        if step % args.eval_every == 0:
            eval_loss, accuracy = evaluate(model, eval_loader)
            if rank == 0:
                print(f"step {step} eval loss {eval_loss:.5f} accuracy {accuracy:.4f}")
                log["eval"][step], log["accuracy"][step] = eval_loss, accuracy
        if step % args.save_every == 0:
            autodist.save_checkpoint(model, opt, os.path.join(args.out, f"ckpt-{step}"), step=step)
    autodist.save_checkpoint(model, opt, os.path.join(args.out, "final"), step=args.steps)
    if rank == 0:
        with open(os.path.join(args.out, "log.json"), "w") as f:
            json.dump(log, f)


if __name__ == "__main__":
    main()
