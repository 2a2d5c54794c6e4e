"""The supervisor: forks worker processes, restarts crashed ones with backoff, and drains.

Signals: the first SIGTERM/SIGINT drains (workers stop claiming, get --grace seconds, then
release their leases); a second one stops at once (relayed to workers as SIGUSR1). A worker
also takes SIGTERM directly: the first drains, the second stops it at once. Workers ignore
SIGINT, since a terminal's Ctrl-C reaches the whole process group and only the supervisor's
relay should count. The supervisor opens no database connection and starts no thread before
it forks.

One LISTEN connection serves the whole host: with LISTEN on and more than one worker, the
supervisor also forks a listener process (runpool.relay) that passes every notice on to the
workers over a socket pair each; it is restarted like a worker, and stopped last, so draining
workers still hear cancels. A single worker holds the host's LISTEN connection itself.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import FrameType
from typing import Any, Final

from . import otel_setup
from .app import App, load_app
from .errors import DatabaseUnreachable, SchemaOutOfDate, UsageError, WorkerFailed, type_name
from .exits import EXIT_CONFIG, EXIT_ORPHANED, EXIT_STUCK
from .logs import in_run
from .pool import Pool
from .relay import pair, run_relay_process
from .settings import Settings

__all__ = ["Supervisor", "load_app", "run_worker_process"]

logger = logging.getLogger("runpool.supervisor")

# An orphaned worker (its supervisor died) that has not finished stopping after this many
# seconds exits at once, with EXIT_ORPHANED.
ORPHAN_EXIT_SECONDS = 8.0


def _exit_orphan() -> None:
    logger.error("orphaned worker still stopping after %.0fs; exiting now (its runs are"
                 " reclaimed when their leases expire)", ORPHAN_EXIT_SECONDS,
                 extra={"action": "orphan_exit"})
    os._exit(EXIT_ORPHANED)


# The youngest generation's threshold of the cyclic garbage collector in a worker process
# (Python 3.11's default: 700). A loaded worker holds many long-lived objects (1,000 runs in
# flight: their tasks, slots and conversations), and a full collection walks all of them with
# the event loop stopped: at W11 2 x 1,000, six or seven a minute of 83-110 ms each (up to
# 213 ms), with every write in flight waiting behind them. Collecting young objects every
# 10,000 net allocations instead of 700 lets far fewer of them reach the old generation, so
# full collections come ~50 times less often (the first after ~1.2 M net allocations: ~7 min
# at W11's rate); young collections pause longer (gen0 ~7 ms, gen1 40-70 ms at W11). The cost
# is memory held by garbage in reference cycles until a young collection finds it: up to
# 10,000 objects' worth, and what they refer to (a caught exception kept in a local holds its
# traceback's frames and their locals). Bounded, not a leak.
GC_YOUNG_THRESHOLD: Final = 10_000


def _tune_gc() -> None:
    """A forked worker's collector: what the supervisor imported (modules, classes, the app) is
    frozen out of every collection (it lives as long as the process; and untouched pages stay
    shared with the supervisor), and young collections come less often. Only in processes
    runpool forks: an embedded pool leaves its host's collector alone."""
    gc.freeze()
    gc.set_threshold(GC_YOUNG_THRESHOLD, *gc.get_threshold()[1:])


class TaskExited(RuntimeError):
    """A task that a run's code created raised SystemExit or KeyboardInterrupt (its cause)."""


def _contained_task(loop: asyncio.AbstractEventLoop, coro: Any, **kwargs: Any
                    ) -> asyncio.Task[Any]:
    """The worker loop's task factory. asyncio lets SystemExit and KeyboardInterrupt raised in
    a task out of the loop itself (a handler's `asyncio.gather(...)` of a coroutine calling
    sys.exit() ended the worker and every other tenant's run in it, or wedged it draining):
    a task created in a run's context turns them into TaskExited, an exception of that run."""
    if in_run():
        coro = _contain(coro)
    return asyncio.Task(coro, loop=loop, **kwargs)


async def _contain(coro: Any) -> Any:
    try:
        return await coro
    except (SystemExit, KeyboardInterrupt) as exc:
        raise TaskExited(f"a task of the run's code raised {type_name(exc)}") from exc


