"""A dp2 job a stranger probes (tests/loops/test_readable_strangers.py): each rank makes a loss,
says where its readable side channel listens (what ``ss -tlnp`` would tell the stranger) and
waits until the stranger is done; then rank 0 reads that loss and the next one, fetched from
rank 1 over the side channel, and every rank exits. ``--rank-1-dies``: rank 1 ends at once
instead, as a killed rank does (no exit handlers), and rank 0 reads, then exits. ``--rank-1-exits``:
rank 1 leaves through ``sys.exit(3)`` instead, as a script does on an error, noting when first."""

import argparse
import json
import os
import sys
import time

import numpy as np
import paddle
import paddle.distributed as dist
import paddle.nn.functional as F
from models import gpt

import autodist

VOCAB, BATCH, SEQ = 64, 4, 8


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--plan", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--rank-1-dies", action="store_true")
    parser.add_argument("--rank-1-exits", action="store_true")
    args = parser.parse_args()
    dist.init_parallel_env()
    rank = dist.get_rank()
    paddle.seed(2024)
    model = gpt.build_model()
    opt = paddle.optimizer.AdamW(learning_rate=1e-2, parameters=model.parameters())
    tokens = np.random.RandomState(1).randint(0, VOCAB, size=(2 * BATCH, SEQ + 1)).astype("int64")
    dataset = paddle.io.TensorDataset([paddle.to_tensor(tokens[:, :-1]), paddle.to_tensor(tokens[:, 1:])])
    loader = paddle.io.DataLoader(dataset, batch_size=BATCH, shuffle=False, drop_last=True)
    model, opt, loader = autodist.apply_plan(model, opt, loader, args.plan)

    from autodist.applier.ranks import readable
    from autodist.applier.ranks.readable.notes import current
    from autodist.applier.ranks.readable.store import address

    losses = [F.cross_entropy(model(x).reshape([-1, VOCAB]), y.reshape([-1])) for x, y in loader]
    seen = {"locals": [float(loss._local_value().numpy()) for loss in losses]}
    host, port = address(current(), rank, time.monotonic() + 60)
    with open(os.path.join(args.out, f"ready{rank}.json"), "w") as f:
        json.dump({"pid": os.getpid(), "host": host, "port": port}, f)
    if rank == 1 and args.rank_1_dies:
        os._exit(0)
    if rank == 1 and args.rank_1_exits:
        with open(os.path.join(args.out, "exiting1.json"), "w") as f:
            json.dump({"at": time.time()}, f)
        sys.exit(3)
    go = os.path.join(args.out, "go")
    deadline = time.monotonic() + 120
    while not os.path.exists(go) and time.monotonic() < deadline:
        time.sleep(0.05)
    if rank == 0 and args.rank_1_dies:  # read once rank 1 is gone, not while it may still answer
        _wait_until_gone(os.path.join(args.out, "ready1.json"), time.monotonic() + 60)
    if rank == 0:
        start = time.monotonic()
        try:
            seen["reads"] = [float(loss) for loss in losses]
        except readable.ReadError as err:
            seen["error"] = str(err)
        seen["seconds"] = time.monotonic() - start
        seen["done"] = time.time()
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump(seen, f)


def _wait_until_gone(ready: str, deadline: float) -> None:
    """Until the rank that wrote ``ready`` has ended (gone, or a zombie its launcher has not reaped)."""
    while not os.path.exists(ready) and time.monotonic() < deadline:
        time.sleep(0.05)
    with open(ready) as f:
        pid = json.load(f)["pid"]
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return
        except FileNotFoundError:
            return
        time.sleep(0.05)


if __name__ == "__main__":
    main()
