"""A lane worker with a process of its own freezes its start-up heap and collects young
objects less often; a process that runs other work (this test process, a Celery worker) keeps
Python's collector as it is."""

import gc
import multiprocessing
import os
import weakref

from email_platform.ops.lane_worker import GC_THRESHOLD, settle_heap


class _Node:
    def __init__(self) -> None:
        self.me = self


def _settle_in_child(env: dict[str, str], answers: "multiprocessing.Queue") -> None:
    os.environ.update(env)
    gc.disable()  # so only settle_heap can collect the cycle below
    cycle = _Node()  # garbage from before the worker: collected, not frozen
    left = weakref.ref(cycle)
    del cycle
    settled = settle_heap()
    answers.put(
        (settled, gc.get_threshold(), gc.get_freeze_count(), left() is None, gc.get_count()[0])
    )


def _run_child(env: dict[str, str]) -> tuple[bool, tuple[int, int, int], int, bool, int]:
    context = multiprocessing.get_context("spawn")  # a fresh process, as Dagster starts steps
    answers = context.Queue()
    child = context.Process(target=_settle_in_child, args=(env, answers))
    child.start()
    try:
        return answers.get(timeout=60)
    finally:
        child.join(timeout=60)


def test_a_worker_process_of_its_own_freezes_its_heap_and_collects_less_often():
    settled, threshold, frozen, collected, young = _run_child(
        {"EMAIL_PLATFORM_EXECUTOR": "default"}
    )
    assert settled is True
    assert threshold == GC_THRESHOLD
    # Everything start-up made is out of the collector's reach; garbage was collected first.
    assert frozen > 10_000
    assert collected is True
    assert young < 100


def test_a_celery_worker_process_keeps_the_collector_as_it_is():
    settled, threshold, frozen, collected, _ = _run_child({"EMAIL_PLATFORM_EXECUTOR": "celery"})
    assert settled is False
    assert threshold == (700, 10, 10)
    assert frozen == 0
    assert collected is False  # nothing collected: the collector was left as it was


def test_the_process_that_runs_many_things_is_left_alone():
    before = (gc.get_threshold(), gc.get_freeze_count())
    assert settle_heap() is False  # pytest's own process: no multiprocessing parent
    assert (gc.get_threshold(), gc.get_freeze_count()) == before
