"""The one thread that makes a server's torch calls: the engine's construction, the worker's set-up and its loop.

Why one. torch's CPU operators run their parallel parts on OpenMP (libgomp), which gives every thread that starts
parallel work its own team of worker threads, kept until that thread exits. Once two teams exist (say, the engine
built on the main thread and decoding on a worker thread) there are more OpenMP threads than a small machine has
cores, and libgomp then lets idle team threads sleep almost at once instead of spinning; a decode step is a few
hundred short parallel regions, each of which then waits for its threads to wake. On a 2-vCPU AMD EPYC (Zen 3) a
SmolLM2-135M decode step took 44 ms that way against 19 ms with one team, and the server generated at half the
speed of `eaglespec generate`. So a server builds its engine on the thread that will decode with it.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any


class GenerationThread:
    """A daemon thread running the callables given to it, one after another, each with a Future for its result."""

    def __init__(self, name: str = "eaglespec-generation"):
        self._tasks: queue.Queue[tuple[Callable[[], Any], Future]] = queue.Queue()
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            task, future = self._tasks.get()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(task())
            except BaseException as exc:  # noqa: BLE001 - handed to whoever waits on the future
                future.set_exception(exc)

    def submit(self, fn: Callable[..., Any], *args, **kwargs) -> Future:
        """Run `fn(*args, **kwargs)` on the thread after what was submitted before; its Future."""
        future: Future = Future()
        self._tasks.put((lambda: fn(*args, **kwargs), future))
        return future

    def call(self, fn: Callable[..., Any], *args, **kwargs) -> Any:
        """`submit` and wait: the result, or the exception re-raised here."""
        return self.submit(fn, *args, **kwargs).result()

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive()
