"""What a dead-letter webhook receives: one JSON document a post, for one alert or a batch.

The contract (DESIGN.md "Operations and deployment") is a document whose top-level keys are
`id`, `run_id`, `tenant`, `handler`, `reason`, `attempts` and `text` (Slack-compatible). A post
for a single alert is that document, as before batching, plus `count` (1) and `alerts` (the
alert's own document). A post for several alerts of one tenant keeps every top-level key valid
for a receiver written for single alerts: `id` is the batch's own (stable for the same set of
alerts, so a redelivered batch carries the same id), `run_id`, `handler`, `reason` and
`attempts` are the batch's first (oldest) alert's, and `text` summarises the whole batch; `count`
and `alerts` (each alert's document, with its stable alert id) are the rest.
"""

from __future__ import annotations

import uuid
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final

__all__ = ["Alert", "batch_document"]

# Names of a batch's ids: uuid5 of its sorted alert ids under this namespace.
BATCH_NAMESPACE: Final = uuid.UUID("0d6f6c1e-5a53-4d1c-9a55-5b0d9e1f2a18")
# How many reasons, handlers and run ids a batch's text names before "and N more".
TEXT_NAMES: Final = 5
# The longest message a text quotes.
TEXT_MESSAGE: Final = 500


def _slack(text: str) -> str:
    """Slack's mrkdwn escapes: a tenant or message cannot inject links or mentions."""
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'s' if n != 1 else ''}"


@dataclass(frozen=True, slots=True)
class Alert:
    id: str
    run_id: str
    tenant: str
    handler: str
    reason: str | None
    message: str | None
    attempts: int
    tries: int
    failed_at: str

    @classmethod
    def from_row(cls, row: dict[str, Any]) -> Alert:
        return cls(id=str(row["id"]), run_id=str(row["run_id"]), tenant=row["tenant"],
                   handler=row["handler"], reason=row["reason"], message=row["message"],
                   attempts=row["attempts"], tries=row["tries"],
                   failed_at=row["created_at"].isoformat())

    def document(self) -> dict[str, Any]:
        """This alert alone: the contract's top-level keys, plus `message` and `failed_at`;
        `text` is what Slack (and compatible receivers) show."""
        reason = self.reason or "unknown"
        text = (f":rotating_light: runpool run `{self.run_id}` failed: *{_slack(reason)}*"
                f" (handler `{_slack(self.handler)}`, tenant `{_slack(self.tenant)}`,"
                f" {_plural(self.attempts, 'attempt')})")
        if self.message:
            text += f"\n>{_slack(self.message[:TEXT_MESSAGE])}"
        return {"id": self.id, "run_id": self.run_id, "tenant": self.tenant,
                "handler": self.handler, "reason": self.reason, "attempts": self.attempts,
                "text": text, "message": self.message, "failed_at": self.failed_at}


def _tally(values: Sequence[str]) -> str:
    """'3 `a`, 1 `b` and 2 more', most frequent first."""
    counts = Counter(values).most_common()
    named = ", ".join(f"{n} `{_slack(v)}`" for v, n in counts[:TEXT_NAMES])
    return named + (f" and {len(counts) - TEXT_NAMES} more" if len(counts) > TEXT_NAMES else "")


def batch_document(alerts: Sequence[Alert]) -> dict[str, Any]:
    """One post for `alerts` (one tenant's, oldest first; see the module docstring)."""
    first = alerts[0]
    if len(alerts) == 1:
        doc = first.document()
        return {**doc, "count": 1, "alerts": [doc]}
    batch_id = uuid.uuid5(BATCH_NAMESPACE, ",".join(sorted(a.id for a in alerts)))
    runs = ", ".join(f"`{a.run_id}`" for a in alerts[:TEXT_NAMES])
    more = len(alerts) - TEXT_NAMES
    text = (f":rotating_light: runpool: {len(alerts)} runs of tenant `{_slack(first.tenant)}`"
            f" failed: {_tally([a.reason or 'unknown' for a in alerts])}"
            f" (handlers: {_tally([a.handler for a in alerts])})\nruns {runs}"
            + (f" and {more} more" if more > 0 else ""))
    if first.message:
        text += f"\n>{_slack(first.message[:TEXT_MESSAGE])}"
    return {"id": str(batch_id), "run_id": first.run_id, "tenant": first.tenant,
            "handler": first.handler, "reason": first.reason, "attempts": first.attempts,
            "text": text, "message": first.message, "failed_at": first.failed_at,
            "count": len(alerts), "alerts": [a.document() for a in alerts]}
