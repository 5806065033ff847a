"""How ``make test``'s pytest-xdist workers are sent the suite (``-n 3 --dist loadfile``):
which test files go to one worker together, and in which order the units of work are sent.

A worker is sent one unit at a time and runs it whole (module fixtures stay in one process).
pytest-xdist sends the units with the most tests first, so a long multi-process file with few
tests (tests/loops/test_elastic.py: 7 tests, 4 minutes) started last and ran on alone while the
other workers had finished. Here the units holding a multi-process test go first (they are the
long ones: ranks starting and waiting on each other), each group by its number of tests.

    >>> scope_of("tests/test_train_zoo.py::test_zoo_model_trains_like_one_device[x]")
    'tests/test_zoo.py'
    >>> scope_of("tests/loops/test_elastic.py::test_x")
    'tests/loops/test_elastic.py'
"""

from __future__ import annotations

from collections import Counter

#: Test files a worker runs together with the file named: a worker traces each model once
#: (harness/planning.py), and these files plan the same zoo models at the same input specs, so
#: in one worker they trace them once, not once in each of two workers.
SAME_WORKER = {"tests/test_train_zoo.py": "tests/test_zoo.py"}


def scope_of(nodeid: str) -> str:
    """The unit of work a test belongs to: its file, or the file :data:`SAME_WORKER` names."""
    file = nodeid.split("::", 1)[0]
    return SAME_WORKER.get(file, file)


def in_sending_order(items: list) -> list:
    """``items`` (pytest's) unit by unit, the units holding a ``multiprocess`` test first, then
    each group by its number of tests, most first (pytest-xdist's own order within a group)."""
    tests: Counter[str] = Counter()
    multiprocess = set()
    for item in items:
        scope = scope_of(item.nodeid)
        tests[scope] += 1
        if item.get_closest_marker("multiprocess"):
            multiprocess.add(scope)

    def order(item) -> tuple[bool, int, str]:
        scope = scope_of(item.nodeid)
        return scope not in multiprocess, -tests[scope], scope

    return sorted(items, key=order)


def make_scheduler(config, log):
    """pytest-xdist's ``--dist loadfile`` scheduler with :func:`scope_of`'s units, sent in the
    order the workers collected them (:func:`in_sending_order`), not most-tests-first."""
    from xdist.scheduler import LoadScopeScheduling

    class SameWorkerScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return scope_of(nodeid)

    config.option.loadscopereorder = False
    return SameWorkerScheduling(config, log)
