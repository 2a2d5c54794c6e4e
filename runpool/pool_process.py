"""Start and stop a pool (`python -m runpool`) as a child process: for the demo and the bench."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

__all__ = ["pool_process", "worker_pids"]


def worker_pids(supervisor_pid: int) -> list[int]:
    """The supervisor's live children: its worker processes (Linux /proc)."""
    children = Path(f"/proc/{supervisor_pid}/task/{supervisor_pid}/children")
    return [int(p) for p in children.read_text().split()] if children.exists() else []


@contextmanager
def pool_process(dsn: str, app: str, *, quiet: bool = True, **settings: Any
                 ) -> Iterator[subprocess.Popen[bytes]]:
    """A supervisor with its workers; drained with SIGTERM on exit (killed if it hangs)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RUNPOOL_")}
    env.update({f"RUNPOOL_{k.upper()}": str(v) for k, v in settings.items() if v is not None})
    env["RUNPOOL_DSN"] = dsn
    env["RUNPOOL_APP"] = app
    proc = subprocess.Popen(
        [sys.executable, "-m", "runpool"], env=env, start_new_session=True,
        stderr=subprocess.DEVNULL if quiet else None,
    )
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
