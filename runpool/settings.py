"""All tunables of a pool in one frozen dataclass, read from flags and RUNPOOL_* variables."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any, Final

import psycopg
from psycopg.conninfo import conninfo_to_dict

from .errors import InvalidInput, one_line

__all__ = ["Settings"]


def _env_bool(value: str) -> bool:
    lowered = value.strip().lower()
    if lowered in {"1", "true", "yes", "on"}:
        return True
    if lowered in {"0", "false", "no", "off"}:
        return False
    raise InvalidInput(f"not a boolean: {value!r} (use 1/0, true/false, on/off)")


@dataclass(frozen=True, slots=True)
class Settings:
    """Pool settings. Every field has an environment twin RUNPOOL_<FIELD>."""

    # None: DATABASE_URL, else an embedded PostgreSQL in data_dir.
    dsn: str | None = None
    app: str | None = None
    # Handlers are I/O-bound coroutines: slots, not processes, give concurrency. More than 4
    # processes per host mostly spends connections (see the README's connection budget).
    workers: int = field(default_factory=lambda: min(os.cpu_count() or 1, 4))
    concurrency: int = 10
    lease_seconds: float = 30.0
    poll_seconds: float = 5.0
    grace_seconds: float = 30.0
    max_attempts: int | None = None
    retry_backoff_seconds: float = 1.0
    # None: tenants without their own quota are unlimited (written to runpool.config).
    tenant_quota: int | None = None
    aging_seconds: float | None = None
    cancel_grace_seconds: float = 10.0
    max_input_bytes: int | None = None
    # Largest message or tool result a handler may commit (a bigger tool result is committed
    # as an error the model sees; a bigger message is refused with InvalidInput).
    max_message_bytes: int = 1 << 20
    # Largest handler result (serialised JSON) a run may end with; a bigger one fails the run
    # with reason result_too_large instead of reaching (and stalling) an outcome batch.
    max_result_bytes: int = 1 << 20
    # Connections per worker for claims, heartbeats, outcomes and checkpoint writes;
    # None: 3 + concurrency / 4.
    pool_size: int | None = None
    listen: bool = True
    # The LISTEN connection's DSN, direct to PostgreSQL. Set, it lets `dsn` point at a pooler in
    # transaction mode (PgBouncer): work connections then keep no session state (no session SET,
    # no prepared statements). None: LISTEN on `dsn`, whose sessions are runpool's own.
    listen_dsn: str | None = None
    # A read replica's DSN (a streaming standby) for what only reads and may lag: `status`,
    # `schedules`, `runs RUN_ID`, `explain` and the console's pages. Writes, `wait`, `follow`
    # and the run API stay on `dsn`. None: everything on `dsn`. Workers never read it.
    read_dsn: str | None = None
    # The most work connections (claims, outcomes, checkpoints, heartbeats) of all the worker
    # processes of one host together, shared evenly; None: each takes `connections` + 1.
    host_connections: int | None = None
    data_dir: str = ".runpool/pgdata"
    # The most plans of one schedule that catch_up='all' fires after an outage (the latest).
    schedule_catchup_max: int = 100
    # Finished runs older than this are purged in the background with everything of theirs
    # (one purger at a time across the cluster); 0 keeps everything. Default: 7 days.
    retention_seconds: float = 604800.0
    # Where every run entering 'failed' is posted (a JSON document); None: nowhere (the alerts
    # wait in the database's outbox until a pool with a webhook delivers them, or retention
    # removes them).
    alert_webhook: str | None = None
    # Worker processes (and the host's listener process) run on uvloop's event loop when it
    # is installed (a dependency where it builds): None uses it if importable, False never
    # (docs/performance.md).
    uvloop: bool | None = None

    def __post_init__(self) -> None:
        positive = ("lease_seconds", "poll_seconds", "retry_backoff_seconds")
        for name in positive:
            if not getattr(self, name) > 0:
                raise InvalidInput(f"{name} must be > 0, got {getattr(self, name)}")
        for name in ("grace_seconds", "cancel_grace_seconds"):
            if getattr(self, name) < 0:
                raise InvalidInput(f"{name} must be >= 0, got {getattr(self, name)}")
        if not 1 <= self.workers <= 256:
            raise InvalidInput(f"workers must be between 1 and 256, got {self.workers}")
        if not 1 <= self.concurrency <= 10_000:
            raise InvalidInput(f"concurrency must be between 1 and 10000, got {self.concurrency}")
        if self.max_attempts is not None and not 1 <= self.max_attempts <= 1000:
            raise InvalidInput(f"max_attempts must be between 1 and 1000, got {self.max_attempts}")
        if self.tenant_quota is not None and not 0 <= self.tenant_quota <= 1_000_000:
            raise InvalidInput(
                f"tenant_quota must be between 0 and 1000000, got {self.tenant_quota}"
            )
        if not 1024 <= self.max_message_bytes <= 256 << 20:
            raise InvalidInput(f"max_message_bytes must be between 1024 and {256 << 20},"
                               f" got {self.max_message_bytes}")
        if not 1024 <= self.max_result_bytes <= 64 << 20:
            raise InvalidInput(f"max_result_bytes must be between 1024 and {64 << 20},"
                               f" got {self.max_result_bytes}")
        if self.pool_size is not None and not 2 <= self.pool_size <= 100:
            raise InvalidInput(f"pool_size must be between 2 and 100, got {self.pool_size}")
        if not 1 <= self.schedule_catchup_max <= 10_000:
            raise InvalidInput("schedule_catchup_max must be between 1 and 10000,"
                               f" got {self.schedule_catchup_max}")
        if self.dsn:
            _check_dsn("dsn", self.dsn)
        if self.listen_dsn is not None:
            _check_dsn("listen_dsn", self.listen_dsn)
        if self.read_dsn is not None:
            _check_dsn("read_dsn", self.read_dsn)
        if self.host_connections is not None and not (
                3 * self.workers <= self.host_connections <= 10_000):
            raise InvalidInput(
                f"host_connections must be between 3 x workers ({3 * self.workers}) and 10000,"
                f" got {self.host_connections} (each worker needs 2 pooled and 1 heartbeat"
                " connection)")
        if not 0 <= self.retention_seconds <= 100 * 365 * 86400:
            raise InvalidInput("retention_seconds must be between 0 (keep everything) and"
                               f" 100 years, got {self.retention_seconds}")
        if self.alert_webhook is not None and not self.alert_webhook.startswith(
                ("http://", "https://")):
            raise InvalidInput(f"alert_webhook must be an http(s) URL, got {self.alert_webhook!r}")
        if self.aging_seconds is not None and not self.aging_seconds > 0:
            raise InvalidInput(f"aging_seconds must be > 0, got {self.aging_seconds}")

    @property
    def connections(self) -> int:
        """One worker's pooled work connections (its heartbeat's own one comes on top)."""
        if self.host_connections is not None:
            # The host's cap, shared evenly: each worker keeps one for its heartbeat.
            return min(self.host_connections // self.workers - 1, 100)
        return self.pool_size or 3 + -(-self.concurrency // 4)

    @property
    def stateless(self) -> bool:
        """Whether work connections must keep no session state: `dsn` may be a pooler in
        transaction mode, which hands each transaction whichever server session is free."""
        return self.listen_dsn is not None

    @property
    def heartbeat_seconds(self) -> float:
        """Leases are renewed three times per lease period, so one lost beat costs nothing."""
        return self.lease_seconds / 3

    @classmethod
    def from_env(
        cls, environ: Mapping[str, str] | None = None, **overrides: Any
    ) -> Settings:
        """Build settings from RUNPOOL_* variables; non-None overrides (flags) win."""
        env = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for f in fields(cls):
            raw = env.get(f"RUNPOOL_{f.name.upper()}")
            if raw is None or raw == "":
                continue
            values[f.name] = _parse(f.name, raw, str(f.type))
        if "dsn" not in values and env.get("DATABASE_URL"):
            values["dsn"] = env["DATABASE_URL"]
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)


def _check_dsn(name: str, dsn: str) -> None:
    """Refuse a DSN libpq cannot parse, before anything connects (or forks): with libpq's
    reason, but not the pieces of the DSN it quotes, which may be a password."""
    try:
        conninfo_to_dict(dsn)
    except psycopg.ProgrammingError as exc:
        reason = _QUOTED.sub('"..."', one_line(exc))
        raise InvalidInput(f"{name} is not a PostgreSQL connection string: {reason}") from None


# What libpq's parse errors quote of the DSN.
_QUOTED: Final = re.compile(r'"[^"]*"')


def _parse(name: str, raw: str, type_name: str) -> Any:
    try:
        if type_name.startswith("bool"):
            return _env_bool(raw)
        if type_name.startswith("int"):
            return int(raw)
        if type_name.startswith("float"):
            return float(raw)
    except ValueError:
        raise InvalidInput(f"RUNPOOL_{name.upper()}: not a valid {type_name}: {raw!r}") from None
    return raw
