"""The batched generation worker: one thread that owns a `BatchDecoder` (eaglespec.spec.batch) and runs every
admitted request concurrently, up to `max_batch` at a time, one batched step after another.

It keeps the sequential worker's contract (worker.py): a bounded FIFO queue in front (a request waits there until a
slot of the batch is free), events per job (`Step`s, then `Done`, `Cancelled` or an `APIError`), and between two
steps it stops the jobs that were cancelled (client gone), ran past their deadline, or must end because the server
is stopping; their cache slots are free for the next request at once. A failure inside a step fails the requests
in it (500) and frees their slots; the thread and the other requests go on.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time

from ..errors import EagleSpecError
from ..spec.batch import PREFILL_CHUNK
from ..spec.decode import Finished
from ..spec.prefix import DEFAULT_BYTES as PREFIX_CACHE_BYTES
from ..spec.verify import SamplingParams
from .metrics import ServerMetrics
from .schemas import APIError
from .thread import GenerationThread
from .worker import Progress, Worker, must_stop

log = logging.getLogger("eaglespec.serve")


class BatchWorker(Worker):
    """The sequential worker's interface (worker.py) over a batch decoder of `max_batch` sequences (`speculate`: see
    `Engine.batch_decoder`)."""

    def __init__(self, engine, metrics: ServerMetrics, max_queue: int = 64, timeout: float = 300.0,
                 max_batch: int = 8, speculate: str = "auto", prefill_chunk: int = PREFILL_CHUNK,
                 prefix_cache_bytes: int = PREFIX_CACHE_BYTES,
                 thread: GenerationThread | None = None):
        super().__init__(engine, metrics, max_queue=max_queue, timeout=timeout, thread=thread)
        self.max_batch = max_batch
        self.batch = engine.batch_decoder(max_batch, speculate, prefill_chunk, prefix_cache_bytes)
        self.jobs: dict[int, Progress] = {}  # the batch's requests by key
        self._reset_prefixes = threading.Event()  # set by another thread; the loop clears the cache between steps
        self._ids = itertools.count()

    @property
    def running(self) -> int:
        return len(getattr(self, "jobs", ()))  # (gauges are set before the constructor ends)

    # ---- the thread --------------------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stopping.is_set():
            try:
                self._take_jobs()
                self._stop_finished_jobs()
                if self._reset_prefixes.is_set():  # (before the step that would look prompts up)
                    self._reset_prefixes.clear()
                    self.batch.prefixes.clear()
                if self.batch.busy:
                    self._step()
            except Exception:  # noqa: BLE001 - the thread must survive anything
                log.exception("unexpected failure in the batched generation worker")
                self._fail_all(APIError(500, "Generation failed: internal error", type="server_error",
                                        code="internal_error"))
        self._fail_all(APIError(503, "The server is shutting down.", type="server_error", code="unavailable"))

    def reset_prefix_cache(self) -> bool:
        if self.batch.prefixes is None:
            return False
        self._reset_prefixes.set()
        return True

    def _room(self) -> int:
        return len(self.batch.pool.free) - len(self.batch.waiting)

    def _take_jobs(self) -> None:
        """Move queued jobs into the batch while it has free slots; wait a little for one when idle."""
        while self._room() > 0:
            try:
                job = self._queue.get(timeout=0.1) if not self.batch.busy else self._queue.get_nowait()
            except queue.Empty:
                return
            now = time.monotonic()
            if must_stop(job, self.metrics, now):
                continue
            p = job.params
            key = next(self._ids)
            try:
                self.batch.add(key, p.prompt_ids, max_new_tokens=p.max_tokens, stop=p.stop,
                               sampling=SamplingParams(temperature=p.temperature, top_p=p.top_p, top_k=p.top_k,
                                                       seed=p.seed))
            except EagleSpecError as exc:
                job.emit(APIError(400, str(exc)))
                continue
            self.metrics.started(now - job.arrival, len(p.prompt_ids))
            self.jobs[key] = Progress(job, self.metrics)
            self._update_gauges()

    def _stop_finished_jobs(self) -> None:
        """Stop the jobs whose client left or whose deadline passed; their slots free at once."""
        now = time.monotonic()
        for key, run in list(self.jobs.items()):
            if not must_stop(run.job, self.metrics, now):
                continue
            self.batch.cancel(key)
            del self.jobs[key]
        self._update_gauges()

    def _step(self) -> None:
        try:
            events = self.batch.step()
        except Exception as exc:  # noqa: BLE001 - fail this step's requests, keep serving
            log.exception("a batched generation step failed")
            self._fail_all(APIError(500, f"Generation failed: {type(exc).__name__}: {exc}", type="server_error",
                                    code="internal_error"))
            return
        self.metrics.batch_step(self.batch.last_report)
        now = time.monotonic()
        for key, item in events:
            run = self.jobs.get(key)
            if run is None:
                continue
            if isinstance(item, Finished):
                run.finished(item, now)
                del self.jobs[key]
            else:
                run.step(item, now)
        self._update_gauges()

    def _fail_all(self, error: APIError) -> None:
        """End every admitted job with `error` and free its slot."""
        for key, run in list(self.jobs.items()):
            run.job.emit(error)
            self.batch.cancel(key)
        self.jobs.clear()
        self._update_gauges()
