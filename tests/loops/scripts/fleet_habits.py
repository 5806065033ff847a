"""Loop (k): a script written for ``fleet`` that keeps its wrapping lines after ``apply_plan``:
``fleet.init``, then ``fleet.distributed_optimizer(opt)`` (``--wrap optimizer``) or
``fleet.distributed_model(model)`` / ``paddle.DataParallel(model)`` too; the loss logged on rank 0.

    python fleet_habits.py --out run                       # one device, nothing wrapped
    python -m paddle.distributed.launch --nproc_per_node 2 fleet_habits.py --plan plan.json --out run --wrap model
"""

import argparse
import json
import os

import numpy as np
import paddle
import paddle.distributed as dist
import paddle.nn.functional as F
from models.gpt import build_model
from paddle.distributed import fleet

import autodist  # autodist

VOCAB, BATCH, SEQ = 64, 4, 8


def token_dataset(seed: int, batches: int) -> paddle.io.TensorDataset:
    tokens = np.random.RandomState(seed).randint(0, VOCAB, size=(batches * BATCH, SEQ + 1)).astype("int64")
    return paddle.io.TensorDataset([paddle.to_tensor(tokens[:, :-1]), paddle.to_tensor(tokens[:, 1:])])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--plan")
    parser.add_argument("--out", required=True)
    parser.add_argument("--wrap", choices=["optimizer", "model", "data_parallel"], default="optimizer")
    args = parser.parse_args()
    if args.plan:
        fleet.init(is_collective=True)
    paddle.seed(2024)
    model = build_model()
    opt = paddle.optimizer.AdamW(learning_rate=1e-2, parameters=model.parameters())
    loader = paddle.io.DataLoader(token_dataset(1, 3), batch_size=BATCH, shuffle=False, drop_last=True)
    if args.plan:
        model, opt, loader = autodist.apply_plan(model, opt, loader, args.plan)  # autodist
        if args.wrap == "model":
            model = fleet.distributed_model(model)
        if args.wrap == "data_parallel":
            model = paddle.DataParallel(model)
        opt = fleet.distributed_optimizer(opt)

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
