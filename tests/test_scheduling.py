"""``make test``'s pytest-xdist scheduling (harness/scheduling.py), with pytest-xdist's own
scheduler and stand-in workers: the multi-process files are sent first, and the files that plan
the same zoo models go to one worker together."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from harness.scheduling import in_sending_order, make_scheduler

pytest_plugins = "pytester"


class Item:
    """What in_sending_order reads of a pytest item."""

    def __init__(self, nodeid: str, multiprocess: bool = False):
        self.nodeid, self.multiprocess = nodeid, multiprocess

    def get_closest_marker(self, name: str):
        return pytest.mark.multiprocess if name == "multiprocess" and self.multiprocess else None


class Worker:
    """A pytest-xdist worker as its scheduler sees one: the tests it is sent, by index."""

    def __init__(self, name: str):
        self.gateway = SimpleNamespace(id=name)
        self.sent: list[int] = []
        self.shutting_down = False

    def send_runtest_some(self, indices):
        self.sent.extend(indices)

    def shutdown(self):
        self.shutting_down = True


def test_the_multi_process_files_go_first_then_by_number_of_tests():
    items = [
        Item("tests/test_a.py::one"),
        Item("tests/test_a.py::two"),
        Item("tests/test_a.py::three"),
        Item("tests/loops/test_elastic.py::lost", multiprocess=True),
        Item("tests/test_b.py::one"),
        Item("tests/test_train_zoo.py::trains", multiprocess=True),
        Item("tests/test_zoo.py::plans"),
        Item("tests/test_zoo.py::plans_again"),
    ]
    assert [item.nodeid for item in in_sending_order(items)] == [
        # test_zoo's unit holds test_train_zoo's multi-process test and 3 tests in all
        "tests/test_train_zoo.py::trains",
        "tests/test_zoo.py::plans",
        "tests/test_zoo.py::plans_again",
        "tests/loops/test_elastic.py::lost",
        "tests/test_a.py::one",
        "tests/test_a.py::two",
        "tests/test_a.py::three",
        "tests/test_b.py::one",
    ]


def test_the_scheduler_sends_the_units_in_collection_order_the_zoo_files_together(pytester):
    """pytest-xdist would send test_a's unit first (the most tests); test_zoo and
    test_train_zoo, two units for it, would go to two workers and trace the zoo twice."""
    config = pytester.parseconfig("--tx", "2*popen", "--dist", "loadfile")
    scheduler = make_scheduler(config, None)
    collection = [
        "tests/test_train_zoo.py::trains",
        "tests/test_zoo.py::plans",
        "tests/loops/test_elastic.py::lost",
        "tests/test_a.py::one",
        "tests/test_a.py::two",
        "tests/test_a.py::three",
    ]
    workers = [Worker("gw0"), Worker("gw1")]
    for worker in workers:
        scheduler.add_node(worker)
        scheduler.add_node_collection(worker, collection)
    scheduler.schedule()
    sent = [[collection[i] for i in worker.sent] for worker in workers]
    # each worker is sent its first unit, then a second while it holds 2 tests or fewer
    assert sent == [
        ["tests/test_train_zoo.py::trains", "tests/test_zoo.py::plans", "tests/test_a.py::one"]
        + ["tests/test_a.py::two", "tests/test_a.py::three"],
        ["tests/loops/test_elastic.py::lost"],
    ]