def run_worker_process(settings: Settings, dsn: str, app: App, parent_fd: int | None,
                       notices_fd: int | None = None) -> int:
    """The body of one worker process; returns its exit code. `notices_fd`: its end of the
    host's notice relay (None: a LISTEN connection of its own, if listening)."""
    _tune_gc()
    runner = asyncio.Runner(loop_factory=_loop_factory(settings))
    try:
        runner.get_loop().set_task_factory(_contained_task)
        return runner.run(_worker_async(settings, dsn, app, parent_fd, notices_fd))
    except (SystemExit, KeyboardInterrupt) as exc:
        # Out of the loop all the same (a task created outside any run's context): the
        # loop's state is unknown, and closing it would wait for tasks that may never end (a
        # worker wedged, its leases held). The process ends at once; the supervisor starts
        # another, and the runs it held are reclaimed when their leases expire.
        logger.critical("%s escaped the worker's event loop; exiting", type_name(exc),
                        extra={"action": "worker_loop_escaped"})
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    except SchemaOutOfDate as exc:
        logger.error("%s", exc, extra={"action": "schema_out_of_date"})
        return EXIT_CONFIG
    except UsageError as exc:  # a database this configuration cannot run on (see Pool.start)
        logger.error("%s", exc, extra={"action": "unusable_configuration"})
        return EXIT_CONFIG
    finally:
        runner.close()


