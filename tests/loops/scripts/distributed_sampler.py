"""Loop (e): a data-parallel script ported as it was — its loader already splits the data with
``paddle.io.DistributedBatchSampler`` (each rank reads its own ``batch_size`` samples) — the
loss logged on rank 0.

    python distributed_sampler.py --out run                       # one device
    python -m paddle.distributed.launch --nproc_per_node 2 distributed_sampler.py --plan plan.json --out run
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

VOCAB, GLOBAL_BATCH, SEQ = 64, 4, 8


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--plan")
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    if args.plan:
        dist.init_parallel_env()
    world = dist.get_world_size()
    paddle.seed(2024)
    model = build_model()
    opt = paddle.optimizer.AdamW(learning_rate=1e-2, parameters=model.parameters())
    tokens = np.random.RandomState(1).randint(0, VOCAB, size=(args.steps * GLOBAL_BATCH, SEQ + 1)).astype("int64")
    dataset = paddle.io.TensorDataset([paddle.to_tensor(tokens[:, :-1]), paddle.to_tensor(tokens[:, 1:])])
    sampler = paddle.io.DistributedBatchSampler(
        dataset, batch_size=GLOBAL_BATCH // world, shuffle=False, drop_last=True
    )
    loader = paddle.io.DataLoader(dataset, batch_sampler=sampler)
    if args.plan:
        model, opt, loader = autodist.apply_plan(model, opt, loader, args.plan)  # autodist

    log: dict = {"losses": {}}
    for step, (input_ids, labels) in enumerate(loader, start=1):
        loss = F.cross_entropy(model(input_ids).reshape([-1, VOCAB]), labels.reshape([-1]))
        loss.backward()
        opt.step()
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
