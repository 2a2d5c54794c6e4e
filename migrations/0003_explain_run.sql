-- 0003_explain_run: "why isn't my run running?" as a function of the SQL API.

-- Describe a run's state and, for a queued run, everything that holds it back.
CREATE FUNCTION runpool.explain_run(run_id uuid)
RETURNS jsonb
LANGUAGE plpgsql STABLE SECURITY DEFINER SET search_path = runpool, pg_catalog, pg_temp
AS $$
#variable_conflict use_column
DECLARE
    run runpool.runs;
    quota integer;
    live integer;
    ahead bigint;
    blocker uuid;
    reasons jsonb := '[]';
    doc jsonb;
BEGIN
    SELECT * INTO run FROM runpool.runs r WHERE r.id = explain_run.run_id;
    IF NOT FOUND THEN
        RETURN NULL;
    END IF;
    doc := jsonb_build_object(
        'run_id', run.id, 'tenant', run.tenant, 'handler', run.handler, 'status', run.status,
        'priority', run.priority, 'attempt', run.attempt, 'max_attempts', run.max_attempts,
        'attempts_left', run.max_attempts - (run.attempt - run.attempt_offset),
        'created_at', run.created_at, 'serial_key', run.serial_key);
    IF run.status = 'running' THEN
        RETURN doc || jsonb_build_object(
            'worker_id', run.worker_id, 'started_at', run.started_at,
            'lease_expires_at', run.lease_expires_at,
            'lease_expired', run.lease_expires_at < now(),
            'cancel_requested_at', run.cancel_requested_at,
            'summary', CASE
                WHEN run.lease_expires_at < now()
                THEN 'lease expired: the next claim reclaims it'
                WHEN run.cancel_requested_at IS NOT NULL THEN 'running; cancellation requested'
                ELSE 'running' END);
    ELSIF run.status <> 'queued' THEN
        RETURN doc || jsonb_build_object(
            'finished_at', run.finished_at, 'result', run.result, 'error', run.error,
            'cancel_reason', run.cancel_reason,
            'summary', run.status || CASE WHEN run.status = 'failed'
                THEN ' (dead letter: runpool.retry_run replays it)' ELSE '' END);
    END IF;

    SELECT coalesce(t.max_running, c.default_quota) INTO quota
    FROM runpool.config c LEFT JOIN runpool.tenants t ON t.tenant = run.tenant;
    SELECT count(*) INTO live FROM runpool.runs l
    WHERE l.tenant = run.tenant AND l.status = 'running' AND l.lease_expires_at > now();
    IF quota IS NOT NULL AND live >= quota THEN
        reasons := reasons || jsonb_build_array(CASE WHEN quota = 0
            THEN format('tenant %s is paused (quota 0)', run.tenant)
            ELSE format('tenant %s at quota %s/%s', run.tenant, live, quota) END);
    END IF;
    IF run.held THEN
        SELECT b.id INTO blocker FROM runpool.runs b
        WHERE b.tenant = run.tenant AND b.serial_key = run.serial_key
          AND b.status IN ('queued', 'running') AND NOT b.held;
        reasons := reasons || jsonb_build_array(
            format('waiting for run %s of the same serial key %s', blocker, run.serial_key));
    END IF;
    IF run.available_at > now() THEN
        reasons := reasons || jsonb_build_array(
            format('not available until %s (scheduled or retry backoff)', run.available_at));
    END IF;
    -- Runs that will be claimed first: this tenant's better-ranked runs, and other tenants'
    -- better-ranked available runs. Capped so that explaining never costs a full scan.
    SELECT count(*) INTO ahead FROM (
        SELECT 1 FROM runpool.runs o
        WHERE o.status = 'queued' AND o.rank < run.rank AND o.available_at <= now()
        LIMIT 10000) x;
    RETURN doc || jsonb_build_object(
        'available_at', run.available_at, 'rank', run.rank,
        'tenant_running', live, 'tenant_quota', quota,
        'runs_ahead', ahead, 'runs_ahead_capped', ahead >= 10000,
        'held_by', reasons,
        'summary', CASE WHEN jsonb_array_length(reasons) = 0
            THEN format('waiting for a free slot; %s%s runs ahead of it', ahead,
                        CASE WHEN ahead >= 10000 THEN '+' ELSE '' END)
            ELSE reasons ->> 0 END);
END
$$;

REVOKE ALL ON FUNCTION runpool.explain_run(uuid) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION runpool.explain_run(uuid) TO runpool_api, runpool_worker;
