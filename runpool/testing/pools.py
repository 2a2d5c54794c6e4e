"""Real pools for tests and benchmarks: `python -m runpool` started as a child process.

One implementation serves runpool's own tests, its benchmarks and demo, and users' tests:
the pool is the real supervisor with real forked workers, so what a test kills is killed.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Final, Literal, TypeVar

from ..relay import PROCESS_NAME as LISTENER_NAME

__all__ = [
    "LOAD_STRETCH_MAX",
    "PoolProcess",
    "Stretched",
    "listener_pid",
    "load_stretch",
    "pool_env",
    "running_pool",
    "wait_for",
    "worker_pids",
]

T = TypeVar("T")


# A wait's timeout is in seconds of a machine with a CPU to spare. While the machine is busier
# (its load average above its CPU count: other tests, other users), a second counts for less,
# so a loaded machine makes a test slower instead of failing it; at most this many times less,
# so every wait stays bounded.
LOAD_STRETCH_MAX: Final = 10.0


def load_stretch() -> float:
    """How many seconds now are worth one second of a machine with a CPU to spare: the load
    average over the CPU count, from 1 to LOAD_STRETCH_MAX."""
    try:
        load = os.getloadavg()[0]
    except OSError:  # no load average on this platform
        return 1.0
    return min(max(load / (os.cpu_count() or 1), 1.0), LOAD_STRETCH_MAX)


class Stretched:
    """A timeout in seconds of a machine with a CPU to spare (see load_stretch): a wait polls
    expired() between its looks at the condition."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self.started = self._last = time.monotonic()
        self._waited = 0.0

    def expired(self) -> bool:
        now = time.monotonic()
        self._waited += (now - self._last) / load_stretch()
        self._last = now
        return self._waited > self.timeout

    def __str__(self) -> str:
        return (f"{self.timeout:g}s ({time.monotonic() - self.started:.0f}s by the clock,"
                f" stretched for load)")


def wait_for(predicate: Callable[[], T], timeout: float = 15.0, interval: float = 0.05,
             what: str = "condition") -> T:
    """Poll `predicate` until it returns something truthy (and return that), or raise
    AssertionError after `timeout` seconds: the bounded wait tests use instead of sleeps.
    On a loaded machine the seconds stretch (load_stretch), LOAD_STRETCH_MAX times at most."""
    deadline = Stretched(timeout)
    while True:
        value = predicate()
        if value:
            return value
        if deadline.expired():
            raise AssertionError(f"timed out after {deadline} waiting for {what}")
        time.sleep(interval)


def _children(supervisor_pid: int) -> list[int]:
    children = Path(f"/proc/{supervisor_pid}/task/{supervisor_pid}/children")
    return [int(p) for p in children.read_text().split()] if children.exists() else []


def _is_listener(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip() == LISTENER_NAME
    except OSError:  # gone already
        return False


def worker_pids(supervisor_pid: int) -> list[int]:
    """The supervisor's live worker processes (Linux /proc): its children but the listener."""
    return [p for p in _children(supervisor_pid) if not _is_listener(p)]


def listener_pid(supervisor_pid: int) -> int | None:
    """The supervisor's listener process (the host's one LISTEN connection), if running."""
    return next((p for p in _children(supervisor_pid) if _is_listener(p)), None)


def pool_env(dsn: str, *, inherit_otel: bool = True, pythonpath: str | None = None,
             **settings: Any) -> dict[str, str]:
    """The environment of a pool process: this one's, minus any RUNPOOL_ setting (and the
    OTEL_ ones unless `inherit_otel`), plus `RUNPOOL_<NAME>` for each keyword setting."""
    drop = ("RUNPOOL_",) if inherit_otel else ("RUNPOOL_", "OTEL_")
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    env.pop("DATABASE_URL", None)
    env["RUNPOOL_DSN"] = dsn
    if pythonpath:
        env["PYTHONPATH"] = pythonpath + os.pathsep + env.get("PYTHONPATH", "")
    env.update({f"RUNPOOL_{k.upper()}": str(v) for k, v in settings.items() if v is not None})
    return env


class PoolProcess(subprocess.Popen[bytes]):
    """The supervisor's process; `log()` is what the pool printed when output is captured."""

    log_path: Path | None = None

    def log(self) -> str:
        """Everything the supervisor and its workers logged so far ('' unless captured)."""
        return self.log_path.read_text(errors="replace") if self.log_path else ""

    def workers(self) -> list[int]:
        return worker_pids(self.pid)

    def listener(self) -> int | None:
        return listener_pid(self.pid)


@contextmanager
def running_pool(dsn: str, app: str, *, env: Mapping[str, str] | None = None,
                 cwd: str | Path | None = None, stop: Literal["kill", "drain"] = "kill",
                 output: Literal["capture", "inherit", "discard"] = "capture",
                 inherit_otel: bool = True, pythonpath: str | None = None,
                 **settings: Any) -> Iterator[PoolProcess]:
    """A real `python -m runpool` supervisor with its workers, serving `app` ("module:attr").

    Keyword settings become RUNPOOL_ variables (`concurrency=4`); `env` is laid over what
    `pool_env` makes of this process's environment. On exit the pool is
    SIGKILLed with its workers (`stop="kill"`: a test must not wait for a drain it did not
    ask for) or drained with SIGTERM (`stop="drain"`, killed if it hangs a minute). With
    `output="capture"` its log is kept for `log()` and printed if the block raised.
    """
    log = (tempfile.NamedTemporaryFile(prefix="runpool-pool-", suffix=".log", delete=False)
           if output == "capture" else None)
    sink: Any = log if log is not None else (None if output == "inherit" else subprocess.DEVNULL)
    full_env = {**pool_env(dsn, inherit_otel=inherit_otel, pythonpath=pythonpath, **settings),
                **(env or {})}
    full_env["RUNPOOL_APP"] = app
    proc = PoolProcess([sys.executable, "-m", "runpool", "worker"], env=full_env, cwd=cwd,
                       start_new_session=True, stdout=sink,
                       stderr=subprocess.STDOUT if log is not None else sink)
    proc.log_path = Path(log.name) if log is not None else None
    try:
        yield proc
    except BaseException:
        # What the pool said is usually the explanation of a failure.
        sys.stderr.write(proc.log()[-5000:])
        raise
    finally:
        _stop(proc, stop)
        if log is not None:
            log.close()
            Path(log.name).unlink(missing_ok=True)


def _stop(proc: PoolProcess, how: str) -> None:
    if proc.poll() is None and how == "drain":
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            pass
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)
    # The workers share the session: make sure none outlives the pool.
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
