"""Schedules: what one is (Schedule), and the plan-time arithmetic every pool agrees on.

A schedule's plan times are the instants its cron expression names in its IANA time zone,
evaluated by `cronsim` the way Debian's cron does across daylight-saving changes:

- a local time that does not exist (spring forward) fires at the first minute after the gap
  (`30 2 * * *` in Europe/Berlin on 2026-03-29 fires at 03:00 CEST), but only for a job with a
  fixed minute and hour; a job whose minute or hour field starts with `*` (`*/15 * * * *`,
  `0 * * * *`) simply has no plan in the missing hour;
- a local time that occurs twice (fall back) fires once, at its first occurrence, for a job
  with a fixed minute and hour; a job whose minute or hour field starts with `*` fires in
  both occurrences (every real quarter hour stays a quarter hour apart).

Only UTC instants leave this module: plan times, next_fire_at, idempotency keys.
"""

from __future__ import annotations

import re
from collections import deque
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, Final
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from cronsim import CronSim, CronSimError

from .codec import dumps
from .errors import InvalidInput
from .limits import NAME_MAX_LENGTH

__all__ = [
    "CATCH_UP_MODES",
    "ON_TIME_SECONDS",
    "Schedule",
    "due_plans",
    "next_plan",
    "parse_cron",
    "plan_key",
    "plan_text",
    "upcoming",
    "zone",
]

CATCH_UP_MODES: Final = ("skip", "latest", "all")
# The @aliases of Vixie/Debian cron (@reboot has no plan time, so it is refused).
ALIASES: Final = {
    "@yearly": "0 0 1 1 *", "@annually": "0 0 1 1 *", "@monthly": "0 0 1 * *",
    "@weekly": "0 0 * * 0", "@daily": "0 0 * * *", "@midnight": "0 0 * * *",
    "@hourly": "0 * * * *",
}
# catch_up='skip' still fires a plan found this late (a pool busy, a database blip): only
# plans older than this, or older than a later due plan, count as missed.
ON_TIME_SECONDS: Final = 60.0
# Bounds the cron arithmetic of one firing, whatever the outage: plans are walked in windows
# reaching back from now, doubled until they hold what the catch-up mode needs.
_FIRST_WINDOW: Final = timedelta(hours=1)
_MAX_STEPS: Final = 200_000
_COUNTED_STEPS: Final = 2_000
_NAME_MAX: Final = 100
_CONTROL: Final = re.compile(r"[\x00-\x1f\x7f]")


def parse_cron(expr: str) -> str:
    """The 5-field expression `expr` stands for (aliases expanded); InvalidInput if cronsim
    cannot evaluate it."""
    if not isinstance(expr, str) or not 1 <= len(expr) <= 200:
        raise InvalidInput("cron must be a string of 1 to 200 characters")
    text = " ".join(expr.split())
    text = ALIASES.get(text.lower(), text)
    if text.startswith("@"):
        raise InvalidInput(f"cron: unknown alias {expr!r} (known: {', '.join(ALIASES)})")
    if len(text.split()) != 5:
        raise InvalidInput(f"cron must have 5 fields (minute hour day-of-month month"
                           f" day-of-week), got {expr!r}")
    try:
        CronSim(text, datetime(2000, 1, 1, tzinfo=UTC))
    except (CronSimError, ValueError) as exc:
        raise InvalidInput(f"cron {expr!r} is not valid: {exc}") from None
    return text


def zone(name: str) -> ZoneInfo:
    """The IANA time zone `name`; InvalidInput if this host's zone database lacks it."""
    if not isinstance(name, str) or not 1 <= len(name) <= 100:
        raise InvalidInput("timezone must be an IANA time zone name such as Europe/Berlin")
    try:
        return ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError) as exc:
        raise InvalidInput(f"timezone {name!r} is not a known IANA time zone: {exc}") from None


def _walk(cron: str, tz: ZoneInfo, after: datetime) -> Any:
    """Plan times strictly after `after`, as UTC instants, in order."""
    local = after.astimezone(tz)
    last = after
    for value in CronSim(cron, local):
        # In a repeated (fall-back) hour cronsim may answer the first occurrence of a fixed
        # time while `after` lies in the second one: a plan already behind us.
        instant = value.astimezone(UTC)
        if instant > last:
            last = instant
            yield instant


def next_plan(cron: str, timezone: str, after: datetime) -> datetime | None:
    """The first plan time strictly after `after` (None: the cron names no time in 50 years,
    such as `0 0 31 2 *`, which cronsim refuses anyway)."""
    for plan in _walk(parse_cron(cron), zone(timezone), after):
        return plan  # type: ignore[no-any-return]
    return None


def upcoming(cron: str, timezone: str, after: datetime, count: int) -> list[datetime]:
    """The next `count` plan times strictly after `after`."""
    plans: list[datetime] = []
    for plan in _walk(parse_cron(cron), zone(timezone), after):
        plans.append(plan)
        if len(plans) >= count:
            break
    return plans


