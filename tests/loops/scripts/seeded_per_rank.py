"""Loop (g): habits of data-parallel scripts that would train silently wrong if nothing caught
them, the loss logged on rank 0 and a held-out loss from the whole eval loader at the end:

    --seed paddle          paddle.seed(2024 + rank) before the build (each rank its own dropout)
    --seed paddleformers   PaddleFormers' set_seed(2024) after fleet.init, which seeds each dp rank
                           with 2024 + its dp rank (paddleformers.trainer.trainer_utils)
    --lazy                 the model built under autodist.LazyGuard() (each rank allocates its shard only)
    --samples N            a train loader of N samples with the default drop_last=False
    --discard-return       apply_plan(model, opt, loader, plan) without taking what it returns

The eval loader (``--eval-samples``, 7 at batch 4: a short last batch) is read as it is, on every rank.

    python seeded_per_rank.py --out run --seed paddle                     # one device
    python -m paddle.distributed.launch --nproc_per_node 2 seeded_per_rank.py --plan plan.json --out run --seed paddle
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


def token_dataset(seed: int, samples: int) -> paddle.io.TensorDataset:
    tokens = np.random.RandomState(seed).randint(0, VOCAB, size=(samples, SEQ + 1)).astype("int64")
    return paddle.io.TensorDataset([paddle.to_tensor(tokens[:, :-1]), paddle.to_tensor(tokens[:, 1:])])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--plan")
    parser.add_argument("--out", required=True)
    parser.add_argument("--seed", choices=["paddle", "paddleformers"], default="paddle")
    parser.add_argument("--samples", type=int, default=3 * BATCH)
    parser.add_argument("--discard-return", action="store_true")
    parser.add_argument("--lazy", action="store_true")
    parser.add_argument("--eval-samples", type=int, default=7)
    args = parser.parse_args()
    if args.plan:
        dist.init_parallel_env()
    if args.seed == "paddleformers":
        from paddleformers.trainer.trainer_utils import set_seed

        if dist.get_world_size() > 1:
            from paddle.distributed import fleet

            strategy = fleet.DistributedStrategy()
            strategy.hybrid_configs = {"dp_degree": dist.get_world_size(), "mp_degree": 1, "pp_degree": 1}
            fleet.init(is_collective=True, strategy=strategy)
        set_seed(2024)
    else:
        paddle.seed(2024 + dist.get_rank())
    if args.lazy:
        with autodist.LazyGuard():  # autodist
            model = build_model()
    else:
        model = build_model()
    opt = paddle.optimizer.AdamW(learning_rate=1e-2, parameters=model.parameters())
    loader = paddle.io.DataLoader(token_dataset(1, args.samples), batch_size=BATCH)
    eval_loader = paddle.io.DataLoader(token_dataset(2, args.eval_samples), batch_size=BATCH)
    if args.plan and args.discard_return:
        autodist.apply_plan(model, opt, loader, args.plan)  # autodist
    elif args.plan:
        model, opt, loader = autodist.apply_plan(model, opt, loader, args.plan)  # autodist

    log: dict = {"losses": {}, "eval": {}}
    for step, (input_ids, labels) in enumerate(loader, start=1):
        loss = F.cross_entropy(model(input_ids).reshape([-1, VOCAB]), labels.reshape([-1]))
        loss.backward()
        opt.step()
        opt.clear_grad()
        if dist.get_rank() == 0:
            print(f"step {step} loss {float(loss):.5f}")
            log["losses"][step] = float(loss)
    model.eval()
    with paddle.no_grad():
        for step, (input_ids, labels) in enumerate(eval_loader, start=1):
            eval_loss = float(F.cross_entropy(model(input_ids).reshape([-1, VOCAB]), labels.reshape([-1])))
            if dist.get_rank() == 0:
                log["eval"][step] = eval_loss
    autodist.save_checkpoint(model, opt, os.path.join(args.out, "final"), step=len(log["losses"]))
    if dist.get_rank() == 0:
        with open(os.path.join(args.out, "log.json"), "w") as f:
            json.dump(log, f)


if __name__ == "__main__":
    main()
