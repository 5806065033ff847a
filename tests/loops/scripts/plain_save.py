"""Loop (i): the model's and the optimizer's state saved with ``paddle.save`` on rank 0 after the
first step, as single-device scripts do, and training going on; the loss logged on rank 0.

    python plain_save.py --out run [--model mixtral]                  # one device
    python -m paddle.distributed.launch --nproc_per_node 2 plain_save.py --plan plan.json --out run
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
    parser.add_argument("--model", choices=["gpt", "mixtral"], default="gpt")
    args = parser.parse_args()
    if args.plan:
        dist.init_parallel_env()  # autodist
    paddle.seed(2024)
    model = {"gpt": gpt, "mixtral": mixtral_moe}[args.model].build_model()
    opt = paddle.optimizer.AdamW(learning_rate=1e-2, parameters=model.parameters())
    loader = paddle.io.DataLoader(token_dataset(1, 3), batch_size=BATCH, shuffle=False, drop_last=True)
    if args.plan:
        model, opt, loader = autodist.apply_plan(model, opt, loader, args.plan)  # autodist

    os.makedirs(args.out, exist_ok=True)
    losses = {}
    for step, (input_ids, labels) in enumerate(loader, start=1):
        loss = F.cross_entropy(model(input_ids).reshape([-1, VOCAB]), labels.reshape([-1]))
        loss.backward()
        opt.step()
        opt.clear_grad()
        if dist.get_rank() == 0:
            print(f"step {step} loss {float(loss):.5f}")
            losses[step] = float(loss)
            if step == 1:
                paddle.save(model.state_dict(), os.path.join(args.out, "model.pdparams"))
                paddle.save(opt.state_dict(), os.path.join(args.out, "opt.pdopt"))
    if dist.get_rank() == 0:
        with open(os.path.join(args.out, "log.json"), "w") as f:
            json.dump({"losses": losses}, f)


if __name__ == "__main__":
    main()
