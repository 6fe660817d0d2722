"""The generation workers' common part (`Worker`: one thread that owns the engine, fed by a bounded FIFO queue) and
the sequential worker (`GenerationWorker`); the batched one is batch_worker.py.

The engine is not thread-safe, so every generation runs on the worker's thread. The HTTP side submits a `Job` and
reads its events (`Step`s, then `Done`, `Cancelled` or an `APIError`) from an asyncio queue that the worker fills
thread-safely. The sequential worker runs one sequence at a time, in arrival order; between two target forwards it
checks whether the job was cancelled (client gone), ran past its deadline, or the server is stopping; it then
closes the engine's stream and resets the target and draft caches, so an abandoned request frees its memory and
the next one starts at once. Nothing a request does can stop the thread: every failure becomes an event.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from abc import ABC, abstractmethod
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field

import torch

from ..errors import EagleSpecError
from ..spec.decode import Finished, Step
from .metrics import ServerMetrics
from .schemas import APIError
from .thread import GenerationThread

log = logging.getLogger("eaglespec.serve")


@dataclass(frozen=True)
class GenerationParams:
    prompt_ids: list[int]
    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)


@dataclass
class Done:
    """The generation finished (EOS, stop string or max_tokens)."""

    result: Finished
    draft_tokens: int  # drafted tokens the target verified for this request


@dataclass
class Cancelled:
    """The job was cancelled (its client went away) and its generation stopped."""


Event = Step | Done | Cancelled | APIError


class Job:
    """One request's place in the queue and its stream of events."""

    def __init__(self, params: GenerationParams, loop: asyncio.AbstractEventLoop, timeout: float):
        self.params = params
        self.arrival = time.monotonic()
        self.deadline = self.arrival + timeout
        self.timeout = timeout
        self._loop = loop
        self._events: asyncio.Queue[Event] = asyncio.Queue()
        self._cancelled = threading.Event()

    def cancel(self) -> None:
        """Ask the worker to stop this job (or to skip it if it has not started). Safe to call repeatedly."""
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    async def next_event(self) -> Event:
        return await self._events.get()

    def emit(self, event: Event) -> None:
        """Called on the worker thread."""
        try:
            self._loop.call_soon_threadsafe(self._events.put_nowait, event)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            self.cancel()


class Progress:
    """What the server reports of one job as its generation's events arrive: step metrics, the time to its first
    token, the drafted tokens the target verified (its `usage`), and the events themselves."""

    def __init__(self, job: Job, metrics: ServerMetrics):
        self.job, self.metrics = job, metrics
        self.first_token_at: float | None = None
        self.draft_tokens = 0
        self.prefilled = False

    def step(self, item: Step, now: float) -> None:
        self.metrics.step(item, not self.prefilled)
        if self.prefilled:
            self.draft_tokens += item.tree_size - 1
        self.prefilled = True
        if self.first_token_at is None and item.tokens:
            self.first_token_at = now - self.job.arrival
            self.metrics.first_token(self.first_token_at)
        self.job.emit(item)

    def finished(self, item: Finished, now: float) -> None:
        self.metrics.completed(item.stats, now - self.job.arrival, self.first_token_at)
        self.job.emit(Done(item, self.draft_tokens))


def must_stop(job: Job, metrics: ServerMetrics, now: float) -> bool:
    """Whether `job` must stop now (its client went away, or its deadline passed); if so it has its last event."""
    if job.cancelled:
        metrics.cancelled()
        job.emit(Cancelled())
    elif now > job.deadline:
        job.emit(_timeout_error(job))
    else:
        return False
    return True


