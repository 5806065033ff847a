"""A training script written the way a Paddle / PaddleFormers user writes one, run under a plan,
interrupted by a checkpoint and resumed under ANOTHER plan: the run-time path end to end.

What it does: ``fleet.init`` then PaddleFormers' ``set_seed`` (each dp rank its own data-side
seed); the test suite's tiny GPT (``tests/models/gpt.py``); AdamW with a nested LR scheduler
(``LinearWarmup`` around ``CosineAnnealingDecay``) stepped every step and global-norm clipping; a
``DataLoader`` with its defaults and ``shuffle=True`` over two epochs; the loss logged on rank 0;
an evaluation every few steps under ``paddle.no_grad()``; a checkpoint with ``loader=`` part-way.
The only autodist lines are marked ``# autodist``.

Run it (from the repository root; CPU, gloo on loopback)::

    M=tests/models/gpt.py; O="--pp 1 --zero 0 --micro-batches 1 --device cpu --global-batch-size 4"
    autodist-plan $M --devices 1 --dp 1 --mp 1 $O -o /tmp/u/one.json
    autodist-plan $M --devices 2 --dp 2 --mp 1 $O -o /tmp/u/dp2.json
    autodist-plan $M --devices 2 --dp 1 --mp 2 $O -o /tmp/u/mp2.json
    # the reference: one device, uninterrupted
    python examples/user_train.py --plan /tmp/u/one.json --out /tmp/u/one
    # saved under dp2 at step 7, then resumed under mp2 and trained to the end
    python -m paddle.distributed.launch --nproc_per_node 2 examples/user_train.py \\
        --plan /tmp/u/dp2.json --out /tmp/u/a --stop-after 7
    python -m paddle.distributed.launch --nproc_per_node 2 examples/user_train.py \\
        --plan /tmp/u/mp2.json --out /tmp/u/b --resume /tmp/u/a/ckpt
    # every logged loss (train and eval) and the final parameters against the reference
    python examples/user_train.py --compare /tmp/u/one /tmp/u/a /tmp/u/b

The reference runs a 1-device plan, not the bare script: without ``apply_plan`` a shuffled
``DataLoader`` draws its order from NumPy's global generator, while every plan reads Paddle's
``DistributedBatchSampler`` order (docs/checkpoints.md, "Where the loader resumes").

What it shows (measured 2026-12-06, CPU; resumed under mp2, or under the 1-device plan with
``--resume`` and no launcher): every logged loss of both launches is the one device's within
4.8e-7 (one float32 ulp at a loss of 4), and so are the final models' logits (1e-6) and 27 of the
29 parameters (5e-7). The key third of each fused ``qkv_proj.bias`` differs by up to 4e-3: its
gradient is zero but for rounding (a bias on the keys adds the same ``q . b_k`` to every score of
a row, which softmax cancels; measured 1e-9), and AdamW's step ``m / (sqrt(v) + eps)`` turns
noise of 1e-9 against ``eps`` 1e-8 into a tenth of the learning rate, so any other summation
order (dp's half-batches already, before the resume) moves it apart. Nothing the model computes
depends on it; ``--compare`` names such parameters with their gradient and exits 1 only when a
loss or a logit differs by more than 1e-5.

Saved the other way round (``--plan mp2.json --stop-after 5``, resumed under dp2) it matches too
(measured 2026-12-06): train losses within 4.8e-7, eval within 2.4e-7, logits 1.1e-6, 27 of 29
parameters 9.5e-7. ``set_seed`` after a bare ``fleet.init`` seeds rank 1 with 2025, so rank 1
builds another model; apply_plan starts every rank from rank 0's model before it shards it
(applier/placement/replicas.py), so rank 1's columns of each split weight are rank 0's, the one
device's. Before that, the mp2 run started from another model, with no message (step 1: 4.3674
against 4.3347).
"""

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np
import paddle
import paddle.distributed as dist
import paddle.nn.functional as F
from paddle.distributed import fleet

import autodist  # autodist

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from models.gpt import build_model  # noqa: E402  (the test suite's tiny GPT, as the planner loads it)

VOCAB, BATCH, SEQ, SAMPLES = 64, 4, 8, 24  # 24 samples: 6 full batches of 4 a pass
SEED = 2024


def token_dataset(seed: int, samples: int) -> paddle.io.TensorDataset:
    """Random token ids from a fixed seed; labels are the inputs shifted by one."""
    tokens = np.random.RandomState(seed).randint(0, VOCAB, size=(samples, SEQ + 1)).astype("int64")
    return paddle.io.TensorDataset([paddle.to_tensor(tokens[:, :-1]), paddle.to_tensor(tokens[:, 1:])])


def lm_loss(model, input_ids, labels):
    return F.cross_entropy(model(input_ids).reshape([-1, VOCAB]), labels.reshape([-1]))


def evaluate(model, loader) -> float:
    model.eval()
    with paddle.no_grad():
        losses = [float(lm_loss(model, input_ids, labels)) for input_ids, labels in loader]
    model.train()
    return sum(losses) / len(losses)


