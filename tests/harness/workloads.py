"""The training workloads the harness runs: a model, its data, its loss, an optimizer.

One code path serves the single-device reference and every rank, so the only difference
between them is what :mod:`harness.rank_main` does to the model before training.

Everything is seeded: the model is built after ``paddle.seed(seed)``, so every rank and the
reference start from the same full weights, and the data is a fixed ``numpy`` draw.

Example::

    >>> w = WORKLOADS["paddleformers_llama"]
    >>> model = w.build(seed=2024)                        # doctest: +SKIP
    >>> loader = make_loader(w, steps=3, seed=2024)        # doctest: +SKIP
"""

from __future__ import annotations

import importlib.util
import sys
from dataclasses import dataclass
from typing import Callable

import numpy as np
import paddle

from .launcher import REPO_ROOT

#: Global batch (divisible by dp = 2) and sequence length: tiny, a 2-core machine runs 4 ranks.
BATCH, SEQ = 4, 8


@dataclass(frozen=True)
class Workload:
    """A model kind: how to build it and how to get a scalar loss from one batch."""

    name: str
    vocab_size: int
    build_unseeded: Callable[[], paddle.nn.Layer]
    loss: Callable[[paddle.nn.Layer, paddle.Tensor, paddle.Tensor], paddle.Tensor]
    #: ``autodist-plan`` TARGET that builds the same model, and the environment it needs.
    planner_target: str
    planner_env: dict[str, str]
    #: ``pipeline_loss(model)`` is the ``loss_fn(logits, labels)`` a user passes to apply_plan
    #: for a pipeline schedule (which computes the loss from the first tensor the model
    #: returns): the same formula as the model's own loss.
    pipeline_loss: Callable[[paddle.nn.Layer], Callable[[paddle.Tensor, paddle.Tensor], paddle.Tensor]]

    def build(self, seed: int) -> paddle.nn.Layer:
        paddle.seed(seed)
        return self.build_unseeded()


def load_model_file(relpath: str, name: str):
    """Import a model file by path (``plans/`` is a folder of example files, not a package)."""
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, REPO_ROOT / relpath)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses look their module up while it executes
        spec.loader.exec_module(module)
    return sys.modules[name]


def _docstring_llama(num_layers: int) -> Workload:
    """The docstring Llama with ``num_layers`` decoder layers."""
    config = {**DOCSTRING_LLAMA_CONFIG, "num_layers": num_layers}

    def build() -> paddle.nn.Layer:
        mod = load_model_file("plans/llama_docstring/model.py", "llama_docstring_model")
        return mod.build_model(**config)

    return Workload(
        name="docstring_llama" if num_layers == 2 else f"docstring_llama_{num_layers}_layers",
        vocab_size=config["vocab_size"],
        build_unseeded=build,
        # forward(input_ids, position_ids=None, attention_mask=None, labels=None) -> (loss, logits)
        loss=lambda model, inputs, labels: model(inputs, labels=labels)[0],
        planner_target="plans/llama_docstring/model.py",
        # The model file reads its sizes from LLAMA_DOCSTRING_<FIELD> (LlamaConfig.from_env).
        planner_env={f"LLAMA_DOCSTRING_{k.upper()}": str(v) for k, v in config.items()},
        pipeline_loss=lambda model: _docstring_llama_loss,
    )


def _build_paddleformers_llama() -> paddle.nn.Layer:
    from models.paddleformers_models import build_llama

    return build_llama()


def _build_untied_paddleformers_llama() -> paddle.nn.Layer:
    from models.paddleformers_models import build_untied_llama

    return build_untied_llama()


def _build_gpt() -> paddle.nn.Layer:
    from models.gpt import build_model

    return build_model()


def _gpt_loss(logits: paddle.Tensor, labels: paddle.Tensor) -> paddle.Tensor:
    """Mean token cross-entropy, as nanoGPT computes it."""
    return paddle.nn.functional.cross_entropy(logits, labels.unsqueeze(-1))


#: The docstring Llama of ``paddle.distributed.to_distributed`` at tiny sizes (2 layers).
DOCSTRING_LLAMA_CONFIG = dict(
    vocab_size=64, hidden_size=32, intermediate_size=64, num_heads=4, num_layers=2, seq_length=SEQ
)