def _plans_in(cron: str, tz: ZoneInfo, start: datetime, end: datetime, keep: int,
              max_steps: int = _MAX_STEPS) -> tuple[list[datetime], int, bool]:
    """The last `keep` plan times in (start, end], how many there are, and whether that is
    all of them (False: `max_steps` plans were walked before reaching `end`)."""
    kept: deque[datetime] = deque(maxlen=keep)
    total = 0
    for plan in _walk(cron, tz, start):
        if plan > end:
            return list(kept), total, True
        if total >= max_steps:
            return list(kept), total, False
        kept.append(plan)
        total += 1
    return list(kept), total, True


@dataclass(frozen=True, slots=True)
class Due:
    """What one firing of a schedule does: `fire` these plan times (oldest first), drop
    `dropped` missed ones (None: more than were counted), and wait for `next_fire_at`."""

    fire: list[datetime]
    dropped: int | None
    next_fire_at: datetime | None


def due_plans(cron: str, timezone: str, next_fire_at: datetime, now: datetime, catch_up: str,
              *, catch_up_max: int) -> Due:
    """The plans due at `now` for a schedule whose next plan was `next_fire_at` (<= now).

    `next_fire_at` itself is a plan (whatever the cron says: an operator may pin it); the
    cron's plans after it up to `now` are the others. skip: only the latest, and only if it is
    at most ON_TIME_SECONDS late; latest: the latest; all: the latest `catch_up_max`, oldest
    first. Whatever the outage, the arithmetic walks a bounded number of plans.
    """
    expr, tz = parse_cron(cron), zone(timezone)
    # The database answers in its session's time zone: plans are UTC instants here.
    next_fire_at, now = next_fire_at.astimezone(UTC), now.astimezone(UTC)
    keep = catch_up_max if catch_up == "all" else 1
    # The common case, a short outage: every plan since next_fire_at, counted.
    later, total, reached = _plans_in(expr, tz, next_fire_at, now, keep, _COUNTED_STEPS)
    window = _FIRST_WINDOW
    while not reached:
        start = now - window
        if start <= next_fire_at:
            later, total, reached = _plans_in(expr, tz, next_fire_at, now, keep)
            break
        later, total, _ = _plans_in(expr, tz, start, now, keep)
        if len(later) >= keep:
            break
        window *= 2
    # next_fire_at is due too, before every later plan: known only if the walk reached it.
    plans = ([next_fire_at] if reached else []) + later
    if catch_up == "all":
        fire = plans[-keep:]
    elif catch_up == "latest":
        fire = plans[-1:]
    else:
        fire = [p for p in plans[-1:] if (now - p).total_seconds() <= ON_TIME_SECONDS]
    dropped = total + 1 - len(fire) if reached else None
    return Due(fire, dropped, next(_walk(expr, tz, now), None))


def plan_text(plan: datetime) -> str:
    """A plan time as runs see it: ISO 8601 UTC to the second, with a Z."""
    return f"{plan.astimezone(UTC):%Y-%m-%dT%H:%M:%SZ}"


def plan_key(name: str, plan: datetime) -> str:
    """The idempotency key of a plan's run: schedule:<name>:<plan time, UTC, to the second>."""
    return f"schedule:{name}:{plan_text(plan)}"


@dataclass(frozen=True, slots=True)
class Schedule:
    """A schedule defined in code (App.schedule); validated here, before any database."""

    name: str
    cron: str
    handler: str
    tenant: str
    input: dict[str, Any] = field(default_factory=dict)
    timezone: str = "UTC"
    catch_up: str = "latest"
    priority: int = 0
    serial_key: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not 1 <= len(self.name) <= _NAME_MAX \
                or _CONTROL.search(self.name):
            raise InvalidInput(f"schedule name must be 1 to {_NAME_MAX} characters, no control"
                               " characters")
        parse_cron(self.cron)
        zone(self.timezone)
        if self.catch_up not in CATCH_UP_MODES:
            raise InvalidInput(f"schedule {self.name!r}: catch_up must be one of"
                               f" {', '.join(CATCH_UP_MODES)}, got {self.catch_up!r}")
        if not isinstance(self.tenant, str) or not 1 <= len(self.tenant) <= NAME_MAX_LENGTH:
            raise InvalidInput(f"schedule {self.name!r}: tenant must be 1 to"
                               f" {NAME_MAX_LENGTH} characters")
        if not isinstance(self.input, dict):
            raise InvalidInput(f"schedule {self.name!r}: input must be a dict (each run gets"
                               " it with 'scheduled_at' added)")
        dumps(self.input)  # serialisable, or InvalidInput now rather than at a pool's start
        if isinstance(self.priority, bool) or not isinstance(self.priority, int) \
                or not -100 <= self.priority <= 100:
            raise InvalidInput(f"schedule {self.name!r}: priority must be an int between -100"
                               " and 100")
        if self.serial_key is not None and not 1 <= len(self.serial_key) <= NAME_MAX_LENGTH:
            raise InvalidInput(f"schedule {self.name!r}: serial_key must be 1 to"
                               f" {NAME_MAX_LENGTH} characters")
