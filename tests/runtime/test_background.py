"""runtime/background.py: jobs off the main loop, in order; results handed over in order; waits declared; a
failing job's error raised at the next look."""
import threading

import pytest

from runtime.background import InOrder


def test_jobs_run_in_order_and_take_never_blocks():
    gate, seen = threading.Event(), []

    def job(i):
        if i == 0:
            assert gate.wait(30)
        seen.append(i)
        return i * 10

    jobs = InOrder("test")
    for i in range(3):
        jobs.submit(i, job, i)
    assert jobs.take() == [] and jobs.pending == [0, 1, 2]   # job 0 holds the thread: nothing done, no wait
    gate.set()
    assert jobs.wait_all("the test's jobs", on=[]) == [(0, 0), (1, 10), (2, 20)]
    assert seen == [0, 1, 2] and jobs.pending == []
    jobs.close("the test's jobs", on=[])
    assert jobs.thread is None


def test_a_failing_job_is_raised_at_the_next_look_with_its_traceback():
    def bad():
        raise ValueError("bucket 3 arrived corrupted")

    jobs = InOrder("relay-receiver")
    jobs.submit("v1", bad)
    with pytest.raises(RuntimeError, match="relay-receiver failed:(.|\n)*bucket 3 arrived corrupted"):
        jobs.wait_all("v1", on=[])
    with pytest.raises(RuntimeError, match="relay-receiver failed"):
        jobs.submit("v2", lambda: None)
