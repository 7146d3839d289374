"""Chat templates render in worker processes with a deadline, a memory cap and an output cap.

A template comes with a checkpoint, from a stranger: jinja's sandbox stops it reaching Python
internals, but not from looping for hours (`range(100000)` twice) or building a 1 GB string
(`'x' * 10**9`). So a render runs in a separate, reused process (`python -m
blockspec.models.template_sandbox`): the caller waits at most `RENDER_TIMEOUT_S` and then kills
it; the process caps its own address space (`MEMORY_HEADROOM` above what it holds once
started) and refuses results over the output cap. Whatever goes wrong inside a render
(OverflowError, RecursionError, MemoryError, a crash) comes back as one BlockspecError naming
the template. Requests and replies are JSON lines over the process's stdin / stdout: nothing
is unpickled. At most `WORKERS.size` renders run at once; a caller waits for a free worker.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import subprocess
import sys
import threading
import time
from typing import Any

import jinja2

from blockspec.errors import BlockspecError

try:
    import resource
except ImportError:   # not a Unix: the deadline and the output cap still hold
    resource = None

RENDER_TIMEOUT_S = 2.0          # a render's deadline, from when a worker takes it
START_TIMEOUT_S = 60.0          # a fresh worker imports transformers (about a second, more on a busy host)
MEMORY_HEADROOM = 512 << 20     # address space a render may add to the worker's own
MAX_CHARS = 1 << 24             # default output cap (callers pass their own: the server its prompt limit)
READY = b"ready\n"


def _failed(reason: str, where: str) -> BlockspecError:
    return BlockspecError(f"chat template failed: {reason} (template: {where})")


class _Worker:
    """One render process; `ask` sends one request and waits for its reply."""

    def __init__(self) -> None:
        try:
            self.proc = subprocess.Popen([sys.executable, "-m", __name__, str(MEMORY_HEADROOM)],
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                         start_new_session=True)   # a terminal's Ctrl-C is for the parent only
        except OSError as exc:   # no processes left, ...
            raise BlockspecError(f"chat template: cannot start the render worker ({exc})") from None
        self.buffer = b""
        if self._line(START_TIMEOUT_S) != READY:
            self.kill()
            raise BlockspecError("chat template: the render worker did not start")

    def _line(self, timeout: float) -> bytes | None:
        """The next reply line; None on timeout or when the worker died."""
        deadline = time.monotonic() + timeout
        while b"\n" not in self.buffer:
            left = deadline - time.monotonic()
            try:   # the pipe may be closed under us (`TemplateWorkers.close` from another thread)
                fd = self.proc.stdout.fileno()
                if left <= 0 or not select.select([fd], [], [], left)[0]:
                    return None
                chunk = os.read(fd, 1 << 20)
            except (OSError, ValueError):
                return None
            if not chunk:
                return None
            self.buffer += chunk
        line, _, self.buffer = self.buffer.partition(b"\n")
        return line + b"\n"

    def ask(self, request: bytes, timeout: float) -> dict[str, Any] | None:
        try:
            self.proc.stdin.write(request + b"\n")
            self.proc.stdin.flush()
        except (OSError, ValueError):
            return None
        line = self._line(timeout)
        return json.loads(line) if line is not None else None

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()
        for pipe in (self.proc.stdin, self.proc.stdout):
            try:
                pipe.close()
            except OSError:
                pass


class TemplateWorkers:
    """A pool of at most `size` render processes, started on first use and replaced when one is
    killed (deadline) or dies (memory)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.slots = threading.BoundedSemaphore(size)
        self.lock = threading.Lock()
        self.idle: list[_Worker] = []
        self.busy: set[_Worker] = set()

    def render(self, request: dict[str, Any], where: str, timeout: float | None = None) -> dict[str, Any]:
        timeout = RENDER_TIMEOUT_S if timeout is None else timeout
        try:
            payload = json.dumps(request, ensure_ascii=False).encode("utf-8", "surrogatepass")
        except (TypeError, ValueError, RecursionError) as exc:
            raise _failed(f"the chat must be JSON data to render ({type(exc).__name__}: {exc})", where) from None
        with self.slots:
            worker = self._take()
            started = time.monotonic()
            try:
                reply = worker.ask(payload, timeout)
            finally:
                with self.lock:
                    self.busy.discard(worker)
            if reply is None:   # past the deadline, out of memory or killed at shutdown
                worker.kill()
                if time.monotonic() - started < timeout:
                    raise _failed(f"the render ran out of memory (over {MEMORY_HEADROOM >> 20} MiB) or was "
                                  "stopped", where)
                raise _failed(f"rendering took longer than {timeout:g} s", where)
            with self.lock:
                self.idle.append(worker)
        if "error" in reply:
            raise _failed(reply["error"], where)
        return reply

    def _take(self) -> _Worker:
        with self.lock:
            worker = self.idle.pop() if self.idle else None
        if worker is None or worker.proc.poll() is not None:
            worker = _Worker()
        with self.lock:
            self.busy.add(worker)
        return worker

    def close(self) -> None:
        """Kill every worker, busy ones included (their callers get an error at once); a later
        render starts a fresh one."""
        with self.lock:
            workers, self.idle = [*self.idle, *self.busy], []
        for worker in workers:
            worker.kill()


WORKERS = TemplateWorkers(max(2, (os.cpu_count() or 2) // 2))
atexit.register(WORKERS.close)


# -- the worker process -----------------------------------------------------------------------

def _cap_memory(headroom: int) -> None:
    try:
        with open("/proc/self/status") as f:
            size_kb = next(int(line.split()[1]) for line in f if line.startswith("VmSize:"))
    except (OSError, StopIteration, ValueError):
        return   # no /proc (not Linux): the deadline and the output cap still hold
    if resource is None:
        return
    resource.setrlimit(resource.RLIMIT_AS, (size_kb * 1024 + headroom, resource.getrlimit(resource.RLIMIT_AS)[1]))


def _render(request: dict[str, Any], render_jinja_template: Any) -> dict[str, Any]:
    rendered, spans = render_jinja_template(conversations=[request["messages"]], tools=request["tools"],
                                            documents=request["documents"], chat_template=request["template"],
                                            add_generation_prompt=request["add_generation_prompt"],
                                            return_assistant_tokens_mask=request["spans"], **request["kwargs"])
    text = rendered[0]
    if len(text) > request["max_chars"]:
        return {"error": f"the rendered prompt exceeds {request['max_chars']} characters"}
    return {"text": text, "spans": [[int(a), int(b)] for a, b in spans[0]] if spans else []}


def _describe(exc: BaseException) -> str:
    if isinstance(exc, jinja2.exceptions.SecurityError):
        return f"refused by the sandbox: {exc}"
    if isinstance(exc, jinja2.TemplateError):   # raise_exception(...) in the template, undefined values, ...
        return str(exc)
    return f"{type(exc).__name__}: {str(exc)[:300]}"


def _serve(headroom: int) -> None:
    from transformers.utils.chat_template_utils import render_jinja_template
    _cap_memory(headroom)
    sys.setrecursionlimit(2000)
    out = sys.stdout.buffer
    out.write(READY)
    out.flush()
    for line in sys.stdin.buffer:
        try:
            reply = _render(json.loads(line), render_jinja_template)
        except Exception as exc:   # MemoryError, RecursionError, OverflowError, ... : the template's fault
            reply = {"error": _describe(exc)}
        out.write(json.dumps(reply, ensure_ascii=True).encode() + b"\n")
        out.flush()


if __name__ == "__main__":
    _serve(int(sys.argv[1]))
