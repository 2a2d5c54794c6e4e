"""Each business rule has one definition (migration 0008), and what uses it really does:
the name limit is the same in Python and in every constraint, the rule functions are inlined
(free on the hot path), and the claim's probes read the ready-run index through the view."""

from __future__ import annotations

import psycopg
import pytest

from runpool.limits import NAME_MAX_LENGTH
from runpool.queries import QUERIES

# The CHECK constraints that bound a name's length, by table.
_NAME_CHECKS = """
SELECT c.conrelid::regclass::text, c.conname, pg_get_constraintdef(c.oid)
FROM pg_constraint c
WHERE c.connamespace = 'runpool'::regnamespace AND c.contype = 'c'
  AND c.conname IN ('tenant_length', 'handler_length', 'idempotency_key_length',
                    'serial_key_length', 'call_id_length', 'name_length')
ORDER BY 1, 2"""


def _plan(conn: psycopg.Connection, query: str, params: dict[str, object] | None = None) -> str:
    rows = conn.execute("EXPLAIN (VERBOSE, COSTS OFF) " + query, params).fetchall()
    return "\n".join(r[0] for r in rows)


def test_the_name_limit_is_one_number_in_python_in_sql_and_in_every_constraint(
        conn: psycopg.Connection) -> None:
    assert conn.execute("SELECT runpool.max_name_length()").fetchone() == (NAME_MAX_LENGTH,)
    checks = conn.execute(_NAME_CHECKS).fetchall()
    # runs, tenants, tool_calls: 7; schedules (0010): its tenant, handler and serial key.
    assert len(checks) == 10, checks
    for table, name, definition in checks:
        assert f"<= {NAME_MAX_LENGTH})" in definition, (table, name, definition)


def test_a_name_one_over_the_limit_is_refused_by_enqueue_with_the_limit_in_the_message(
        conn: psycopg.Connection) -> None:
    with pytest.raises(psycopg.errors.InvalidParameterValue, match=f"1 to {NAME_MAX_LENGTH} "):
        conn.execute("SELECT runpool.enqueue(%s, 'h')", ("t" * (NAME_MAX_LENGTH + 1),))
    assert conn.execute("SELECT count(*) FROM runpool.runs").fetchone() == (0,)


@pytest.mark.parametrize(("call", "expanded"), [
    ("runpool.attempts_used(r.attempt, r.attempt_offset)", "(attempt - attempt_offset)"),
    ("runpool.serial_key_lock(r.tenant, r.serial_key)", "hashtextextended("),
    ("runpool.rank(r.created_at, r.priority, 30.0)", "EXTRACT(epoch FROM created_at)"),
    # enqueue's and enqueue_many's one timeout and deadline rule (0022): enqueue_many checks
    # each run of a batch with them.
    ("runpool.timeout_problem(runpool.seconds_interval(r.priority), r.tenant)",
     "'1 year'::interval"),
    ("runpool.deadline_problem(r.deadline)", "'10 years'::interval"),
])
def test_the_rule_functions_are_inlined_so_the_hot_path_pays_no_call(
        conn: psycopg.Connection, call: str, expanded: str) -> None:
    plan = _plan(conn, f"SELECT {call} FROM runpool.runs r")
    name = call.split("(")[0]
    assert expanded in plan and name not in plan, plan


@pytest.mark.parametrize("statement", ["ready_handlers", "lock_tenants", "claim_runs"])
def test_the_claim_reads_ready_runs_through_the_ready_index(
        conn: psycopg.Connection, statement: str) -> None:
    # With sequential scans priced out, a probe can only avoid one through an index whose
    # predicate the view's implies: runs_ready.
    conn.execute("SET enable_seqscan = off")
    # The tenants claim_runs takes from, as lock_tenants leaves them (session-wide here).
    conn.execute("SELECT set_config('runpool.claim_tenants', '{t}', false),"
                 " set_config('runpool.claim_limited', '{t}', false)")
    params = {"handlers": ["h"], "limit": 10, "worker_id": None, "lease_seconds": 30,
              "roomy": False}
    plan = _plan(conn, QUERIES[statement], params)
    assert "runs_ready" in plan, plan


# The claim's parameters as a worker's prepared statements type them.
_CLAIM_TYPES = {"handlers": "text[]", "limit": "integer", "tenants": "text[]",
                "limited": "text[]", "worker_id": "uuid", "lease_seconds": "float8",
                "roomy": "boolean"}


@pytest.mark.parametrize("statement", ["lock_tenants", "claim_runs"])
def test_the_claims_generic_plan_never_reads_the_whole_runs_table(
        conn: psycopg.Connection, statement: str) -> None:
    # Workers plan the claim once, generically (db.WORKER_SESSION). With the one-row config
    # table taken for 1,660 rows (it is never analysed) those plans hashed a sequential scan
    # of runs, at every claim, however many runs the table held.
    conn.execute("SELECT count(*) FROM runpool.enqueue_many((SELECT jsonb_agg(jsonb_build_object("
                 "'tenant', 't' || i % 3, 'handler', 'h')) FROM generate_series(1, 20000) i))")
    conn.execute("ANALYZE runpool.runs")
    query, names = QUERIES[statement], list(_CLAIM_TYPES)
    used = sorted((n for n in names if f"%({n})s" in query), key=lambda n: query.index(f"%({n})s"))
    for i, name in enumerate(used, 1):
        query = query.replace(f"%({name})s", f"${i}")
    conn.execute("SET plan_cache_mode = force_generic_plan")
    conn.execute(f"PREPARE claim ({', '.join(_CLAIM_TYPES[n] for n in used)}) AS {query}")
    args = {"handlers": "'{h}'", "limit": "10", "tenants": "'{t0,t1}'", "limited": "'{}'",
            "worker_id": "gen_random_uuid()", "lease_seconds": "30", "roomy": "true"}
    plan = _plan(conn, f"EXECUTE claim ({', '.join(args[n] for n in used)})")
    assert "Seq Scan on runpool.runs" not in plan, plan
