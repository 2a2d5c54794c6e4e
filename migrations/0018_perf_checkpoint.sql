-- 0018_perf_checkpoint: a worker's checkpoint write (a message, a tool call's start, its
-- commit) takes its event seqs and rings its run's doorbell in its own statement, instead of
-- 0009's triggers calling plpgsql per row.
--
-- Why: per agent turn (a tool call started and committed, a message) the triggers made four
-- calls of _next_event_seq, each a SECURITY DEFINER plpgsql call (its search_path set and
-- reset), a second share lock of the run row, an upsert of event_seqs and a plpgsql _ring:
-- about a quarter of the server's CPU per turn (W11, pg_stat_statements with track = all).
-- The write statements (checkpoints/store.py) already hold the run row share-locked (their
-- fence); they now take the seqs from the same event_seqs counter row, in one upsert per
-- statement (a tool call's commit takes two: its result, then its message).
--
-- The triggers stay for every other writer (resolve_tool_call, an operator's UPDATE, pools of
-- the code before this migration during a rolling deploy): a row whose statement did not set
-- its seq still gets one from them, as before. Their WHEN tells the two apart without calling
-- any function.

-- Ring a run's doorbell (the rule of 0009, unchanged: not while the notification queue is over
-- runpool.notify_queue_limit, default half full), now a plain SQL expression the planner
-- inlines into the statement that calls it: no function call per write. It needs no rights of
-- its owner (pg_notify needs none), so it is no longer SECURITY DEFINER; its SQL-standard body
-- binds every name when it is created, so no caller's search_path is ever consulted for it.
CREATE OR REPLACE FUNCTION runpool._ring(run_id uuid) RETURNS void
LANGUAGE sql
RETURN CASE
    WHEN pg_catalog.pg_notification_queue_usage() OPERATOR(pg_catalog.<) coalesce(
        nullif(pg_catalog.current_setting('runpool.notify_queue_limit', true),
                          '')::float8, 0.5)
    THEN pg_catalog.pg_notify(
        'runpool_run_' OPERATOR(pg_catalog.||)
            pg_catalog.replace(_ring.run_id::text, '-', ''), '')
END;

-- A message's seq from its statement, or else from the trigger (a row inserted without one);
-- resolve_tool_call's rewrite of a message's content still takes a new one.
DROP TRIGGER message_event ON runpool.messages;
CREATE TRIGGER message_event
BEFORE INSERT ON runpool.messages
FOR EACH ROW
WHEN (NEW.event_seq IS NULL)
EXECUTE FUNCTION runpool._message_event();

CREATE TRIGGER message_changed
BEFORE UPDATE OF content ON runpool.messages
FOR EACH ROW
EXECUTE FUNCTION runpool._message_event();

-- A tool call's start or close numbered by its statement is not numbered again.
DROP TRIGGER tool_call_event ON runpool.tool_calls;
CREATE TRIGGER tool_call_event
BEFORE INSERT ON runpool.tool_calls
FOR EACH ROW
WHEN (NEW.started_seq IS NULL)
EXECUTE FUNCTION runpool._tool_call_event();

DROP TRIGGER tool_call_changed ON runpool.tool_calls;
CREATE TRIGGER tool_call_changed
BEFORE UPDATE ON runpool.tool_calls
FOR EACH ROW
WHEN ((OLD.status IS DISTINCT FROM NEW.status OR OLD.executions IS DISTINCT FROM NEW.executions
       OR OLD.result IS DISTINCT FROM NEW.result)
      AND OLD.started_seq IS NOT DISTINCT FROM NEW.started_seq
      AND OLD.finished_seq IS NOT DISTINCT FROM NEW.finished_seq)
EXECUTE FUNCTION runpool._tool_call_event();

-- The worker's statements take the seqs from the counter row (creating it at a run's first
-- write) and ring the doorbell themselves.
GRANT INSERT, UPDATE ON runpool.event_seqs TO runpool_worker;
GRANT EXECUTE ON FUNCTION runpool._ring(uuid) TO runpool_worker;
