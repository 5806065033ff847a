"""Loop (h): nanoGPT with its dropouts (embedding, attention probabilities, residuals, 0.1 each)
trained 10 steps, each rank seeded ``2024 + rank`` before the build as a script that wants its
own dropout per rank does (``--seed alike``: 2024 everywhere). What every rank holds at the end
goes to ``rank<R>.json``: a digest of each parameter's local value, and at step 1 which
elements the first block's attention-probability dropout zeroed on this rank."""

import argparse
import hashlib
import json
import os

import numpy as np
import paddle
import paddle.distributed as dist
import paddle.nn.functional as F
from models.zoo import nanogpt

import autodist

BATCH, SEQ, STEPS = 4, 8, 10


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--plan", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--seed", choices=["per-rank", "alike"], default="per-rank")
    args = parser.parse_args()
    dist.init_parallel_env()
    rank = dist.get_rank()
    paddle.seed(2024 + (rank if args.seed == "per-rank" else 0))
    model = nanogpt.build_model()
    opt = paddle.optimizer.AdamW(learning_rate=1e-2, parameters=model.parameters())
    tokens = np.random.RandomState(1).randint(0, nanogpt.VOCAB, size=(STEPS * BATCH, SEQ + 1)).astype("int64")
    dataset = paddle.io.TensorDataset([paddle.to_tensor(tokens[:, :-1]), paddle.to_tensor(tokens[:, 1:])])
    loader = paddle.io.DataLoader(dataset, batch_size=BATCH)
    model, opt, loader = autodist.apply_plan(model, opt, loader, args.plan)

    seen: dict = {}

    def dropped(layer, inputs, output):
        if "mask" not in seen:
            local = output._local_value() if output.is_dist() else output
            seen["mask"] = (local.numpy() == 0).astype(int).reshape(-1).tolist()

    model.transformer["h"][0].attn.attn_dropout.register_forward_post_hook(dropped)
    model.train()
    for x, y in loader:
        loss = F.cross_entropy(model(x).reshape([-1, nanogpt.VOCAB]), y.reshape([-1]))
        loss.backward()
        opt.step()
        opt.clear_grad()
    seen["digests"] = {
        name: hashlib.sha256(np.ascontiguousarray((p._local_value() if p.is_dist() else p).numpy()).data).hexdigest()
        for name, p in model.named_parameters()
    }
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump(seen, f)


if __name__ == "__main__":
    main()
