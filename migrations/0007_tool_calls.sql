-- 0007_tool_calls: an operator resolves a tool call a dead-lettered run cannot get past.
--
-- A run that failed `tool_outcome_unknown` meets the same unknown call on every retry, and a
-- call that committed a (transient) error returns that error forever: retry_run alone cannot
-- rescue them. resolve_tool_call says what happened instead:
--   result => value : "it was done, this is its result": the call is recorded succeeded with
--                     that result (the tool message the model sees says so);
--   retry  => true  : "run it again": the call and its tool message are forgotten, so the next
--                     attempt runs the tool as if it had never been started.
-- Then retry_run(run_id) puts the run back in the queue. A running run is refused: its lease
-- holder owns its history.
CREATE FUNCTION runpool.resolve_tool_call(run_id uuid, call_id text, result jsonb DEFAULT NULL,
                                          retry boolean DEFAULT false, tenant text DEFAULT NULL)
RETURNS text
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, runpool, pg_temp
AS $$
#variable_conflict use_column
DECLARE
    run runpool.runs;
    call runpool.tool_calls;
    rewritten integer;
BEGIN
    IF (resolve_tool_call.result IS NULL) = (resolve_tool_call.retry IS NOT TRUE) THEN
        RAISE EXCEPTION 'runpool.resolve_tool_call: give either a result or retry => true'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    -- Checked before the row lock (as cancel_run does; a run's tenant never changes): a refused
    -- call in a caller's open transaction must hold no lock on another tenant's running run,
    -- whose heartbeat would skip it until the lease ran out. Another tenant's run answers
    -- exactly like a missing one, by the same single probe: no existence or timing leak.
    IF resolve_tool_call.tenant IS NOT NULL AND NOT EXISTS (
            SELECT 1 FROM runpool.runs r
            WHERE r.id = resolve_tool_call.run_id AND r.tenant = resolve_tool_call.tenant) THEN
        RETURN NULL;
    END IF;
    SELECT * INTO run FROM runpool.runs r WHERE r.id = resolve_tool_call.run_id FOR UPDATE;
    IF NOT FOUND THEN
        RETURN NULL;
    END IF;
    SELECT * INTO call FROM runpool.tool_calls t
    WHERE t.run_id = run.id AND t.call_id = resolve_tool_call.call_id FOR UPDATE;
    IF NOT FOUND THEN
        RETURN NULL;
    END IF;
    IF run.status = 'running' THEN
        RAISE EXCEPTION 'runpool.resolve_tool_call: run % is running; cancel it or wait until it ends',
            run.id USING ERRCODE = 'object_not_in_prerequisite_state';
    END IF;
    IF resolve_tool_call.retry THEN
        DELETE FROM runpool.messages m WHERE m.run_id = run.id AND m.call_id = call.call_id;
        DELETE FROM runpool.tool_calls t WHERE t.run_id = run.id AND t.call_id = call.call_id;
        INSERT INTO runpool.run_events (run_id, kind, attempt, detail)
        VALUES (run.id, 'tool_call_resolved', run.attempt,
                jsonb_build_object('call_id', call.call_id, 'from', call.status, 'to', 'retry'));
        RETURN 'retry';
    END IF;
    UPDATE runpool.tool_calls t
    SET status = 'succeeded', result = resolve_tool_call.result, finished_at = now()
    WHERE t.run_id = run.id AND t.call_id = call.call_id;
    -- The model sees the resolution where it saw the call's outcome (or after the history).
    UPDATE runpool.messages m SET content = resolve_tool_call.result
    WHERE m.run_id = run.id AND m.call_id = call.call_id;
    GET DIAGNOSTICS rewritten = ROW_COUNT;
    IF rewritten = 0 THEN
        INSERT INTO runpool.messages (run_id, seq, role, content, attempt, call_id)
        SELECT run.id, coalesce(max(m.seq), 0) + 1, 'tool', resolve_tool_call.result,
               run.attempt, call.call_id
        FROM runpool.messages m WHERE m.run_id = run.id;
    END IF;
    INSERT INTO runpool.run_events (run_id, kind, attempt, detail)
    VALUES (run.id, 'tool_call_resolved', run.attempt,
            jsonb_build_object('call_id', call.call_id, 'from', call.status, 'to', 'succeeded'));
    RETURN 'succeeded';
END
$$;

REVOKE ALL ON FUNCTION runpool.resolve_tool_call(uuid, text, jsonb, boolean, text) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION runpool.resolve_tool_call(uuid, text, jsonb, boolean, text)
TO runpool_api, runpool_worker;