def _loop_factory(settings: Settings) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's loop when installed and not turned off (None: asyncio's default)."""
    if settings.uvloop is False:
        return None
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


async def _worker_async(settings: Settings, dsn: str, app: App, parent_fd: int | None,
                        notices_fd: int | None) -> int:
    """A worker process is a runpool.Pool behind this process's signals: the first SIGTERM
    drains, the second (or SIGUSR1, the supervisor's relay) releases in-flight runs at once.
    Returns the process's exit code."""
    loop = asyncio.get_running_loop()
    pool = Pool(app, dsn=dsn, settings=settings, notices_fd=notices_fd)
    terms = 0

    def on_term() -> None:
        nonlocal terms
        terms += 1
        pool.stop(now=terms > 1)

    loop.add_signal_handler(signal.SIGTERM, on_term)
    loop.add_signal_handler(signal.SIGUSR1, lambda: pool.stop(now=True))
    if parent_fd is not None:
        # The write end lives only in the supervisor: EOF here means it died.
        def on_parent_gone() -> None:
            loop.remove_reader(parent_fd)
            logger.warning("supervisor is gone; stopping", extra={"action": "orphaned"})
            pool.stop(now=True)
            # Nobody restarts or reaps an orphan, so it must end whatever its release waits
            # on (a silent database holds each statement to its deadline): a thread, not the
            # loop, keeps this promise. Runs not released are reclaimed at lease expiry.
            timer = threading.Timer(ORPHAN_EXIT_SECONDS, _exit_orphan)
            timer.daemon = True
            timer.start()

        loop.add_reader(parent_fd, on_parent_gone)
    # This process is the pool's own, so it may install global tracer and meter providers
    # (built from OTEL_*), which the pool then uses; it flushes them, bounded, on the way out.
    providers = otel_setup.from_env(pool.worker_id)
    try:
        try:
            await pool.start()
        except DatabaseUnreachable as exc:
            # The database is down or refused us (no such database or role, a password):
            # a traceback explains nothing here, and a worker cannot mend it. One line; the
            # supervisor starts the worker again with its backoff, so the host recovers by
            # itself once the database answers.
            logger.error("cannot start: %s", exc, extra={
                "action": "database_unreachable", "worker_id": str(pool.worker_id)})
            return 1
        await pool.wait()
    except WorkerFailed:
        if pool.exit_code:
            return pool.exit_code  # a stuck handler thread: only this exit ends it
        raise
    finally:
        await asyncio.to_thread(providers.shutdown)
    return 0


@dataclass(slots=True)
class _Child:
    index: int
    pid: int
    started: float
    crashes: int = 0


# The listener process's index among the supervisor's children (workers count from 0).
LISTENER = -1


class Supervisor:
    def __init__(self, settings: Settings, dsn: str, app: App) -> None:
        self.settings = settings
        self.dsn = dsn
        self.app = app
        self._signals = 0
        self._children: dict[int, _Child] = {}
        self._restart_at: dict[int, tuple[float, int]] = {}
        self._read_fd, self._write_fd = os.pipe()
        # Per worker index: (the listener's end, the worker's end). Both stay open here for
        # the supervisor's life, so a restarted worker or listener finds its peer's end. A
        # lone worker listens itself: the host's one LISTEN connection either way, and each
        # wake-up saves a process hop (the relay's context switch: W2's latency).
        self._pairs = ([pair() for _ in range(settings.workers)]
                       if settings.listen and settings.workers > 1 else [])

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self._signals += 1

    def _child_body(self, index: int) -> int:
        """What the forked child `index` runs: the listener, or a worker."""
        if index == LISTENER:
            for _, worker_end in self._pairs:
                worker_end.close()
            return run_relay_process(self.settings.listen_dsn or self.dsn,
                                     [ends[0] for ends in self._pairs], self._read_fd,
                                     check_dsn=self.dsn, stateless=self.settings.stateless,
                                     loop_factory=_loop_factory(self.settings))
        for i, (listener_end, worker_end) in enumerate(self._pairs):
            listener_end.close()
            if i != index:
                worker_end.close()
        notices = self._pairs[index][1].fileno() if self._pairs else None
        return run_worker_process(self.settings, self.dsn, self.app, self._read_fd, notices)

    def _spawn(self, index: int, crashes: int = 0) -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                os.close(self._write_fd)
                signal.signal(signal.SIGINT, signal.SIG_IGN)
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
                code = self._child_body(index)
            except BaseException:
                logger.exception("worker crashed", extra={"action": "worker_crashed"})
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        self._children[pid] = _Child(index, pid, time.monotonic(), crashes)
        if index == LISTENER:
            logger.info("started the host's listener (pid %d)", pid,
                        extra={"action": "listener_spawned"})
        else:
            logger.info("started worker %d (pid %d)", index, pid,
                        extra={"action": "worker_spawned"})

    def run(self) -> int:
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        # Garbage of the start (the command line's parsers: ~600 objects in cycles) is
        # collected once here, not frozen into every worker (_tune_gc) for its lifetime.
        gc.collect()
        if self._pairs:
            self._spawn(LISTENER)
        for index in range(self.settings.workers):
            self._spawn(index)
        seen = 0
        stop_deadline: float | None = None
        exit_code = 0
        while self._children or (self._restart_at and not self._signals):
            if self._signals != seen:
                if seen == 0:
                    self._relay(signal.SIGTERM)
                    stop_deadline = time.monotonic() + self.settings.grace_seconds + 15
                    logger.info("draining", extra={"action": "drain"})
                if self._signals >= 2:
                    # Its own signal, not a second SIGTERM: two signals of one kind sent close
                    # together can merge into one delivery.
                    self._relay(signal.SIGUSR1)
                    assert stop_deadline is not None
                    stop_deadline = min(stop_deadline, time.monotonic() + 5)
                    logger.info("stopping now", extra={"action": "stop_now"})
                seen = self._signals
            if stop_deadline is not None and time.monotonic() > stop_deadline:
                self._relay(signal.SIGKILL, listener=True)
            if self._signals and all(c.index == LISTENER for c in self._children.values()):
                # The workers are gone: nobody needs the notices any more.
                self._relay(signal.SIGTERM, listener=True)
            code = self._reap_children(restart=stop_deadline is None)
            if code is not None:
                exit_code = code
                if code == EXIT_CONFIG and stop_deadline is None:
                    self._signals += 1
            self._restart_due()
            time.sleep(0.05)
        os.close(self._write_fd)
        return exit_code

    def _relay(self, signum: int, *, listener: bool = False) -> None:
        """Send `signum` to the workers (and the listener process too, if `listener`)."""
        for pid, child in list(self._children.items()):
            if child.index == LISTENER and not listener:
                continue
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                pass

    def _reap_children(self, *, restart: bool) -> int | None:
        worst: int | None = None
        while self._children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                self._children.clear()
                break
            if pid == 0:
                break
            child = self._children.pop(pid, None)
            if child is None:
                continue
            code = os.waitstatus_to_exitcode(status)
            if code == EXIT_STUCK:
                logger.warning("worker %d (pid %d) exited to end a handler thread that outlived"
                               " its grace", child.index, pid, extra={"action": "worker_stuck"})
            if code == EXIT_CONFIG:
                logger.error("worker %d cannot run here (exit %d); stopping", child.index, code,
                             extra={"action": "worker_config_error"})
                worst = EXIT_CONFIG
                continue
            if restart:
                lived = time.monotonic() - child.started
                # A worker that ran a while was not crash-looping: its backoff starts over. (A
                # run that kills its worker does so within its lease, and each attempt of it
                # counts; the backoff is for workers that cannot start at all.)
                crashes = 0 if lived > 10 else child.crashes + 1
                delay = min(0.5 * 2 ** (crashes - 1), 30.0) if crashes else 0.5
                logger.warning(
                    "%s (pid %d) exited with %d after %.1fs; restarting in %.1fs",
                    "the listener" if child.index == LISTENER else f"worker {child.index}",
                    pid, code, lived, delay, extra={"action": "worker_exited"},
                )
                self._restart_at[child.index] = (time.monotonic() + delay, crashes)
        return worst

    def _restart_due(self) -> None:
        if self._signals:
            self._restart_at.clear()
            return
        now = time.monotonic()
        for index, (at, crashes) in list(self._restart_at.items()):
            if at <= now:
                del self._restart_at[index]
                self._spawn(index, crashes)
