"""Item 1 of issue 21: the loss read on some ranks only — rank 0 alone, rank 1 alone — in every
way people read it, under any plan; and read nowhere for two steps first (what that cost is
recorded: ``autodist.applier.ranks.readable.stats()``)."""

import argparse
import json
import os
import sys

import numpy as np
import paddle
import paddle.distributed as dist
import paddle.nn.functional as F
from models import gpt
from models.zoo import mixtral_moe

import autodist

VOCAB, BATCH, SEQ = 64, 4, 8
PYTHONS_EXIT = sys.exit  # wrapped while the readable losses are open (a failing rank does not wait at exit)
PADDLES_EINSUM = paddle.einsum  # apply_plan runs dim permutations of distributed tensors locally until close()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--plan")
    parser.add_argument("--out", required=True)
    parser.add_argument("--model", choices=["gpt", "mixtral"], default="gpt")
    parser.add_argument("--readable-off", action="store_true", help="AUTODIST_READABLE=0: every rank reads")
    args = parser.parse_args()
    if args.readable_off:
        os.environ["AUTODIST_READABLE"] = "0"
    if args.plan:
        dist.init_parallel_env()
    rank = dist.get_rank()

    def reads(on_rank: int) -> bool:  # with the readable losses off, a read is Paddle's collective
        return args.readable_off or rank == on_rank

    paddle.seed(2024)
    model = {"gpt": gpt, "mixtral": mixtral_moe}[args.model].build_model()
    opt = paddle.optimizer.AdamW(learning_rate=1e-2, parameters=model.parameters())
    tokens = np.random.RandomState(1).randint(0, VOCAB, size=(4 * BATCH, SEQ + 1)).astype("int64")
    dataset = paddle.io.TensorDataset([paddle.to_tensor(tokens[:, :-1]), paddle.to_tensor(tokens[:, 1:])])
    loader = paddle.io.DataLoader(dataset, batch_size=BATCH, shuffle=False, drop_last=True)
    if args.plan:
        model, opt, loader = autodist.apply_plan(model, opt, loader, args.plan)

    from autodist.applier.ranks.readable import stats

    seen: dict = {"reads": {}}
    for step, (input_ids, labels) in enumerate(loader, start=1):
        loss = F.cross_entropy(model(input_ids).reshape([-1, VOCAB]), labels.reshape([-1]))
        if step == 3 and reads(0):  # before backward
            seen["reads"]["float_before_backward"] = float(loss)
        loss.backward()
        opt.step()
        opt.clear_grad()
        if step == 2:  # nobody has read anything yet
            seen["unread"] = stats()
        if step == 3 and reads(0):
            seen["reads"]["item"] = loss.item()
            seen["reads"]["numpy"] = float(loss.numpy())
            seen["reads"]["format"] = float(f"{loss:.6f}")
            seen["reads"]["print"] = str(loss)
            print(f"step {step} loss {loss}")
        if step == 3 and reads(1):
            seen["reads"]["rank_1_alone"] = float(loss)
    if reads(0):
        seen["reads"]["last"] = float(loss)  # the others may have left the loop already
    seen["after"] = stats()
    seen["closed"] = closed()
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump(seen, f)


def closed() -> dict:
    """``autodist.close()`` on every rank: what apply_plan set up in the process is undone
    (Paddle's own Tensor methods and reductions back, the server thread gone, the excepthook
    Python's again)."""
    import threading

    from autodist.applier.ranks.readable import patching

    paddles_own = {(owner, name): getattr(owner, name).__wrapped__ for owner, name in patching.patched()}
    autodist.close()
    return {
        "wrapped_before": len(paddles_own),
        "still_wrapped": [name for (owner, name), own in paddles_own.items() if getattr(owner, name) is not own],
        "threads": [t.name for t in threading.enumerate() if t.name == "autodist-readable"],
        "excepthook_restored": sys.excepthook is sys.__excepthook__,
        "einsum_restored": paddle.einsum is PADDLES_EINSUM,
        "exit_restored": sys.exit is PYTHONS_EXIT,
    }


if __name__ == "__main__":
    main()
