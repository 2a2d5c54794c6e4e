-- 0017_perf_claim: the worker's own status changes (claim, finish, reap, release: every status
-- change of a W1 run) store their live status event in the run_events row they write anyway,
-- and take its seq in the same statement, instead of 0009's trigger writing a second table.
--
-- Why: the trigger cost each status change a plpgsql call, a probe of event_seqs and an
-- INSERT into status_events with its primary key: about 70 µs of server CPU per W1 run (two
-- changes), some 15 % of it. The run_events row (kind 'claimed', 'succeeded', ...) is written
-- by the same statements already; three more columns on it cost next to nothing.
--
-- The trigger stays for every other path (cancel_run, retry_run, waits, signals, the deadline
-- sweep: rare beside claims), and for pools of the code before this migration during a rolling
-- deploy: their statements do not set event_seq, so the trigger numbers and stores their
-- changes as before. The worker's statements set event_seq themselves (see queries.sql), which
-- is what the trigger's new WHEN tells apart. A follower reads both, through status_history.

-- A status change's live event: its per-run seq (NULL: an event of no status change, or one
-- 0009's trigger stored in status_events), the status and why. Nullable columns without a
-- default: a catalog change, no rewrite of the table.
ALTER TABLE runpool.run_events
    ADD COLUMN seq bigint,
    ADD COLUMN status text,
    ADD COLUMN reason text;

-- A statement that sets event_seq itself has numbered and stored its own event.
DROP TRIGGER run_status_changed ON runpool.runs;
CREATE TRIGGER run_status_changed
BEFORE UPDATE OF status ON runpool.runs
FOR EACH ROW
WHEN (OLD.status IS DISTINCT FROM NEW.status AND OLD.event_seq = NEW.event_seq)
EXECUTE FUNCTION runpool._run_status_changed();

-- Every stored status event of every run (not the 'queued' of seq 1, which is the run's
-- creation): the trigger's and the worker statements'. A query for one run's events probes
-- each table's run index (the view's UNION ALL takes the run_id condition into both).
CREATE VIEW runpool.status_history AS
SELECT s.run_id, s.seq, s.at, s.status, s.attempt, s.reason
FROM runpool.status_events s
UNION ALL
SELECT e.run_id, e.seq, e.at, e.status, e.attempt, e.reason
FROM runpool.run_events e
WHERE e.seq IS NOT NULL;

GRANT SELECT ON runpool.status_history TO runpool_api, runpool_worker;
-- The worker's statements take a checkpointed run's next seq from its counter row and ring a
-- run's doorbell when it ends (the trigger did both with its owner's rights).
GRANT UPDATE ON runpool.event_seqs TO runpool_worker;
GRANT EXECUTE ON FUNCTION runpool._ring(uuid) TO runpool_worker;