def train(args) -> None:
    fleet.init(is_collective=True)
    from paddleformers.trainer.trainer_utils import set_seed

    set_seed(SEED)  # paddle, numpy and random seeded with SEED + the dp rank

    model = build_model()
    total_steps = args.epochs * SAMPLES // BATCH
    cosine = paddle.optimizer.lr.CosineAnnealingDecay(learning_rate=1e-2, T_max=total_steps)
    scheduler = paddle.optimizer.lr.LinearWarmup(cosine, warmup_steps=3, start_lr=1e-3, end_lr=1e-2)
    # as PaddleFormers' Trainer decays: every trainable parameter but biases and norms
    decay = [
        p.name for n, p in model.named_parameters() if not p.stop_gradient and not any(k in n for k in ("bias", "norm"))
    ]
    opt = paddle.optimizer.AdamW(
        learning_rate=scheduler,
        parameters=model.parameters(),
        weight_decay=0.01,
        apply_decay_param_fun=lambda name: name in decay,
        grad_clip=paddle.nn.ClipGradByGlobalNorm(clip_norm=1.0),
    )
    loader = paddle.io.DataLoader(token_dataset(1, SAMPLES), batch_size=BATCH, shuffle=True)
    eval_loader = paddle.io.DataLoader(token_dataset(2, 8), batch_size=BATCH)
    model, opt, loader = autodist.apply_plan(model, opt, loader, args.plan)  # autodist

    step = 0
    if args.resume:
        step = autodist.load_checkpoint(model, opt, args.resume, loader=loader).step  # autodist
    log: dict = {"train": {}, "eval": {}}
    for _ in range(step // len(loader), args.epochs):
        for input_ids, labels in loader:
            step += 1
            loss = lm_loss(model, input_ids, labels)
            loss.backward()
            opt.step()
            opt.clear_grad()
            if dist.get_rank() == 0:
                print(f"step {step} loss {float(loss):.6f} lr {scheduler.get_lr():.6f}", flush=True)
                log["train"][step] = float(loss)
            scheduler.step()
            if step % args.eval_every == 0:
                eval_loss = evaluate(model, eval_loader)
                if dist.get_rank() == 0:
                    print(f"step {step} eval loss {eval_loss:.6f}", flush=True)
                    log["eval"][step] = eval_loss
            if step == args.stop_after:  # autodist: where the loader stands is saved too
                autodist.save_checkpoint(model, opt, os.path.join(args.out, "ckpt"), step=step, loader=loader)
                break
        if step == args.stop_after:
            break
    else:
        autodist.save_checkpoint(model, opt, os.path.join(args.out, "final"), step=step)  # autodist
    if dist.get_rank() == 0:
        Path(args.out, "log.json").write_text(json.dumps(log))


def final_model(out: str):
    """The model of ``out``'s final checkpoint, loaded on this one device."""
    paddle.seed(0)  # any weights: the checkpoint replaces every one
    model = build_model()
    autodist.load_checkpoint(model, None, os.path.join(out, "final"))
    return model


def compare(reference: str, first: str, second: str) -> None:
    """The largest difference from the reference of each phase's logged losses, of the final
    parameters (each one beyond 1e-5 named, with the reference's gradient of it on the first
    training batch) and of the final models' logits on the eval data. Exits 1 when a loss or a
    logit differs by more than 1e-5."""
    ref = json.loads(Path(reference, "log.json").read_text())
    logs = [json.loads(Path(out, "log.json").read_text()) for out in (first, second)]
    worst = 0.0
    for phase, log in zip(("first launch", "resumed launch"), logs):
        for kind in ("train", "eval"):
            steps = sorted(log[kind], key=int)
            gap = max(abs(log[kind][s] - ref[kind][s]) for s in steps)
            worst = max(worst, gap)
            print(f"{phase}: {kind} steps {steps[0]}-{steps[-1]} ({len(steps)}): max |loss - one device| {gap:.3g}")
    seen = sorted({int(s) for log in logs for s in log["train"]})
    if seen != sorted(int(s) for s in ref["train"]):
        raise SystemExit(f"error: the two launches trained steps {seen}, the reference {sorted(ref['train'])}")
    expected, got = final_model(reference), final_model(second)
    input_ids, labels = next(iter(paddle.io.DataLoader(token_dataset(1, SAMPLES), batch_size=BATCH)))
    lm_loss(expected, input_ids, labels).backward()
    theirs = dict(got.named_parameters())
    gaps = {name: float(np.abs(p.numpy() - theirs[name].numpy()).max()) for name, p in expected.named_parameters()}
    within = [gap for gap in gaps.values() if gap <= 1e-5]
    print(
        f"final parameters: {len(within)} of {len(gaps)} within 1e-5 (max {max(within, default=0.0):.3g}); the others:"
    )
    for name, p in expected.named_parameters():
        if gaps[name] > 1e-5:
            gap_at = np.abs(p.numpy() - theirs[name].numpy()) > 1e-5
            print(
                f"  {name}: {gaps[name]:.3g} at {int(gap_at.sum())} of {p.size} entries, where the one-device "
                f"gradient is at most {float(np.abs(p.grad.numpy()[gap_at]).max()):.3g}"
            )
    eval_loader = paddle.io.DataLoader(token_dataset(2, 8), batch_size=BATCH)
    with paddle.no_grad():
        gap = max(float((expected(ids) - got(ids)).abs().max()) for ids, _ in eval_loader)
    worst = max(worst, gap)
    print(f"final models' logits on the eval data: max |logit - one device| {gap:.3g}")
    if worst > 1e-5:
        raise SystemExit(f"error: differs from one device by {worst:.3g} (> 1e-5)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--plan", help="the plan this launch trains under")
    parser.add_argument("--out", help="folder for log.json and the checkpoints")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--eval-every", type=int, default=3)
    parser.add_argument("--stop-after", type=int, help="save a checkpoint (with the loader) after this step and stop")
    parser.add_argument("--resume", help="a checkpoint folder to resume from, saved under any plan")
    parser.add_argument(
        "--compare", nargs=3, metavar=("REFERENCE", "FIRST", "SECOND"), help="compare three --out folders"
    )
    args = parser.parse_args()
    if args.compare:
        compare(*args.compare)
    elif args.plan and args.out:
        train(args)
    else:
        parser.error("give --plan and --out to train, or --compare")


if __name__ == "__main__":
    main()
