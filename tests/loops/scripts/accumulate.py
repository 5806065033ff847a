"""Loop (b): gradient accumulation by hand — ``(loss / k).backward()`` every batch, an
optimizer step every ``k`` batches, the gradients clipped before it with
``paddle.nn.utils.clip_grad_norm_`` — the loss and the gradient norm it returns logged on rank 0.

    python accumulate.py --out run                      # one device
    python -m paddle.distributed.launch --nproc_per_node 2 accumulate.py --plan plan.json --out run
"""

import argparse
import json
import os

import numpy as np
import paddle
import paddle.distributed as dist
import paddle.nn.functional as F
from models import gpt
from models.zoo import mixtral_moe

import autodist  # autodist

VOCAB, BATCH, SEQ = 64, 4, 8


def token_dataset(seed: int, batches: int) -> paddle.io.TensorDataset:
    tokens = np.random.RandomState(seed).randint(0, VOCAB, size=(batches * BATCH, SEQ + 1)).astype("int64")
    return paddle.io.TensorDataset([paddle.to_tensor(tokens[:, :-1]), paddle.to_tensor(tokens[:, 1:])])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--plan")
    parser.add_argument("--out", required=True)
    parser.add_argument("--batches", type=int, default=6)
    parser.add_argument("--accumulate", type=int, default=3)
    parser.add_argument("--model", choices=["gpt", "mixtral"], default="gpt")
    args = parser.parse_args()
    if args.plan:
        dist.init_parallel_env()  # autodist
    paddle.seed(2024)
    model = {"gpt": gpt, "mixtral": mixtral_moe}[args.model].build_model()
    opt = paddle.optimizer.AdamW(learning_rate=1e-3, parameters=model.parameters())
    loader = paddle.io.DataLoader(token_dataset(1, args.batches), batch_size=BATCH, shuffle=False, drop_last=True)
    if args.plan:
        model, opt, loader = autodist.apply_plan(model, opt, loader, args.plan)  # autodist

    k = args.accumulate
    log: dict = {"losses": {}, "norms": {}}
    running = 0.0
    for i, (input_ids, labels) in enumerate(loader, start=1):
        loss = F.cross_entropy(model(input_ids).reshape([-1, VOCAB]), labels.reshape([-1]))
        (loss / k).backward()
        if dist.get_rank() == 0:
            running += float(loss) / k
        if i % k == 0:
            grad_norm = paddle.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
            opt.step()
            opt.clear_grad()
            if dist.get_rank() == 0:
                print(f"update {i // k} loss {running:.5f} grad norm {float(grad_norm):.5f}")
                log["losses"][i // k] = running
                log["norms"][i // k] = float(grad_norm)
            running = 0.0
    autodist.save_checkpoint(model, opt, os.path.join(args.out, "final"), step=args.batches // k)
    if dist.get_rank() == 0:
        with open(os.path.join(args.out, "log.json"), "w") as f:
            json.dump(log, f)


if __name__ == "__main__":
    main()
