-- 0020_status_seq: a worker's status change (claim, finish, reap, release: 0017) takes its
-- seq after a checkpoint's counter row that committed while the statement ran.
--
-- Why: those statements advanced the runs' counter rows (event_seqs, made by a run's first
-- checkpoint write: 0018) in their own snapshot, taken before they lock the run rows. A first
-- write committed in between (a draining worker's release_runs waits for the write's fence
-- lock; the reaper meets a zombie attempt's write; an outcome meets its attempt's write cut
-- off at its deadline but still running) made a counter row the statement could not see: it
-- numbered the change with the run row's seq + 1, the write's own seq again (two events of
-- one seq: a follower resuming after it skips one), and left the counter behind.
--
-- The statements now advance the counter rows of the runs they hold through this function,
-- once per statement, after their locks: a volatile function's statement takes a snapshot
-- of its own, so it sees every counter row committed until then, and none of those runs can
-- get one after (its writer must share-lock the run row). A run it returns no row for has
-- none: its run row's seq is the counter. A SQL-standard body binds every name when created
-- (no search_path consulted) and needs no rights of its owner (the worker updates
-- event_seqs: 0017).
CREATE FUNCTION runpool._bump_event_seqs(run_ids uuid[])
RETURNS TABLE (run_id uuid, seq bigint)
LANGUAGE sql VOLATILE
BEGIN ATOMIC
    UPDATE runpool.event_seqs s SET seq = s.seq OPERATOR(pg_catalog.+) 1
    WHERE s.run_id OPERATOR(pg_catalog.=) ANY (_bump_event_seqs.run_ids)
    RETURNING s.run_id, s.seq;
END;

REVOKE ALL ON FUNCTION runpool._bump_event_seqs(uuid[]) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION runpool._bump_event_seqs(uuid[]) TO runpool_worker;
