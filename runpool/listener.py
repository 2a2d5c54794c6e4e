"""The worker's dedicated LISTEN connection: wake-ups and cancel requests, with reconnects."""

from __future__ import annotations

import asyncio
import logging
import random
import uuid
from collections.abc import Callable
from typing import Final

import psycopg

from .db import aconnect

__all__ = ["CANCEL", "WAKEUP", "Listener"]

logger = logging.getLogger("runpool.listener")

WAKEUP: Final = "runpool_wakeup"
CANCEL: Final = "runpool_cancel"
# Channel names are fixed identifiers, so plain static SQL is enough.
LISTEN: Final = "LISTEN runpool_wakeup; LISTEN runpool_cancel"


class Listener:
    """Sets `wake` on every doorbell and calls `on_cancel(run_id)` on every cancel notice.

    After each (re)connect it sets `wake` too, because notifications sent while it was away are
    lost: the worker then claims once to catch up.
    """

    def __init__(
        self,
        dsn: str,
        wake: asyncio.Event,
        on_cancel: Callable[[uuid.UUID], None],
        *,
        worker_id: uuid.UUID,
    ) -> None:
        self._dsn = dsn
        self._wake = wake
        self._on_cancel = on_cancel
        self._worker_id = worker_id
        self.connected = asyncio.Event()
        self.reconnects = 0
        self.backend_pid: int | None = None

    async def run(self) -> None:
        delay = 0.1
        while True:
            try:
                conn = await aconnect(self._dsn, autocommit=True)
            except psycopg.OperationalError as exc:
                logger.warning(
                    "listen connection failed: %s", exc,
                    extra={"action": "listen_connect_failed", "worker_id": str(self._worker_id)},
                )
                await asyncio.sleep(delay * random.uniform(0.5, 1.5))
                delay = min(delay * 2, 5.0)
                continue
            try:
                async with conn:
                    await conn.execute(LISTEN)
                    self.backend_pid = conn.info.backend_pid
                    self.connected.set()
                    delay = 0.1
                    self._wake.set()
                    async for notice in conn.notifies():
                        self._dispatch(notice.channel, notice.payload)
            except psycopg.OperationalError as exc:
                self.connected.clear()
                self.reconnects += 1
                logger.warning(
                    "listen connection lost, reconnecting: %s", exc,
                    extra={"action": "listen_lost", "worker_id": str(self._worker_id)},
                )
                await asyncio.sleep(delay * random.uniform(0.5, 1.5))
                delay = min(delay * 2, 5.0)

    def _dispatch(self, channel: str, payload: str) -> None:
        if channel == WAKEUP:
            self._wake.set()
        elif channel == CANCEL:
            try:
                run_id = uuid.UUID(payload)
            except ValueError:
                # Anyone with LISTEN/NOTIFY rights can send noise; it must never hurt a worker.
                logger.info(
                    "ignoring malformed cancel notice %r", payload[:100],
                    extra={"action": "cancel_notice_ignored", "worker_id": str(self._worker_id)},
                )
                return
            self._on_cancel(run_id)