WORKLOADS = {
    w.name: w
    for w in [
        _docstring_llama(num_layers=2),
        _docstring_llama(num_layers=3),  # "a model of another size" on one rank
        _docstring_llama(num_layers=4),  # VPP: two chunks on each of two stages
        Workload(
            name="paddleformers_llama",
            vocab_size=64,
            build_unseeded=_build_paddleformers_llama,
            # LlamaForCausalLM returns (loss, logits, ...) when given labels.
            loss=lambda model, inputs, labels: model(input_ids=inputs, labels=labels)[0],
            planner_target="tests/models/paddleformers_models.py:build_llama",
            planner_env={},
            pipeline_loss=lambda model: lambda logits, labels: model.criterion(logits, labels)[0],
        ),
        Workload(
            name="paddleformers_llama_untied",
            vocab_size=64,
            build_unseeded=_build_untied_paddleformers_llama,
            loss=lambda model, inputs, labels: model(input_ids=inputs, labels=labels)[0],
            planner_target="tests/models/paddleformers_models.py:build_untied_llama",
            planner_env={},
            pipeline_loss=lambda model: lambda logits, labels: model.criterion(logits, labels)[0],
        ),
        Workload(
            name="gpt",
            vocab_size=64,
            build_unseeded=_build_gpt,
            # forward(input_ids) -> logits
            loss=lambda model, inputs, labels: _gpt_loss(model(inputs), labels),
            planner_target="tests/models/gpt.py",
            planner_env={},
            pipeline_loss=lambda model: _gpt_loss,
        ),
    ]
}


def _docstring_llama_loss(logits: paddle.Tensor, labels: paddle.Tensor) -> paddle.Tensor:
    """The docstring Llama's own loss (plans/llama_docstring/model.py): token cross-entropy
    averaged over the tokens whose loss is positive."""
    per_token = paddle.nn.functional.cross_entropy(logits.astype("float32"), labels.unsqueeze(2), reduction="none")
    counted = paddle.where(per_token > 0, paddle.ones_like(per_token), paddle.zeros_like(per_token))
    return paddle.sum(per_token * counted) / paddle.sum(counted)


def without_dropout(model: paddle.nn.Layer) -> paddle.nn.Layer:
    """Dropout probabilities set to 0 for training comparisons: a rank that holds part of a
    batch or of a tensor draws a different random mask than one device does for the whole, so
    losses compare only without dropout. The planner still sees the model as written."""
    for layer in model.sublayers(include_self=True):
        if isinstance(layer, paddle.nn.Dropout):
            layer.p = 0.0
        elif isinstance(layer, paddle.nn.MultiHeadAttention):
            layer.dropout = 0.0
    return model


def _no_pipeline(model: paddle.nn.Layer):
    """A zoo model without ``logits_loss`` trains without a pipeline schedule: its pipeline loss
    is never called."""

    def refuse(logits, labels):
        raise ValueError("this zoo workload has no logits_loss: it trains without a pipeline schedule")

    return refuse


def _zoo_workload(name: str) -> Workload:
    """A model of tests/models/zoo/ with its own ``loss(model, tokens, labels)`` (and, to train
    under a pipeline schedule, ``logits_loss(logits, labels)``): ``file`` builds with its
    ``build_model``, ``file:factory`` with another factory of the file (a variant,
    :data:`ZOO_VARIANTS`)."""
    file, _, factory = name.partition(":")
    relpath = f"tests/models/zoo/{file}.py"
    module = load_model_file(relpath, f"zoo_{file}")
    build = getattr(module, factory or "build_model")
    return Workload(
        name=f"zoo_{file}" + (f"_{factory.removeprefix('build_')}" if factory else ""),
        vocab_size=module.VOCAB,
        build_unseeded=lambda: without_dropout(build()),
        loss=module.loss,
        planner_target=relpath + (f":{factory}" if factory else ""),
        planner_env={},
        pipeline_loss=(lambda model: module.logits_loss) if hasattr(module, "logits_loss") else _no_pipeline,
    )


def _paddleformers_workload(factory: str) -> Workload:
    """A PaddleFormers class of the zoo (tests/models/paddleformers_models.py), causal-LM loss."""

    def build():
        from models import paddleformers_models

        return getattr(paddleformers_models, factory)()

    return Workload(
        name=f"zoo_pf_{factory.removeprefix('build_')}",
        vocab_size=64,
        build_unseeded=build,
        loss=lambda model, inputs, labels: model(input_ids=inputs, labels=labels)[0],
        planner_target=f"tests/models/paddleformers_models.py:{factory}",
        planner_env={},
        pipeline_loss=_no_pipeline,
    )


