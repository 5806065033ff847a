"""Multi-process CPU training harness: proves a plan trains like one device.

Modules, one job each:

- ``launcher``  start N ranks on loopback (gloo env vars, or one ``paddle.distributed.launch``
  per simulated node), hard timeout, process groups killed, stderr of failed ranks reported;
- ``jobs``      what a job asks of its ranks (``TrainRun``, ``BadPlanCase``), as JSON;
- ``rank_main`` the program each rank runs: build from a seed, distribute, train, write results;
- ``workloads`` models (docstring Llama, PaddleFormers Llama), fixed data, optimizers, the loop;
- ``plans``     hand-written plans from ``named_parameters()`` and an FQN-suffix -> style table;
- ``cases``     configurations (dp, mp, pp, sequence parallel, ZeRO, plan from hand or planner)
  trained in as few launches as possible;
- ``runner``    job files in, rank outputs out; single-device reference runs, cached;
- ``compare``   losses within 1e-5 relative, parameters within 1e-5 absolute, layouts as planned;
- ``model_files`` model files in the form autodist-plan and examples/train.py read; that script as a module;
- ``cpu_substitutes`` the TEST-ONLY P->R->S reshard stand-in for kernels the CPU wheel lacks;
- ``planning`` the planner for the tests, each model traced once per session (``plan_command``:
  the ``autodist-plan`` command in the test process);
- ``scheduling`` how ``make test``'s pytest-xdist workers are sent the files.

Example (inside a test; ``reference_runs`` is the session fixture in ``tests/conftest.py``)::

    from harness.cases import Config, check_against_reference, train_configurations

    trained = train_configurations("docstring_llama", [Config(dp=2, mp=2)], tmp_path)
    check_against_reference(trained["dp2_mp2_sgd"], reference_runs)
"""
