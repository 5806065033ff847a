"""Loop (f): nanoGPT, whose LM head is the embedding read through a function call
(``paddle.matmul(x, self.transformer["wte"].weight, transpose_y=True)``), trained on one device
with the ordinary loop and under a pipeline plan (1F1B) with the README's pipeline lines: the
loss moves into ``loss_fn`` and the loop calls ``model.step``. The loss is logged on rank 0,
which holds the first stage: its losses are read from the last stage.

    python tied_pipeline.py --out run                      # one device
    python -m paddle.distributed.launch --nproc_per_node 2 tied_pipeline.py --plan pp2.json --out run
"""

import argparse
import json
import os

import numpy as np
import paddle
import paddle.distributed as dist
import paddle.nn.functional as F
from models.zoo.nanogpt import VOCAB, build_model

import autodist  # autodist

BATCH, SEQ = 4, 8


def loss_fn(logits, labels):
    return F.cross_entropy(logits.reshape([-1, VOCAB]), labels.reshape([-1]))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--plan")
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    if args.plan:
        dist.init_parallel_env()  # autodist
    paddle.seed(2024)
    model = build_model()
    for layer in model.sublayers():  # nanoGPT pretrains with dropout 0.0 (its config's default)
        if isinstance(layer, paddle.nn.Dropout):
            layer.p = 0.0
    opt = paddle.optimizer.AdamW(learning_rate=1e-3, parameters=model.parameters())
    tokens = np.random.RandomState(1).randint(0, VOCAB, size=(args.steps * BATCH, SEQ + 1)).astype("int64")
    dataset = paddle.io.TensorDataset([paddle.to_tensor(tokens[:, :-1]), paddle.to_tensor(tokens[:, 1:])])
    loader = paddle.io.DataLoader(dataset, batch_size=BATCH, shuffle=False, drop_last=True)
    if args.plan:
        model, opt, loader = autodist.apply_plan(model, opt, loader, args.plan, loss_fn=loss_fn)  # autodist

    log: dict = {"losses": {}}
    for step, (input_ids, labels) in enumerate(loader, start=1):
        if args.plan:  # autodist: a 1F1B step runs forward and backward of every micro-batch
            losses = model.step(input_ids, target=labels)
        else:
            loss = loss_fn(model(input_ids), labels)
            loss.backward()
            losses = [loss]
        opt.step()
        opt.clear_grad()
        if dist.get_rank() == 0:
            loss = sum(float(micro) for micro in losses) / len(losses)  # equal micro-batches
            print(f"step {step} loss {loss:.5f}")
            log["losses"][step] = loss
    autodist.save_checkpoint(model, opt, os.path.join(args.out, "final"), step=args.steps)
    if dist.get_rank() == 0:
        with open(os.path.join(args.out, "log.json"), "w") as f:
            json.dump(log, f)


if __name__ == "__main__":
    main()
