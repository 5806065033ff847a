"""Loop (j): cross-entropy plus OLMo's / PaLM's auxiliary z-loss on the logits' log-partition,
``1e-2 * logsumexp(logits, -1) ** 2``, computed in the loop; the loss logged on rank 0. Under mp
the logits arrive split over the vocabulary, where Paddle 3.3.1's own ``logsumexp`` sums the
halves' (exact_reductions.py).

    python z_loss.py --out run                      # one device
    python -m paddle.distributed.launch --nproc_per_node 2 z_loss.py --plan plan.json --out run
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

VOCAB, BATCH, SEQ, Z_LOSS = 64, 4, 8, 1e-2


def token_dataset(seed: int, batches: int) -> paddle.io.TensorDataset:
    tokens = np.random.RandomState(seed).randint(0, VOCAB, size=(batches * BATCH, SEQ + 1)).astype("int64")
    return paddle.io.TensorDataset([paddle.to_tensor(tokens[:, :-1]), paddle.to_tensor(tokens[:, 1:])])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--plan")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    if args.plan:
        dist.init_parallel_env()  # autodist
    paddle.seed(2024)
    model = build_model()
    opt = paddle.optimizer.AdamW(learning_rate=1e-2, parameters=model.parameters())
    loader = paddle.io.DataLoader(token_dataset(1, 3), batch_size=BATCH, shuffle=False, drop_last=True)
    if args.plan:
        model, opt, loader = autodist.apply_plan(model, opt, loader, args.plan)  # autodist

    log: dict = {"losses": {}, "z": {}}
    for step, (input_ids, labels) in enumerate(loader, start=1):
        logits = model(input_ids)
        z_loss = paddle.logsumexp(logits, axis=-1).pow(2).mean()
        loss = F.cross_entropy(logits.reshape([-1, VOCAB]), labels.reshape([-1])) + Z_LOSS * z_loss
        loss.backward()
        opt.step()
        opt.clear_grad()
        if dist.get_rank() == 0:
            print(f"step {step} loss {float(loss):.5f} z {float(z_loss):.5f}")
            log["losses"][step], log["z"][step] = float(loss), float(z_loss)
    if dist.get_rank() == 0:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "log.json"), "w") as f:
            json.dump(log, f)


if __name__ == "__main__":
    main()
