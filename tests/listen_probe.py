"""A Listener on its own, for tests that cut its network path: prints `connected`, `lost` and
`wake` (a doorbell) as they happen, one line each, flushed.

    python -m tests.listen_probe DSN
"""

from __future__ import annotations

import asyncio
import sys
import uuid

from runpool.listener import Listener


async def main(dsn: str) -> None:
    wake = asyncio.Event()
    listener = Listener(dsn, wake, lambda run_id: None, worker_id=uuid.uuid4())
    task = asyncio.create_task(listener.run())
    connected = False
    while not task.done():
        if listener.connected.is_set() != connected:
            connected = not connected
            print("connected" if connected else "lost", flush=True)
            wake.clear()  # a (re)connect sets it: only a doorbell after it counts
        elif connected and wake.is_set():
            wake.clear()
            print("wake", flush=True)
        await asyncio.sleep(0.05)
    task.result()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1]))