def _tied_by_call(target: str) -> Workload:
    """A model whose embedding and head share a weight through a function call
    (tests/test_tied_by_call.py), with its logits loss for a pipeline: ``target`` is
    ``file.py`` or ``file.py:factory``."""
    relpath, _, factory = target.partition(":")
    module = load_model_file(relpath, f"zoo_{relpath.rpartition('/')[2].removesuffix('.py')}")
    build = getattr(module, factory or "build_model")
    return Workload(
        name=f"tied_by_call_{factory or relpath.rpartition('/')[2].removesuffix('.py')}",
        vocab_size=module.VOCAB,
        build_unseeded=lambda: without_dropout(build()),
        loss=module.loss,
        planner_target=target,
        planner_env={},
        pipeline_loss=lambda model: module.logits_loss,
    )


#: The three spellings of a tie by function call, trained under pipelines.
TIED_BY_CALL = (
    "tests/models/zoo/nanogpt.py",
    "tests/models/tied_by_call.py:build_linear_head",
    "tests/models/tied_by_call.py:build_embedding_from_head",
)
WORKLOADS.update({w.name: w for w in map(_tied_by_call, TIED_BY_CALL)})

#: The zoo: every file of tests/models/zoo/ (one model each, with ``build_model``, ``VOCAB`` and
#: ``loss``; found by listing the folder) and the PaddleFormers classes. Each one's expected
#: placements are in tests/test_zoo.py (``EXPECTED``), which fails for a zoo file without them.
ZOO_FILES = tuple(
    sorted(path.stem for path in (REPO_ROOT / "tests/models/zoo").glob("*.py") if path.stem != "__init__")
)
#: Zoo models built by another factory of their file (``file:factory``): DeepSeek-V3's query
#: through a latent (``zoo_deepseek_v3_hf_with_query_latent``); GPT-2 with four blocks, two VPP
#: chunks on each of two stages (``zoo_gpt2_hf_4_layers``); timm's BEiT without q/v biases
#: (``zoo_beit_timm_without_qkv_bias``: its fused projection read by ``F.linear``, with no bias to
#: concatenate; a local view like the biased build's).
ZOO_VARIANTS = (
    "deepseek_v3_hf:build_with_query_latent",
    "vit:build_with_transpose_y",
    "gpt2_hf:build_4_layers",
    "beit_timm:build_without_qkv_bias",
)
ZOO_PADDLEFORMERS = ("build_llama", "build_phi3", "build_gemma3", "build_ernie45", "build_gpt_oss")
WORKLOADS.update(
    {
        w.name: w
        for w in [
            *map(_zoo_workload, ZOO_FILES + ZOO_VARIANTS),
            *map(_paddleformers_workload, ZOO_PADDLEFORMERS),
        ]
    }
)


class TokenDataset(paddle.io.Dataset):
    """Fixed random token sequences; labels are the inputs shifted by one."""

    def __init__(self, vocab_size: int, samples: int, seed: int, seq: int = SEQ):
        tokens = np.random.RandomState(seed).randint(0, vocab_size, size=(samples, seq + 1)).astype("int64")
        self.inputs, self.labels = tokens[:, :-1], tokens[:, 1:]

    def __getitem__(self, idx):
        return self.inputs[idx], self.labels[idx]

    def __len__(self):
        return len(self.inputs)


def make_loader(
    workload: Workload, steps: int, seed: int, first_step: int = 0, batch: int = BATCH
) -> paddle.io.DataLoader:
    """``steps`` global batches of ``batch`` sequences, in a fixed order (no shuffling),
    starting at batch ``first_step`` of the seed's stream (where a resumed run goes on)."""
    dataset = TokenDataset(workload.vocab_size, (first_step + steps) * batch, seed)
    if first_step:
        dataset = paddle.io.Subset(dataset, list(range(first_step * batch, len(dataset))))
    sampler = paddle.io.BatchSampler(dataset, batch_size=batch, shuffle=False, drop_last=True)
    return paddle.io.DataLoader(dataset, batch_sampler=sampler)


