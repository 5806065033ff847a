"""Loop (h): the optimizer built after ``apply_plan``, from the parameters of the model it
returns (``apply_plan(model, None, loader, plan)``), as scripts that wrap the model first and
make the optimizer later do; the loss logged on rank 0.

    python optimizer_after.py --out run [--model mixtral]                  # one device
    python -m paddle.distributed.launch --nproc_per_node 2 optimizer_after.py --plan plan.json --out run
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
    loader = paddle.io.DataLoader(token_dataset(1, 3), batch_size=BATCH, shuffle=False, drop_last=True)
    if args.plan:
        model, _, loader = autodist.apply_plan(model, None, loader, args.plan)  # autodist
    opt = paddle.optimizer.AdamW(learning_rate=1e-2, parameters=model.parameters())

    log: dict = {"losses": {}}
    for step, (input_ids, labels) in enumerate(loader, start=1):
        loss = F.cross_entropy(model(input_ids).reshape([-1, VOCAB]), labels.reshape([-1]))
        loss.backward()
        opt.step()
        opt.clear_grad()
        if dist.get_rank() == 0:
            print(f"step {step} loss {float(loss):.5f}")
            log["losses"][step] = float(loss)
    if dist.get_rank() == 0:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "log.json"), "w") as f:
            json.dump(log, f)


if __name__ == "__main__":
    main()
