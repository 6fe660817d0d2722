"""The server's generation worker on its own, with a scripted stand-in engine: FIFO order, one generation at a
time, failures reported per job without stopping the thread, cancellation of waiting and running jobs, a
bounded queue, and caches reset after every job."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from eaglespec.errors import EagleSpecError
from eaglespec.serve.metrics import ServerMetrics
from eaglespec.serve.schemas import APIError
from eaglespec.serve.worker import Cancelled, Done, GenerationParams, GenerationWorker
from eaglespec.spec.decode import Finished, GenerationStats, Step


class _Resettable:
    def __init__(self):
        self.resets = 0

    def reset(self) -> None:
        self.resets += 1


class ScriptedEngine:
    """Yields one Step per token of the prompt's first id (its "length"), sleeping `step_s` per step. A prompt
    starting with -1 raises RuntimeError mid-stream, -2 raises EagleSpecError before the first step."""

    method = "eagle2"

    def __init__(self, step_s: float = 0.0):
        self.step_s = step_s
        self.target, self.drafter = _Resettable(), _Resettable()
        self.started: list[int] = []
        self.active = 0
        self.max_active = 0
        self.lock = threading.Lock()

    def stream(self, prompt_ids, max_new_tokens, temperature, top_p, top_k, seed, stop):
        tag = prompt_ids[0]
        self.started.append(tag)
        return self._run(tag, max_new_tokens)

    def _run(self, tag: int, n: int):
        with self.lock:
            self.active += 1
            self.max_active = max(self.max_active, self.active)
        try:
            if tag == -2:
                raise EagleSpecError("bad request found late")
            yield Step([1], "a", 0, 1, 0.0, 0.0)  # the prefill's token
            for i in range(1, n):
                if tag == -1 and i == 2:
                    raise RuntimeError("boom")
                time.sleep(self.step_s)
                yield Step([1], "a", 0, 3, 0.0, 0.0)  # two drafted tokens, none accepted: the bonus only
            stats = GenerationStats(prompt_tokens=1, new_tokens=n, target_forwards=n - 1,
                                    accept_lengths=[1] * (n - 1), drafted_per_depth=[n - 1],
                                    accepted_per_depth=[0], total_time=0.01, finish_reason="length")
            yield Finished([1] * n, "a" * n, stats)
        finally:
            with self.lock:
                self.active -= 1


def _collect(jobs, timeout: float = 20.0):
    async def one(job):
        events = []
        while True:
            event = await asyncio.wait_for(job.next_event(), timeout)
            events.append(event)
            if not isinstance(event, Step):
                return events
    return [one(j) for j in jobs]


def run_jobs(worker: GenerationWorker, tags_and_lengths, cancel: set[int] = frozenset()):
    async def main():
        loop = asyncio.get_running_loop()
        jobs = [worker.submit(GenerationParams([tag], n), loop) for tag, n in tags_and_lengths]
        for i in cancel:
            jobs[i].cancel()
        return await asyncio.gather(*_collect(jobs))
    return asyncio.run(main())


def wait_idle(worker: GenerationWorker) -> None:
    """The last event of a job is sent just before the worker resets the caches: wait for that too."""
    deadline = time.monotonic() + 10
    while (worker.running or worker.waiting) and time.monotonic() < deadline:
        time.sleep(0.005)
    assert worker.running == 0 and worker.waiting == 0


@pytest.fixture()
def worker_and_engine():
    engine = ScriptedEngine(step_s=0.005)
    worker = GenerationWorker(engine, ServerMetrics("m"), max_queue=16, timeout=30)
    worker.start()
    yield worker, engine
    worker.stop()


def test_jobs_run_one_at_a_time_in_arrival_order(worker_and_engine):
    worker, engine = worker_and_engine
    results = run_jobs(worker, [(t, 5) for t in range(10)])
    assert engine.started == list(range(10))
    assert engine.max_active == 1
    for events in results:
        assert isinstance(events[-1], Done) and len(events) == 6  # 5 steps + Done
    wait_idle(worker)
    assert engine.target.resets == engine.drafter.resets == 10  # caches freed after every job


def test_failures_are_reported_per_job_and_the_worker_goes_on(worker_and_engine):
    worker, engine = worker_and_engine
    results = run_jobs(worker, [(0, 3), (-1, 6), (1, 3), (-2, 3), (2, 3)])
    assert [type(r[-1]) for r in results] == [Done, APIError, Done, APIError, Done]
    assert results[1][-1].status == 500 and "boom" in results[1][-1].message
    assert results[3][-1].status == 400 and "late" in results[3][-1].message
    wait_idle(worker)
    assert worker.alive and engine.target.resets == 5


def test_cancelled_jobs_are_skipped_or_stopped(worker_and_engine):
    worker, engine = worker_and_engine
    results = run_jobs(worker, [(0, 3), (1, 3), (2, 3)], cancel={1})
    assert isinstance(results[1][-1], Cancelled) and 1 not in engine.started  # skipped without any work
    assert isinstance(results[0][-1], Done) and isinstance(results[2][-1], Done)

    async def cancel_midway():
        job = worker.submit(GenerationParams([7], 1000), asyncio.get_running_loop())
        events = []
        while True:
            event = await asyncio.wait_for(job.next_event(), 20)
            events.append(event)
            if len(events) == 3:
                job.cancel()
            if not isinstance(event, Step):
                return events
    events = asyncio.run(cancel_midway())
    assert isinstance(events[-1], Cancelled) and len(events) < 10
    wait_idle(worker)
    assert engine.active == 0  # the engine's generator was closed


def test_full_queue_raises_503_and_timeout_ends_a_job():
    engine = ScriptedEngine(step_s=0.05)
    worker = GenerationWorker(engine, ServerMetrics("m"), max_queue=1, timeout=0.5)
    worker.start()
    try:
        async def main():
            loop = asyncio.get_running_loop()
            running = worker.submit(GenerationParams([0], 1000), loop)
            await asyncio.wait_for(running.next_event(), 10)  # it has started
            waiting = worker.submit(GenerationParams([1], 1000), loop)
            with pytest.raises(APIError) as exc:
                worker.submit(GenerationParams([2], 2), loop)
            assert exc.value.status == 503 and exc.value.headers["Retry-After"] == "1"
            return await asyncio.gather(*_collect([running, waiting]))
        running, waiting = asyncio.run(main())
        assert isinstance(running[-1], APIError) and running[-1].status == 504
        assert len(running) < 20  # stopped near the 0.5 s deadline, not after 1000 steps
        # The waiting job's deadline counts from its arrival: it ends within its 0.5 s, queue wait included.
        assert isinstance(waiting[-1], APIError) and waiting[-1].status == 504 and len(waiting) < 20
    finally:
        worker.stop()
    assert not worker.alive
