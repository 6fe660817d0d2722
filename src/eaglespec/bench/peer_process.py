"""The process of an out-of-process bench peer (eaglespec.bench.peers): `peer_worker.py` under the peer's own python,
spoken to in JSON lines, and the resident-set measurements of its process tree (Linux /proc)."""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from pathlib import Path

from tqdm.auto import tqdm

from ..errors import EagleSpecError

WORKER = Path(__file__).resolve().parent / "peer_worker.py"
LOAD_TIMEOUT_S = 1800.0
CAN_PAUSE = hasattr(signal, "SIGSTOP") and sys.platform.startswith("linux")  # process_tree needs Linux /proc


def _children(pid: int) -> list[int]:
    out: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tasks:
        try:
            out += [int(c) for c in Path(f"/proc/{pid}/task/{tid}/children").read_text().split()]
        except (OSError, ValueError):
            continue
    return out


def process_tree(pid: int) -> list[int]:
    """`pid` and all its descendants (Linux /proc; just `pid` elsewhere)."""
    seen, todo = [], [pid]
    while todo:
        p = todo.pop()
        if p not in seen:
            seen.append(p)
            todo += _children(p)
    return seen


def _state(pid: int) -> str | None:
    """A process's one-letter state from /proc ("T": stopped), None where it is gone or /proc is missing."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def reset_peak_rss(pid: int) -> bool:
    """Reset the resident-set high-water mark of `pid`'s processes; False where that is not possible."""
    ok = True
    for p in process_tree(pid):
        try:
            with open(f"/proc/{p}/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            ok = False
    return ok


def peak_rss_mb(pid: int) -> float | None:
    """Sum of the resident-set high-water marks (VmHWM) of `pid`'s processes, in MiB; None where unreadable."""
    total, found = 0, False
    for p in process_tree(pid):
        try:
            match = re.search(r"^VmHWM:\s*(\d+) kB", Path(f"/proc/{p}/status").read_text(), re.MULTILINE)
        except OSError:
            continue
        if match:
            total += int(match.group(1))
            found = True
    return round(total / 1024, 1) if found else None


def log_tail(path: Path, lines: int = 12) -> str:
    try:
        text = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return ""
    return "\n".join(text[-lines:])


def _stop(proc: subprocess.Popen, log: Path | None = None, keep: dict | None = None) -> None:
    """End the worker (EOF on its stdin, then terminate, then kill); remove its log after a clean exit unless it
    was named in an error."""
    if proc.poll() is None:
        _end(proc)
    if log is not None and proc.returncode == 0 and not (keep or {}).get("log"):
        log.unlink(missing_ok=True)


def _signal_tree(pid: int, sig: int) -> None:
    for p in process_tree(pid):
        try:
            os.kill(p, sig)
        except OSError:  # gone meanwhile
            continue


def _end(proc: subprocess.Popen) -> None:
    if CAN_PAUSE:
        _signal_tree(proc.pid, signal.SIGCONT)  # a paused worker reads its EOF only once running again
    try:
        proc.stdin.close()
    except OSError:
        pass
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()


def _pump(stream, lines: queue.Queue) -> None:
    """Move the worker's output lines into `lines`; None at its end."""
    for line in stream:
        lines.put(line)
    lines.put(None)


class PeerProcess:
    """`peer_worker.py` under a peer's python: started and loaded in the constructor, then one JSON line per
    request. Its stderr goes to a log file, named in every error."""

    def __init__(self, python: str, options: dict, label: str, progress: bool = True,
                 load_timeout: float = LOAD_TIMEOUT_S, env: dict[str, str] | None = None):
        self.label = label
        handle, log = tempfile.mkstemp(prefix=f"eaglespec-{label}-", suffix=".log")
        self.log = Path(log)
        self.command = [python, "-u", str(WORKER), json.dumps(options)]
        with os.fdopen(handle, "w") as stderr:
            try:
                self.proc = subprocess.Popen(self.command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                             stderr=stderr, text=True, bufsize=1,
                                             env={**os.environ, **(env or {})})
            except OSError as exc:
                raise EagleSpecError(f"{label}: could not start '{python}': {exc}") from exc
        self._keep = {"log": False}  # set once an error names the log
        self._finalizer = weakref.finalize(self, _stop, self.proc, self.log, self._keep)
        self._lines: queue.Queue = queue.Queue()
        # the reader holds the pipe and the queue, not this object: dropping the method stops its worker
        threading.Thread(target=_pump, args=(self.proc.stdout, self._lines), daemon=True).start()
        print(f"bench: loading {label} in its own process ({python})", file=sys.stderr)
        ready = self._read(load_timeout, f"loading {label}", progress)
        if ready.get("event") != "ready":
            self._keep["log"] = True
            self.close()
            raise EagleSpecError(f"{label} could not load: {ready.get('error', ready)} (log: {self.log})")
        self.ready = ready
        print(f"bench: {label} loaded in {float(ready.get('load_time', 0.0)):.0f} s", file=sys.stderr)
        self.pause()

    def pause(self) -> None:
        """Stop the worker's processes (SIGSTOP) until its next request. An idle engine is not always idle on the
        CPU (vLLM's CPU workers keep threads spinning), and every peer stays loaded for the whole run: running,
        they would take cores from whatever is timed meanwhile (docs/benchmarks.md)."""
        if CAN_PAUSE and self.proc.poll() is None:
            _signal_tree(self.pid, signal.SIGSTOP)
            deadline = time.monotonic() + 2.0  # a signal lands asynchronously: be stopped before anything is timed
            while not self.paused() and self.proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.001)

    def resume(self) -> None:
        if CAN_PAUSE and self.proc.poll() is None:
            _signal_tree(self.pid, signal.SIGCONT)

    def paused(self) -> bool:
        """Whether the worker's processes (its main one and any it started) are all stopped (Linux; False
        elsewhere)."""
        states = [_state(p) for p in process_tree(self.pid)]
        return states[0] == "T" and all(state in ("T", None) for state in states)  # (None: exited meanwhile)

    def _read(self, timeout: float | None, what: str, progress: bool = False) -> dict:
        """The next JSON line from the worker; an error if it exits, prints something else or takes too long."""
        try:
            return self._next(timeout, what, progress)
        except EagleSpecError:
            self._keep["log"] = True
            raise

    def _next(self, timeout: float | None, what: str, progress: bool) -> dict:
        start = time.monotonic()
        bar = tqdm(desc=what, unit="s", disable=not progress, dynamic_ncols=True, leave=False,
                   bar_format="{desc}: {elapsed}")
        try:
            while True:
                try:
                    line = self._lines.get(timeout=1.0)
                except queue.Empty:
                    bar.update()
                    if timeout is not None and time.monotonic() - start > timeout:
                        self.close()
                        raise EagleSpecError(f"{self.label}: no answer after {timeout:.0f} s while {what} "
                                             f"(log: {self.log})") from None
                    continue
                if line is None:
                    code = self.proc.wait()
                    tail = log_tail(self.log)
                    raise EagleSpecError(f"{self.label} exited (code {code}) while {what}; log {self.log}"
                                         + (f", last lines:\n{tail}" if tail else ""))
                try:
                    return json.loads(line)
                except json.JSONDecodeError:
                    raise EagleSpecError(f"{self.label}: not a protocol line: {line.strip()[:200]!r} "
                                         f"(log: {self.log})") from None
        finally:
            bar.close()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def request(self, message: dict, timeout: float | None = None) -> dict:
        if self.proc.poll() is not None:
            self._keep["log"] = True
            raise EagleSpecError(f"{self.label} is no longer running (exit code {self.proc.returncode}; "
                                 f"log: {self.log})")
        self.resume()
        try:
            self.proc.stdin.write(json.dumps(message) + "\n")
            self.proc.stdin.flush()
        except OSError as exc:
            raise EagleSpecError(f"{self.label}: could not send a request ({exc}; log: {self.log})") from exc
        try:
            reply = self._read(timeout, "generating")
        finally:
            self.pause()
        if "error" in reply:
            self._keep["log"] = True
            raise EagleSpecError(f"{self.label} failed: {reply['error']} (log: {self.log})")
        return reply

    def close(self) -> None:
        self._finalizer()
