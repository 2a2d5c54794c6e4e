"""The second sample agent: it proposes a dangerous tool call (deleting a customer's records),
waits durably for a person's approval (the run leaves its slot: status 'waiting'), and
continues when `signal_run` answers — running the call only if it was approved.

Its side effects go to `sample_agent_effects` (see sample_agent.prepare), one row per
execution, so "the draft ran once, across the wait" can be checked in SQL.
"""

from __future__ import annotations

from typing import Any, Final

from ..context import Run
from .sample_agent import recorder

__all__ = ["SIGNAL", "guarded_delete"]

# The signal a person (or a review UI) sends: {"approved": bool, "by": str}.
SIGNAL: Final = "approval"


async def guarded_delete(run: Run) -> Any:
    """Plan (a committed assistant turn), look the records up (a tool call, committed), then
    wait for approval; delete only when approved. On resume, the turn and the lookup come
    back from checkpoints: neither the model nor the lookup runs again."""
    customer = str(run.input.get("customer", "c-42"))
    if not any(m.role == "assistant" for m in run.messages):
        await run.add_message("assistant", {
            "plan": f"delete every record of customer {customer}",
            "needs_approval": True})
    found = await run.tool("lookup", "search", {"q": f"records of {customer}"},
                           recorder(run, "search"))
    decision = await run.wait_for(SIGNAL, timeout=run.input.get("approval_timeout", 3600))
    if not isinstance(decision, dict) or decision.get("approved") is not True:
        await run.add_message("assistant", {"declined": True, "by": _by(decision)})
        return {"deleted": False, "by": _by(decision)}
    await run.tool("delete", "delete_records", {"to": customer, "hits": found["hits"]},
                   recorder(run, "delete_records"))
    return {"deleted": True, "by": _by(decision)}


def _by(decision: Any) -> str:
    return str(decision.get("by", "someone")) if isinstance(decision, dict) else "someone"
