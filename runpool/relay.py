"""One LISTEN connection per host: the supervisor forks a relay process that listens for
every worker process of the host and passes each doorbell, cancel notice and schedule notice on
to them over a datagram socket pair per worker.

Datagrams are 1 byte (W: wake, S: schedules changed, L: the relay listens anew, R: recheck) or
17 (C + the run id's 16 bytes); the relay has checked the cancel payload is a run id, and
passes on only the cancels the database confirms (runpool.relay_confirm: any login can NOTIFY,
and forged cancels must not reach the workers), so a worker parses nothing it could choke on. A
worker that does not read its socket (stopped, restarting, or slow under load) must not hold
the relay up, and must not lose a notice: a cancel notice that does not fit asks for a recheck
(R: read the cancel flags of every run held; at most twice a second), and a wake-up, schedules,
listening or recheck notice that does not fit is kept, one of each kind per worker, and sent as
soon as that worker's queue has room (a few hundred datagrams: 278 on Linux by default). A real
doorbell dropped behind a full queue (of forged cancels, before they were checked) once left
its run for the next poll (CI: a run not started 22 s after its enqueue, with polls a minute
apart).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import signal
import socket
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Final

from .listener import Listener, NoiseLog
from .relay_confirm import CancelConfirm

__all__ = ["PROCESS_NAME", "RelayReader", "pair", "run_relay_process"]

logger = logging.getLogger("runpool.relay")

WAKE: Final = b"W"
SCHEDULES: Final = b"S"
# The relay (re)connected: notices sent while it was away are lost.
LISTENING: Final = b"L"
CANCEL: Final = b"C"
# Cancel notices were dropped (a full queue, too many to check at once, a failed check): read
# the cancel flags of every run held.
RECHECK: Final = b"R"
# Which kept notice goes first when a full queue frees a place.
KEPT_ORDER: Final = (WAKE, LISTENING, SCHEDULES, RECHECK)
# Seconds between two rechecks the relay asks of every worker: a flood must not turn into
# back-to-back flag reads.
RECHECK_SPACING: Final = 0.5
# The most datagrams a worker reads at once, past the one it waited for (a turn of its loop).
READ_BURST: Final = 1024
# The relay's id on its log lines (a relay is no worker; this marks whose line it is).
RELAY_ID: Final = uuid.UUID(int=0)


def pair() -> tuple[socket.socket, socket.socket]:
    """(the relay's end, a worker's end): non-blocking sends, so a slow worker is skipped."""
    relay_end, worker_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
    relay_end.setblocking(False)
    return relay_end, worker_end


class _Fanout:
    """Sends each notice to every worker's end (on the running loop): see the module's
    docstring for what does not fit; `on_cancel_dropped()` when a cancel did not."""

    def __init__(self, ends: list[socket.socket], on_cancel_dropped: Callable[[], None]) -> None:
        self._ends = ends
        self._on_cancel_dropped = on_cancel_dropped
        self._loop = asyncio.get_running_loop()
        # The notices kept for an end whose queue was full, by the end's index: a set, as one
        # wake-up (or schedules notice, or recheck) stands for any number.
        self._kept: dict[int, set[bytes]] = {}
        self.dropped = 0
        # Times an end's queue filled (see _keep).
        self._fills = NoiseLog()

    def send(self, message: bytes) -> None:
        for i, end in enumerate(self._ends):
            if i in self._kept:
                # What waits goes first, into any room a read made: the end reports room only
                # once its queue is down to a quarter, and a worker that reads more slowly than
                # a flood comes never gets there, while each freed place would go to the flood.
                self._flush(i)
            if i not in self._kept:
                try:
                    end.send(message)
                    continue
                except BlockingIOError:  # its queue is full
                    pass
                except OSError:  # its worker end is gone
                    self.dropped += 1
                    continue
            # No room: a cancel is dropped, for a recheck (spaced: a flood of cancels the relay
            # could not check must not become a flood of rechecks), anything else kept.
            if message.startswith(CANCEL):
                self.dropped += 1
                self._on_cancel_dropped()
            elif i in self._kept:
                self._kept[i].add(message)
            else:
                self._keep(i, message)

    def _keep(self, i: int, message: bytes) -> None:
        self._kept[i] = {message}
        self._loop.add_writer(self._ends[i].fileno(), self._flush, i)
        # A worker stopped, restarting or slow, or many real cancels at once.
        if count := self._fills.count():
            logger.info("a worker's notice queue was full %d times (last: worker %d): its"
                        " wake-up, schedules and recheck notices wait for room", count, i,
                        extra={"action": "relay_notice_kept", "worker": i, "count": count})

    def _flush(self, i: int) -> None:
        """Send what was kept for end `i`, as far as its queue has room."""
        kept = self._kept[i]
        while kept:
            # The doorbell first: a run waits on it, while a recheck only hurries a cancel.
            message = min(kept, key=KEPT_ORDER.index)
            try:
                self._ends[i].send(message)
            except BlockingIOError:
                return  # full again: the next turn of room sends the rest
            except OSError:
                self.dropped += len(kept)
                break
            kept.discard(message)
        del self._kept[i]
        self._loop.remove_writer(self._ends[i].fileno())

    def close(self) -> None:
        """The relay stops: what is still kept is dropped (and counted)."""
        for i, kept in self._kept.items():
            self.dropped += len(kept)
            self._loop.remove_writer(self._ends[i].fileno())
        self._kept.clear()


class _Rechecks:
    """Asks every worker to read its runs' cancel flags (cancel notices were dropped: too many
    to check, a failed check, a full queue), at most once per RECHECK_SPACING: the ask that
    comes sooner is sent when the spacing is up, not lost."""

    def __init__(self, send: Callable[[bytes], None]) -> None:
        self._send_notice = send
        self._loop = asyncio.get_running_loop()
        self._sent = -math.inf
        self._timer: asyncio.TimerHandle | None = None

    def request(self) -> None:
        if self._timer is not None:
            return  # one is due already
        wait = self._sent + RECHECK_SPACING - self._loop.time()
        if wait <= 0:
            self._send()
        else:
            self._timer = self._loop.call_later(wait, self._send)

    def _send(self) -> None:
        self._timer = None
        self._sent = self._loop.time()
        self._send_notice(RECHECK)

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()


# The relay process's name (Linux: ps, top and /proc/PID/comm show it), which tells it from the
# workers forked from the same supervisor.
PROCESS_NAME: Final = "runpool-listen"


def run_relay_process(listen_dsn: str, ends: list[socket.socket], parent_fd: int | None, *,
                      check_dsn: str, stateless: bool,
                      loop_factory: Callable[[], asyncio.AbstractEventLoop] | None = None) -> int:
    """The body of the relay process (on the workers' kind of event loop, `loop_factory`);
    returns its exit code. Cancel notices are checked on `check_dsn` (the work DSN;
    `stateless`: behind a pooler)."""
    with contextlib.suppress(OSError):  # not Linux: the name is only a convenience
        Path("/proc/self/comm").write_text(PROCESS_NAME)
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        return runner.run(_relay(listen_dsn, ends, parent_fd, check_dsn, stateless))


async def _relay(listen_dsn: str, ends: list[socket.socket], parent_fd: int | None,
                 check_dsn: str, stateless: bool) -> int:
    loop = asyncio.get_running_loop()
    fanout = _Fanout(ends, lambda: rechecks.request())
    rechecks = _Rechecks(fanout.send)
    wake = asyncio.Event()
    done = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, done.set)
    loop.add_signal_handler(signal.SIGUSR1, done.set)
    if parent_fd is not None:
        loop.add_reader(parent_fd, done.set)  # EOF: the supervisor is gone
    cancels = CancelConfirm(check_dsn, stateless=stateless,
                            forward=lambda run_id: fanout.send(CANCEL + run_id.bytes),
                            recheck=rechecks.request)

    def connected() -> None:
        # What was pending is left to the workers: LISTENING makes them read every flag.
        cancels.reset()
        fanout.send(LISTENING)

    listener = Listener(
        listen_dsn, wake, cancels.add, worker_id=RELAY_ID,
        on_schedules=lambda: fanout.send(SCHEDULES), on_connect=connected)

    async def wakes() -> None:
        # Wake-ups that arrive while one is being sent fold into the next: each worker claims
        # what there is, however many doorbells rang.
        while True:
            await wake.wait()
            wake.clear()
            fanout.send(WAKE)

    tasks = [asyncio.create_task(listener.run(), name="relay-listener"),
             asyncio.create_task(wakes(), name="relay-wakes"),
             asyncio.create_task(cancels.run(), name="relay-cancel-checks")]
    logger.info("relaying notices to %d workers", len(ends),
                extra={"action": "relay_started", "pid": os.getpid()})
    stopper = asyncio.ensure_future(done.wait())
    finished, _ = await asyncio.wait([*tasks, stopper], return_when=asyncio.FIRST_COMPLETED)
    for task in [*tasks, stopper]:
        task.cancel()
    await asyncio.gather(*tasks, stopper, return_exceptions=True)
    rechecks.close()
    fanout.close()
    failed = [t for t in finished if t is not stopper and not t.cancelled() and t.exception()]
    for task in failed:
        logger.error("relay task %s failed: %r", task.get_name(), task.exception(),
                     extra={"action": "relay_failed"})
    logger.info("relay stopped (%d datagrams dropped; cancel notices: %d unconfirmed, %d"
                " dropped unchecked)", fanout.dropped, cancels.unconfirmed, cancels.dropped,
                extra={"action": "relay_stopped", "dropped": fanout.dropped,
                       "unconfirmed": cancels.unconfirmed, "unchecked": cancels.dropped})
    return 1 if failed else 0


class RelayReader:
    """A worker's side of the relay: what a Listener would do with the notices it reads,
    from the worker's end of its socket pair (`fd`, inherited from the supervisor).
    `on_listening()`: cancel notices may have been missed (the relay listens anew, or it
    dropped some), so the worker reads the flags of the runs it holds."""

    def __init__(self, fd: int, wake: asyncio.Event, on_cancel: Callable[[uuid.UUID], None],
                 *, worker_id: uuid.UUID, on_schedules: Callable[[], None] | None = None,
                 on_listening: Callable[[], None] | None = None) -> None:
        self._fd = fd
        self._wake = wake
        self._on_cancel = on_cancel
        self._on_schedules = on_schedules
        self._on_listening = on_listening
        self._log = {"worker_id": str(worker_id)}
        # Set once reading (what a Listener sets once listening).
        self.connected = asyncio.Event()

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        # A duplicate: closing it leaves the inherited descriptor to a restarted worker's peer.
        with socket.socket(fileno=os.dup(self._fd)) as sock:
            sock.setblocking(False)
            self.connected.set()
            while True:
                self._dispatch(await loop.sock_recv(sock, 64))
                # Whatever else is queued, now: a wait for each datagram costs a turn of a
                # loop that may be busy, and under a flood of notices the relay keeps this
                # worker's wake-ups until its queue is down to a quarter (see _Fanout).
                for _ in range(READ_BURST):
                    try:
                        data = sock.recv(64)
                    except BlockingIOError:
                        break
                    self._dispatch(data)

    def _dispatch(self, data: bytes) -> None:
        kind = data[:1]
        if kind == WAKE:
            self._wake.set()
        elif kind in (SCHEDULES, LISTENING):
            # A schedule changed, or the relay (re)connected and notices may have been missed.
            self._wake.set()
            if self._on_schedules is not None:
                self._on_schedules()
            if kind == LISTENING and self._on_listening is not None:
                self._on_listening()
        elif kind == CANCEL and len(data) == 17:
            self._on_cancel(uuid.UUID(bytes=data[1:]))
        elif kind == RECHECK:
            # Cancel notices were dropped on the way: the flags are read instead.
            if self._on_listening is not None:
                self._on_listening()
        else:  # only the relay writes here; log, never fail, on what it cannot have sent
            logger.warning("ignoring an unknown relay datagram %r", data[:20],
                           extra={"action": "relay_datagram_ignored", **self._log})
