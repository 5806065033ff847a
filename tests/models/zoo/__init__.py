"""The model zoo: small, self-contained models written the way their communities write them.

Each file is a planner target (``autodist-plan tests/models/zoo/<name>.py``) with
``build_model()``, ``input_spec()``, ``VOCAB`` (the token range the training harness draws) and
``loss(model, tokens, labels)`` (the model's own objective on a batch of token ids). Nothing in
them is adapted to the planner; tests/test_zoo.py holds, per model, the placements a reader
expects for a 2-device tensor-parallel plan.
"""
