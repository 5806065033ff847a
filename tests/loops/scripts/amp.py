"""Loop (c): mixed precision as Paddle's docs write it — ``paddle.amp.auto_cast`` with a
``GradScaler`` (O1), or ``paddle.amp.decorate`` of model and optimizer (O2) — the loss logged
on rank 0. On a CPU the casts may do nothing; the code path is the one a GPU job runs.

    python amp.py --level O1 --out run                   # one device
    python -m paddle.distributed.launch --nproc_per_node 2 amp.py --level O2 --plan plan.json --out run
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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--plan")
    parser.add_argument("--out", required=True)
    parser.add_argument("--level", choices=["O1", "O2"], default="O1")
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    if args.plan:
        dist.init_parallel_env()  # autodist
    paddle.seed(2024)
    model = build_model()
    opt = paddle.optimizer.AdamW(learning_rate=1e-2, parameters=model.parameters(), multi_precision=True)
    loader = paddle.io.DataLoader(token_dataset(1, args.steps), batch_size=BATCH, shuffle=False, drop_last=True)
    if args.plan:
        model, opt, loader = autodist.apply_plan(model, opt, loader, args.plan)  # autodist
    if args.level == "O2":
        model, opt = paddle.amp.decorate(models=model, optimizers=opt, level="O2", dtype="float16")
    scaler = paddle.amp.GradScaler(init_loss_scaling=1024)

    log: dict = {"losses": {}}
    for step, (input_ids, labels) in enumerate(loader, start=1):
        with paddle.amp.auto_cast(level=args.level, dtype="float16"):
            logits = model(input_ids)
            loss = F.cross_entropy(logits.reshape([-1, VOCAB]).astype("float32"), labels.reshape([-1]))
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.clear_grad()
        if dist.get_rank() == 0:
            print(f"step {step} loss {float(loss):.5f}")
            log["losses"][step] = float(loss)
    autodist.save_checkpoint(model, opt, os.path.join(args.out, "final"), step=args.steps)
    if dist.get_rank() == 0:
        with open(os.path.join(args.out, "log.json"), "w") as f:
            json.dump(log, f)


if __name__ == "__main__":
    main()
