"""The sample agent: a scripted, deterministic "model" (no network) that plans tool calls over
several turns, with tools that record their side effects — so a resume can be watched.

Used by the demo and the tests. Its side effects go to the table `sample_agent_effects`
(created by `prepare`), one row per execution, so "ran exactly once" can be checked in SQL.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any, Final

import psycopg

from ..app import App
from ..context import Run
from ..errors import ToolOutcomeUnknown

__all__ = ["EFFECTS", "ScriptedModel", "app", "prepare", "recorder"]

app = App()

# The side-effect log of the sample tools.
EFFECTS: Final = """
CREATE TABLE IF NOT EXISTS sample_agent_effects (
    run_id uuid NOT NULL, call_id text NOT NULL, tool text NOT NULL, attempt integer NOT NULL,
    idempotency_key text NOT NULL, at timestamptz NOT NULL DEFAULT clock_timestamp()
)
"""
RECORD: Final = """
INSERT INTO sample_agent_effects (run_id, call_id, tool, attempt, idempotency_key)
VALUES (%s, %s, %s, %s, %s)
"""


def prepare(conn: psycopg.Connection[Any]) -> None:
    conn.execute(EFFECTS)


class ScriptedModel:
    """Deterministic stand-in for an LLM: given the conversation so far, the next turn.

    Plan: `searches` search calls (one per turn), then one send_report call, then the answer.
    """

    def __init__(self, topic: str, searches: int, think_seconds: float) -> None:
        self.topic = topic
        self.searches = searches
        self.think_seconds = think_seconds

    async def next_turn(self, turn: int, run: Run | None = None) -> dict[str, Any]:
        # The model thinking (and being paid for), streaming its tokens to whoever follows.
        for words in range(1, 4):
            await asyncio.sleep(self.think_seconds / 3)
            if run is not None:
                await run.progress({"turn": turn, "text": " ".join(["thinking"] * words)})
        if turn < self.searches:
            return {"tool": "search", "call_id": f"search-{turn}",
                    "arguments": {"q": f"{self.topic} part {turn}"}}
        if turn == self.searches:
            return {"tool": "send_report", "call_id": "report",
                    "arguments": {"to": "owner@example.com", "topic": self.topic}}
        return {"answer": f"report on {self.topic} sent"}


def recorder(run: Run, tool: str) -> Any:
    """A sample tool that records each execution in sample_agent_effects."""
    async def record(arguments: Any, idempotency_key: str) -> Any:
        def write() -> None:
            with psycopg.connect(os.environ["RUNPOOL_DSN"], autocommit=True) as conn:
                conn.execute(RECORD, (run.id, idempotency_key.split(":", 1)[1], tool,
                                      run.attempt, idempotency_key))
        await asyncio.to_thread(write)
        await asyncio.sleep(float(run.input.get("tool_seconds", 0.2)))
        if tool == "search":
            return {"hits": [f"{arguments['q']} / result {i}" for i in range(2)]}
        return {"sent_to": arguments["to"]}
    return record


@app.handler("research")
async def research(run: Run) -> Any:
    """An agent loop: model turn, tool call, repeat. Each committed assistant turn and tool
    result is reused on resume; only the remaining turns call the model."""
    model = ScriptedModel(str(run.input.get("topic", "postgres queues")),
                          int(run.input.get("searches", 3)),
                          float(run.input.get("think_seconds", 0.2)))
    turn = 0
    while True:
        committed = [m.content for m in run.messages if m.role == "assistant"]
        step = committed[turn] if turn < len(committed) else None
        if step is None:
            with run.model_call("scripted-model"):
                step = await model.next_turn(turn, run)
            await run.add_message("assistant", step)
        if "answer" in step:
            return {"answer": step["answer"], "turns": turn + 1}
        try:
            # Sending a report is not safe to repeat: if a crash interrupted it, the agent is
            # told the outcome is unknown instead of sending it twice.
            await run.tool(step["call_id"], step["tool"], step["arguments"],
                           recorder(run, step["tool"]),
                           retry_interrupted=step["tool"] != "send_report")
        except ToolOutcomeUnknown:
            note = {"note": "the report may already have been sent; do not send it again"}
            if not any(m.content == note for m in run.messages):
                await run.add_message("user", note)
        turn += 1