def make_optimizer(kind: str, parameters) -> tuple[paddle.optimizer.Optimizer, paddle.optimizer.lr.LRScheduler | None]:
    """SGD, or AdamW with weight decay, a learning-rate schedule and global-norm clipping, so
    a rebuilt optimizer has to carry over every one of them to train identically (with a warmup
    around a cosine decay: ``adamw_warmup_cosine``), or any other built-in optimizer by its
    lower-case name (``momentum``, ``lamb``, ...) with a step schedule. Returns the
    optimizer and the schedule the training loop steps (the user's handle, as in real code)."""
    if kind == "sgd":
        return paddle.optimizer.SGD(learning_rate=0.1, parameters=parameters), None
    if kind == "sgd_clip":  # the update scales with the clip: a wrong global norm shows in the losses
        clip = paddle.nn.ClipGradByGlobalNorm(1.0)
        return paddle.optimizer.SGD(learning_rate=0.1, parameters=parameters, grad_clip=clip), None
    if kind in ("adamw", "adamw_warmup_cosine"):
        if kind == "adamw":
            schedule = paddle.optimizer.lr.StepDecay(learning_rate=1e-3, step_size=2, gamma=0.5)
        else:  # the nested schedule training scripts write: warm up, then decay
            cosine = paddle.optimizer.lr.CosineAnnealingDecay(learning_rate=1e-3, T_max=4)
            schedule = paddle.optimizer.lr.LinearWarmup(cosine, warmup_steps=2, start_lr=1e-4, end_lr=1e-3)
        optimizer = paddle.optimizer.AdamW(
            learning_rate=schedule,
            parameters=parameters,
            weight_decay=0.01,
            grad_clip=paddle.nn.ClipGradByGlobalNorm(1.0),
        )
        return optimizer, schedule
    if kind == "rprop":  # Rprop takes a float learning rate only: it adapts one per element
        return paddle.optimizer.Rprop(learning_rate=1e-2, parameters=parameters), None
    if kind in BUILT_IN_OPTIMIZERS:  # Paddle's class of that name with its defaults and a step schedule
        schedule = paddle.optimizer.lr.StepDecay(learning_rate=1e-2, step_size=2, gamma=0.5)
        return BUILT_IN_OPTIMIZERS[kind](learning_rate=schedule, parameters=parameters), schedule
    raise ValueError(
        f"unknown optimizer {kind!r} (sgd, sgd_clip, adamw, adamw_warmup_cosine or {sorted(BUILT_IN_OPTIMIZERS)})"
    )


#: Paddle's built-in optimizers by lower-case name, for ``make_optimizer``.
BUILT_IN_OPTIMIZERS = {
    cls.__name__.lower(): cls
    for cls in (
        paddle.optimizer.Momentum,
        paddle.optimizer.Adam,
        paddle.optimizer.Lamb,
        paddle.optimizer.Adagrad,
        paddle.optimizer.RMSProp,
        paddle.optimizer.Adadelta,
        paddle.optimizer.Adamax,
        paddle.optimizer.NAdam,
        paddle.optimizer.RAdam,
        paddle.optimizer.Rprop,
    )
}


def train(workload: Workload, model, optimizer, schedule, loader, steps: int) -> list[float]:
    """Run ``steps`` training steps; return each step's loss as a float (replicated first when
    it is a distributed tensor, so every rank reports the global loss). A loader that yields
    micro-batches (a plan that accumulates gradients) takes ``micro_batches`` iterations per
    step, and the step's loss is their mean: the whole batch's mean loss."""
    per_step = getattr(loader, "micro_batches", 1)
    losses = []
    for iteration, (inputs, labels) in enumerate(loader):
        if iteration == steps * per_step:
            break
        loss = workload.loss(model, inputs, labels)
        losses.append(to_numpy(loss).item())
        loss.backward()
        optimizer.step()
        optimizer.clear_grad()
        if schedule is not None:
            schedule.step()
    return [sum(losses[i : i + per_step]) / per_step for i in range(0, len(losses), per_step)]


def to_numpy(tensor: paddle.Tensor) -> np.ndarray:
    """The full value of a (possibly distributed) tensor on this rank."""
    if tensor.is_dist():
        import paddle.distributed as dist

        replicated = dist.reshard(tensor, tensor.process_mesh, [dist.Replicate()] * len(tensor.placements))
        return replicated._local_value().numpy()
    return tensor.numpy()
