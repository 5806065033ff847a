"""Loop (d): a PaddleFormers model called with ``labels=``, returning its own loss, as
PaddleFormers' examples train it; the loss logged on rank 0.

    python paddleformers_labels.py --out run                      # one device
    python -m paddle.distributed.launch --nproc_per_node 2 paddleformers_labels.py --plan plan.json --out run
"""

import argparse
import json
import os

import numpy as np
import paddle
import paddle.distributed as dist
from models.paddleformers_models import build_llama

import autodist  # autodist

BATCH, SEQ = 4, 8


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--plan")
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    if args.plan:
        dist.init_parallel_env()  # autodist
    paddle.seed(2024)
    model = build_llama()
    vocab = model.config.vocab_size
    opt = paddle.optimizer.AdamW(learning_rate=1e-3, parameters=model.parameters())
    tokens = np.random.RandomState(1).randint(0, vocab, size=(args.steps * BATCH, SEQ + 1)).astype("int64")
    dataset = paddle.io.TensorDataset([paddle.to_tensor(tokens[:, :-1]), paddle.to_tensor(tokens[:, 1:])])
    loader = paddle.io.DataLoader(dataset, batch_size=BATCH, shuffle=False, drop_last=True)
    if args.plan:
        model, opt, loader = autodist.apply_plan(model, opt, loader, args.plan)  # autodist

    log: dict = {"losses": {}}
    model.train()
    for step, (input_ids, labels) in enumerate(loader, start=1):
        outputs = model(input_ids=input_ids, labels=labels)
        loss = outputs.loss if hasattr(outputs, "loss") else outputs[0]
        loss.backward()
        opt.step()
        opt.clear_grad()
        if dist.get_rank() == 0:
            print(f"step {step} loss {loss.item():.5f}")
            log["losses"][step] = loss.item()
    autodist.save_checkpoint(model, opt, os.path.join(args.out, "final"), step=args.steps)
    if dist.get_rank() == 0:
        with open(os.path.join(args.out, "log.json"), "w") as f:
            json.dump(log, f)


if __name__ == "__main__":
    main()
