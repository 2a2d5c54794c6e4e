"""An app with schedules, for the tests' real pools (tests.apps has none: every pool of the
other tests would otherwise upsert them)."""

from __future__ import annotations

from typing import Any

import runpool

app = runpool.App()


# @app.schedule below @app.handler (applied first) ...
@app.handler("tick")
@app.schedule("every-minute", "* * * * *", tenant="acme", input={"kind": "tick"},
              catch_up="all")
async def tick(run: runpool.Run) -> Any:
    return {"scheduled_at": run.input["scheduled_at"]}


# ... and above it.
@app.schedule("nightly-berlin", "30 2 * * *", tenant="acme", timezone="Europe/Berlin",
              catch_up="skip")
@app.handler("nightly")
async def nightly(run: runpool.Run) -> Any:
    return {"scheduled_at": run.input["scheduled_at"]}


# A schedule whose function was never registered as a handler: refused when loaded.
stray_app = runpool.App()


@stray_app.schedule("orphan", "@daily", tenant="acme")
async def orphan(run: runpool.Run) -> Any:
    return None
