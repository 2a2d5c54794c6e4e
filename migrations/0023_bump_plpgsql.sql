-- 0023_bump_plpgsql: the status statements' counter bump (0020) becomes a PL/pgSQL function.
--
-- Why: a SQL function that is not inlined (this one is a table function that writes) is
-- read from its stored body and planned anew on every call: PostgreSQL 15 keeps no plan of a
-- SQL function across the statements that call it. Called once by every claim, outcome batch,
-- reap and release, it cost each of them the parse of its body (stringToNode: ~6 % of a
-- worker backend's CPU in the W1 drain, perf) and a plan of its UPDATE. PL/pgSQL keeps the
-- plan in the session.
--
-- Unchanged: what it does, its signature, and why it is a function at all: a volatile
-- function's statement takes a snapshot of its own (PL/pgSQL's too, in read committed), so
-- it sees every counter row committed until it runs, after the caller's locks (see 0020).
-- Like every PL/pgSQL function of the schema it runs with its owner's rights and a fixed
-- search_path (the worker holds UPDATE on event_seqs anyway: 0017).
CREATE OR REPLACE FUNCTION runpool._bump_event_seqs(run_ids uuid[])
RETURNS TABLE (run_id uuid, seq bigint)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER SET search_path = pg_catalog, runpool, pg_temp
AS $$
#variable_conflict use_column
BEGIN
    RETURN QUERY
    UPDATE runpool.event_seqs s SET seq = s.seq + 1
    WHERE s.run_id = ANY (run_ids)
    RETURNING s.run_id, s.seq;
END;
$$;

REVOKE ALL ON FUNCTION runpool._bump_event_seqs(uuid[]) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION runpool._bump_event_seqs(uuid[]) TO runpool_worker;
