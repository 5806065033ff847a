"""The test models traced once per test session: ``traced("llama")`` -> ``(model, traced, graph)``.

Names: ``docstring`` (to_distributed's docstring Llama, tiny), ``llama`` (PaddleFormers, GQA,
tied head), ``llama_untied``, ``phi3``, ``gemma3``, ``gpt``, ``gpt_sdpa`` (attention through
``F.scaled_dot_product_attention``), ``cnn``, ``swiglu_mlp``, ``gelu_mlp``; a suffix
``@N`` sets the number of layers (``gpt@8``).
"""

from __future__ import annotations

import functools
from pathlib import Path

import paddle

from . import gpt
from . import paddleformers_models as pf

DOCSTRING_MODEL = Path(__file__).resolve().parents[2] / "plans" / "llama_docstring" / "model.py"
TINY_DOCSTRING = dict(hidden_size=32, intermediate_size=64, num_heads=4, vocab_size=64, seq_length=16)


@functools.lru_cache(maxsize=1)
def docstring_module():
    from autodist.planner.load import import_model_file

    return import_model_file(DOCSTRING_MODEL)


def build(name: str, layers: int = 2):
    """``(model, input_specs)`` for a test model name."""
    if name == "docstring":
        module = docstring_module()
        return module.build_model(num_layers=layers, **TINY_DOCSTRING), [
            paddle.static.InputSpec([2, TINY_DOCSTRING["seq_length"]], "int64", "input_ids")
        ]
    if name == "llama":
        return pf.build_llama(num_hidden_layers=layers), pf.input_spec()
    if name == "llama_untied":
        return pf.build_llama(num_hidden_layers=layers, tie_word_embeddings=False), pf.input_spec()
    if name == "phi3":
        return pf.build_phi3(num_hidden_layers=layers), pf.input_spec()
    if name == "gemma3":
        return pf.build_gemma3(num_hidden_layers=layers), pf.input_spec()
    if name == "gpt":
        return gpt.build_model(num_layers=layers), gpt.input_spec()
    if name == "gpt_sdpa":
        return gpt.build_model(num_layers=layers, sdpa=True), gpt.input_spec()
    if name == "cnn":
        return pf.build_cnn(), pf.cnn_input_spec()
    if name == "swiglu_mlp":
        return pf.SwiGLUMLP(), pf.mlp_input_spec()
    if name == "gelu_mlp":
        return pf.GELUMLP(), pf.mlp_input_spec()
    raise KeyError(name)


@functools.lru_cache(maxsize=None)
def traced(key: str):
    """``(model, TracedProgram, graph)`` for ``"name"`` or ``"name@layers"``, built once."""
    from autodist.planner import driver

    name, _, layers = key.partition("@")
    model, specs = build(name, int(layers or 2))
    made = driver.trace(model, specs)
    return model, made.program, made.graph
