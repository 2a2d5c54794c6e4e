"""Exit codes of a worker process and of `python -m runpool worker`, defined once for the
worker that decides them, the supervisor that acts on them and the CLI that reports them."""

from __future__ import annotations

from typing import Final

__all__ = ["EXIT_CONFIG", "EXIT_ORPHANED", "EXIT_STUCK"]

# A worker exiting with this code cannot work on this database as configured (schema out of
# date, app not importable): restarting it would only spin, so the supervisor stops.
EXIT_CONFIG: Final = 78
# A worker exits with this code to end a run's thread that outlived its grace (a thread cannot
# be stopped): the supervisor restarts it like any other exit.
EXIT_STUCK: Final = 75
# An orphaned worker (its supervisor died) that is still stopping after its deadline exits at
# once, with this code.
EXIT_ORPHANED: Final = 70
