"""Small models shared by the tests: a GPT-2-style model, tiny PaddleFormers models, a CNN,
and single-MLP models for the negative pattern tests. Every builder takes keyword overrides so a
test can grow depth or width without a new model file.

``traced.traced("llama")`` traces a model once per test session (``(model, traced, graph)``),
shared by the planner's test files.

Tests import them as ``from models import gpt``: ``tests/`` has no ``__init__.py``, so pytest
puts ``tests/`` itself on ``sys.path``. As planner targets they load by path
(``autodist-plan tests/models/gpt.py``, ``tests/models/paddleformers_models.py:build_llama``).
"""
