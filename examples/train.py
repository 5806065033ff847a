"""Train any model file with an autodist plan: the script to copy for real jobs.

On a GPU cluster (one launch per node)::

    autodist-plan model.py --nnodes 2 --nproc-per-node 8 -o plan.json      # once, offline, on any machine
    export AUTODIST_AGREE_SECRET_FILE=~/.autodist/agree.secret     # mode 0600, the same on every node (README, Security)
    python -m paddle.distributed.launch --nnodes 2 --nproc_per_node 8 --master HOST:PORT \\
        examples/train.py --model model.py --plan plan.json --steps 1000 --lazy

On one device, without a plan (the reference the demo compares with)::

    python examples/train.py --model model.py --steps 5

The contract with the model file (what ``autodist-plan`` reads too):

- a ``build_model()`` factory (or ``model.py:factory``);
- ``input_spec()`` or ``INPUT_SPEC``: the token ids' ``[batch, seq]``, the batch being the global
  batch per optimizer step (with ``--plan``, the plan's global batch is used);
- either ``forward(input_ids=, labels=)`` returns the loss (or a tuple whose first item is the
  loss), as PaddleFormers' ``...ForCausalLM`` classes and the docstring Llama do; or the module
  defines ``loss_fn(output, labels)`` beside a ``forward(input_ids)`` that returns logits.

The step itself (the loss, its value read on every rank, backward, the optimizer) is
``autodist.applier.training.train_step``, the one ``autodist-plan calibrate --model`` times; pass
it another ``loss_of(batch)`` for anything else. With ``--plan``, rank 0 ends with the measured step
time (the median, the first step left out) and tokens/s next to the plan's estimate, so you see
how close the cost model is on your machines (calibrate them first: ``autodist-plan calibrate
--plan plan.json --model model.py``, launched like this script, then plan with ``--cluster``).
Data here is random tokens from a fixed seed (``training.token_loader``), so two runs see the
same batches; replace it with your dataset.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import statistics
import sys
import time
from pathlib import Path

import paddle
import paddle.distributed as dist

from autodist.applier import training


def load_factory(target: str):
    """``model.py``, ``model.py:factory`` or ``pkg.module:factory`` -> (module, factory)."""
    ref, sep, name = target.rpartition(":")
    if not sep or not name.isidentifier():
        ref, name = target, "build_model"
    if ref.endswith(".py"):
        path = Path(ref).resolve()
        spec = importlib.util.spec_from_file_location(f"_train_target_{path.stem}", path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # dataclasses look their module up while it executes
        sys.path.insert(0, str(path.parent))
        spec.loader.exec_module(module)
    else:
        module = importlib.import_module(ref)
    return module, getattr(module, name)


def input_spec_of(module):
    """The module's ``input_spec()`` or ``INPUT_SPEC``."""
    if callable(getattr(module, "input_spec", None)):
        return module.input_spec()
    if hasattr(module, "INPUT_SPEC"):
        return module.INPUT_SPEC
    raise SystemExit("error: the model file defines neither input_spec() nor INPUT_SPEC")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="model.py, model.py:factory or pkg.module:factory")
    parser.add_argument("--plan", help="plan.json from autodist-plan (leave out to train on one device)")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=2024)
    parser.add_argument(
        "--lazy",
        action="store_true",
        help="with --plan, build under autodist.LazyGuard(): each rank allocates only its shard "
        "(large models) and starts from the weights of an eager build",
    )
    parser.add_argument("--losses-out", help="write the losses as JSON here (rank 0)")
    args = parser.parse_args(argv)

    world = int(os.environ.get("PADDLE_TRAINERS_NUM", "1"))
    rank = int(os.environ.get("PADDLE_TRAINER_ID", "0"))
    if world > 1:
        dist.init_parallel_env()

    module, factory = load_factory(args.model)
    paddle.seed(args.seed)  # every rank builds the same full weights
    if args.lazy and args.plan:  # apply_plan initialises it, as an eager build would have
        import autodist

        with autodist.LazyGuard():
            model = factory()
    else:  # on one device a lazy build would save nothing
        model = factory()
    batch, seq = [int(d) for d in input_spec_of(module)[0].shape]
    if args.plan:  # the global batch the plan was made for (the spec's, or --global-batch-size)
        from autodist.schemas import load_plan

        batch = load_plan(args.plan).data.global_batch_size or batch
    vocab = training.vocab_size(model)
    if vocab is None:
        raise SystemExit("error: the model has no nn.Embedding, so this script cannot make token data for it")
    loss_fn = getattr(module, "loss_fn", None)
    if not training.gives_loss(model, loss_fn):
        raise SystemExit(
            "error: the model file gives no loss: define loss_fn(output, labels) or a forward taking labels"
        )
    loader = training.token_loader(vocab, batch, seq, args.steps, args.seed)
    optimizer = paddle.optimizer.AdamW(learning_rate=args.lr, parameters=model.parameters())

    if args.plan:
        from autodist import apply_plan

        model, optimizer, loader = apply_plan(model, optimizer, loader, args.plan)
    elif world > 1:
        raise SystemExit("error: launched on several ranks without --plan")

    losses, ended = [], []
    per_step = getattr(loader, "micro_batches", 1)  # a plan that accumulates: micro-batches per step
    loss_of = training.model_loss(model, loss_fn)
    for iteration, tokens in enumerate(loader, 1):  # (input_ids, labels)
        losses.append(training.train_step(loss_of, optimizer, tokens))
        ended.append(time.perf_counter())
        if rank == 0:
            print(f"step {(iteration - 1) // per_step + 1}  loss {losses[-1]:.6f}", flush=True)
    ends = ended[per_step - 1 :: per_step]  # the end of each optimizer step
    # Seconds per optimizer step: the median, the first step (warm-up) left out, as calibrate times it.
    step_s = statistics.median(b - a for a, b in zip(ends, ends[1:])) if len(ends) > 1 else None
    if rank == 0 and args.plan and step_s:
        from autodist.schemas import load_plan

        estimate = load_plan(args.plan).estimate
        print(
            f"measured {step_s * 1e3:.1f} ms/step, {batch * seq / step_s:,.0f} tokens/s; the plan estimated "
            f"{estimate.step_time_s * 1e3:.1f} ms/step, {estimate.tokens_per_s:,.0f} tokens/s "
            f"(for {load_plan(args.plan).cluster.device.name})",
            flush=True,
        )
    if rank == 0 and args.losses_out:  # one loss per optimizer step: the mean over its micro-batches
        per_update = [sum(losses[i : i + per_step]) / per_step for i in range(0, len(losses), per_step)]
        estimated = None
        if args.plan:
            from autodist.schemas import load_plan

            estimated = load_plan(args.plan).estimate.step_time_s
        Path(args.losses_out).write_text(
            json.dumps({"world": world, "losses": per_update, "step_time_s": step_s, "estimate_step_time_s": estimated})
        )


if __name__ == "__main__":
    main()
