"""The relay's fan-out over real socket pairs (runpool.relay): a cancel notice that does not
fit a worker's full queue asks for a recheck (read every held run's cancel flag), and a
wake-up or a schedules notice is never lost: they wait for room, one of each kind however many
came, the wake-up first; a worker end that is gone costs the others nothing."""

from __future__ import annotations

import asyncio
import socket
import uuid
from collections.abc import Callable

from runpool.relay import CANCEL, SCHEDULES, WAKE, _Fanout, pair

TIMEOUT = 10.0


def _fanout(ends: list[socket.socket]) -> tuple[_Fanout, list[None]]:
    """A fan-out to `ends`, and the rechecks it asked for (one per cancel dropped)."""
    asked: list[None] = []
    return _Fanout(ends, lambda: asked.append(None)), asked


def _fill(fanout: _Fanout) -> int:
    """Cancel notices until the queues are full (the first dropped); how many went."""
    sent = 0
    while fanout.dropped == 0:
        fanout.send(CANCEL + uuid.uuid4().bytes)
        sent += 1
    return sent


async def _read(end: socket.socket, until: bytes) -> list[bytes]:
    """Every datagram on `end` up to and including the first `until`, within TIMEOUT."""
    loop = asyncio.get_running_loop()
    got: list[bytes] = []

    async def read() -> None:
        while until not in got:
            got.append(await loop.sock_recv(end, 64))

    await asyncio.wait_for(read(), TIMEOUT)
    return got


def test_fanout__a_full_queue_drops_cancels_for_a_recheck_and_keeps_one_of_each_notice(
        ) -> None:
    async def main() -> tuple[int, list[bytes], int, int, bool]:
        relay_end, worker_end = pair()
        worker_end.setblocking(False)
        with relay_end, worker_end:
            fanout, asked = _fanout([relay_end])
            sent = _fill(fanout)
            for _ in range(3):
                fanout.send(SCHEDULES)
                fanout.send(WAKE)
            fanout.send(CANCEL + uuid.uuid4().bytes)  # full still: dropped, a recheck asked
            dropped = fanout.dropped
            assert len(asked) == dropped
            got = await _read(worker_end, SCHEDULES)
            # Nothing more can come: nothing is kept and the end's writer was removed (a
            # writer left behind would send again at every turn of room), and nothing more
            # was sent meanwhile.
            left = bool(fanout._kept) or asyncio.get_running_loop().remove_writer(
                relay_end.fileno())
            try:
                extra = len(worker_end.recv(64))
            except BlockingIOError:
                extra = 0
            return sent, got, dropped, extra, left

    sent, got, dropped, extra, left = asyncio.run(main())
    cancels = [d for d in got if d.startswith(CANCEL)]
    assert len(cancels) == sent - 1, (len(cancels), sent)  # all that fit, in order
    # The kept notices, one of each, the doorbell first.
    assert got[len(cancels):] == [WAKE, SCHEDULES], got[len(cancels):]
    assert dropped == 2  # the cancel that found the queue full, and the one after
    assert extra == 0
    assert not left


def test_fanout__a_gone_worker_end_costs_the_other_workers_nothing() -> None:
    async def main() -> tuple[list[bytes], int, int]:
        gone_relay, gone_worker = pair()
        relay_end, worker_end = pair()
        worker_end.setblocking(False)
        with gone_relay, relay_end, worker_end:
            fanout, _ = _fanout([gone_relay, relay_end])
            _fill(fanout)  # both full: a cancel dropped at one or both
            fanout.send(WAKE)  # kept for both
            before, gone_kept = fanout.dropped, len(fanout._kept[0])
            gone_worker.close()  # its worker is gone (its queue with it)
            got = await _read(worker_end, WAKE)
            # The gone end's kept notices are dropped when its writer finds the end gone.
            await asyncio.wait_for(_until(lambda: not fanout._kept), TIMEOUT)
            fanout.send(WAKE)
            got += await _read(worker_end, WAKE)
            return got[-1:], fanout.dropped - before, gone_kept

    last, dropped, gone_kept = asyncio.run(main())
    assert last == [WAKE]
    # What was kept for the gone end, and the wake-up sent to it after.
    assert dropped == gone_kept + 1 and gone_kept >= 1, (dropped, gone_kept)


async def _until(predicate: Callable[[], bool]) -> None:
    while not predicate():  # noqa: ASYNC110 - the relay's state has no event; bounded by wait_for
        await asyncio.sleep(0.01)


def test_fanout__a_kept_wake_up_takes_the_first_place_a_read_frees_before_the_flood_does(
        ) -> None:
    """The end reports room only once its queue is down to a quarter: a worker reading more
    slowly than a flood comes never gets there, so the next notice sent puts what was kept
    into the first freed place, ahead of itself (on uvloop a loaded worker's doorbell waited
    for the flood's end: 26 s, the attack's repro)."""
    async def main() -> tuple[set[bytes], set[bytes], int, list[bytes]]:
        relay_end, worker_end = pair()
        worker_end.setblocking(False)
        with relay_end, worker_end:
            fanout, _ = _fanout([relay_end])
            _fill(fanout)
            fanout.send(WAKE)
            kept_before = set(fanout._kept[0])
            worker_end.recv(64)  # one place freed
            fanout.send(CANCEL + uuid.uuid4().bytes)  # the flood goes on
            kept_after = set(fanout._kept.get(0, ()))
            got = []
            while True:
                try:
                    got.append(worker_end.recv(64))
                except BlockingIOError:
                    break
            fanout.close()
            return kept_before, kept_after, fanout.dropped, got

    kept_before, kept_after, dropped, got = asyncio.run(main())
    assert kept_before == {WAKE} and not kept_after
    assert got[-1] == WAKE, got[-3:]  # in the freed place, last in the queue
    assert dropped == 2  # the cancel that filled the queue, and the flood's next one