class Worker(ABC):
    """A bounded FIFO queue of jobs and the thread that runs them (`_run`): `thread`, the one that built the engine
    (serve/thread.py says why), or a thread of its own."""

    def __init__(self, engine, metrics: ServerMetrics, max_queue: int = 64, timeout: float = 300.0,
                 thread: GenerationThread | None = None):
        if max_queue < 1:
            raise ValueError("max_queue must be at least 1")
        self.engine = engine
        self.metrics = metrics
        self.timeout = timeout
        self.max_queue = max_queue
        self._queue: queue.Queue[Job] = queue.Queue(maxsize=max_queue)
        self._stopping = threading.Event()
        self._running = 0
        self.thread = thread or GenerationThread()
        self._loop: Future | None = None  # the running `_run`

    def reset_prefix_cache(self) -> bool:
        """Forget the prompts read so far (the batch decoder's prefix cache) before the next step; False where there
        is no such cache."""
        return False

    @abstractmethod
    def _run(self) -> None:
        """The thread: take jobs, generate, until `_stopping` is set; never raise."""

    # ---- control -----------------------------------------------------------------------------------------
    def start(self) -> None:
        self._loop = self.thread.submit(self._run)

    def stop(self, wait: float = 10.0) -> None:
        """Stop taking jobs, fail the waiting ones, stop the running one at its next step, wait for the loop."""
        self._stopping.set()
        if self._loop is not None:
            try:
                self._loop.result(timeout=wait)
            except FutureTimeout:
                log.warning("the generation loop did not stop within %.0f s", wait)
        self._fail_waiting()

    @property
    def alive(self) -> bool:
        return (self._loop is not None and not self._loop.done() and self.thread.is_alive
                and not self._stopping.is_set())

    @property
    def waiting(self) -> int:
        return self._queue.qsize()

    @property
    def running(self) -> int:
        return self._running

    def submit(self, params: GenerationParams, loop: asyncio.AbstractEventLoop) -> Job:
        """Queue a job; raise APIError 503 when the queue is full or the server is stopping."""
        if not self.alive:
            raise APIError(503, "The server is shutting down.", type="server_error", code="unavailable")
        job = Job(params, loop, self.timeout)
        try:
            self._queue.put_nowait(job)
        except queue.Full:
            raise APIError(503, f"The server is busy: {self.max_queue} requests are already waiting. Retry later.",
                           type="server_error", code="queue_full", headers={"Retry-After": "1"}) from None
        self._update_gauges()
        return job

    def _fail_waiting(self) -> None:
        while True:
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                break
            job.emit(APIError(503, "The server is shutting down.", type="server_error", code="unavailable"))
        self._update_gauges()

    def _update_gauges(self) -> None:
        self.metrics.queue_sizes(self._queue.qsize(), self.running)


class GenerationWorker(Worker):
    """Runs queued jobs one at a time on a dedicated thread."""

    def _run(self) -> None:
        while not self._stopping.is_set():
            try:
                job = self._queue.get(timeout=0.1)
            except queue.Empty:
                continue
            self._update_gauges()
            try:
                self._process(job)
            except Exception:  # noqa: BLE001 - the thread must survive anything; _process already reported it
                log.exception("unexpected failure in the generation worker")

    def _process(self, job: Job) -> None:
        started = time.monotonic()
        if must_stop(job, self.metrics, started):
            return
        p = job.params
        self.metrics.started(started - job.arrival, len(p.prompt_ids))
        self._running = 1
        self._update_gauges()
        stream = None
        try:
            with torch.inference_mode():
                stream = self.engine.stream(p.prompt_ids, max_new_tokens=p.max_tokens, temperature=p.temperature,
                                            top_p=p.top_p, top_k=p.top_k, seed=p.seed, stop=p.stop)
                self._drive(job, stream)
        except EagleSpecError as exc:
            job.emit(APIError(400, str(exc)))
        except Exception as exc:  # noqa: BLE001 - report the failure to this client, keep serving the others
            log.exception("generation failed")
            job.emit(APIError(500, f"Generation failed: {type(exc).__name__}: {exc}", type="server_error",
                              code="internal_error"))
        finally:
            if stream is not None:
                stream.close()
            # Free the KV caches of the finished or abandoned sequence now, not when the next one starts.
            self.engine.target.reset()
            self.engine.drafter.reset()
            self._running = 0
            self._update_gauges()

    def _drive(self, job: Job, stream) -> None:
        progress = Progress(job, self.metrics)
        for item in stream:
            now = time.monotonic()
            if isinstance(item, Finished):
                progress.finished(item, now)
                return
            progress.step(item, now)
            if must_stop(job, self.metrics, now):
                return
            if self._stopping.is_set():
                job.emit(APIError(503, "The server is shutting down.", type="server_error", code="unavailable"))
                return
        raise RuntimeError("the engine's stream ended without a result")


def _timeout_error(job: Job) -> APIError:
    return APIError(504, f"The request took longer than the server's limit of {job.timeout:g} s.",
                    type="timeout_error", code="timeout")
