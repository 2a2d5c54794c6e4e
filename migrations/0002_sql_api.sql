-- 0002_sql_api: the public SQL API (enqueue, cancel_run, retry_run, set_tenant_quota) and the
-- serial-key release. Every function is SECURITY DEFINER with a pinned search_path, so an API
-- role needs no table rights; PUBLIC gets no execute.

-- The key's lock: taken by enqueue and by the release of the next run.
CREATE FUNCTION runpool._lock_serial_key(tenant text, serial_key text) RETURNS void
LANGUAGE sql SECURITY DEFINER SET search_path = runpool, pg_catalog, pg_temp
AS $$ SELECT pg_advisory_xact_lock(hashtextextended(tenant || chr(31) || serial_key, 7370)) $$;

-- When a keyed run ends (finish, reap, release, cancel, even a manual UPDATE), release the
-- next waiting run of its key. A row trigger whose WHEN clause is checked before any function
-- call, so unkeyed runs pay nothing. The key's lock comes first and the release is a statement
-- of its own, so it sees every enqueue committed before the lock was granted.
CREATE FUNCTION runpool._serial_key_ended() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = runpool, pg_catalog, pg_temp
AS $$
BEGIN
    PERFORM runpool._lock_serial_key(NEW.tenant, NEW.serial_key);
    UPDATE runpool.runs r SET held = false
    WHERE r.id = (SELECT w.id FROM runpool.runs w
                  WHERE w.tenant = NEW.tenant AND w.serial_key = NEW.serial_key AND w.held
                  ORDER BY w.serial_order LIMIT 1)
      AND NOT EXISTS (SELECT 1 FROM runpool.runs a
                      WHERE a.tenant = NEW.tenant AND a.serial_key = NEW.serial_key
                        AND a.status IN ('queued', 'running') AND NOT a.held);
    -- A worker ending a run claims again right away; anyone else (an API cancelling a run,
    -- say) rings the doorbell so the released run starts now rather than at the next poll.
    IF FOUND AND current_setting('runpool.session', true) IS DISTINCT FROM 'worker' THEN
        PERFORM pg_notify('runpool_wakeup', '');
    END IF;
    RETURN NULL;
END
$$;

CREATE TRIGGER serial_key_ended
AFTER UPDATE OF status ON runpool.runs
FOR EACH ROW
WHEN (NEW.serial_key IS NOT NULL
      AND NEW.status IN ('succeeded', 'failed', 'cancelled')
      AND OLD.status IN ('queued', 'running'))
EXECUTE FUNCTION runpool._serial_key_ended();

-- Enqueue one run; repeated (tenant, idempotency_key) returns the first run's id.
CREATE FUNCTION runpool.enqueue(
    tenant text,
    handler text,
    input jsonb DEFAULT '{}',
    priority integer DEFAULT 0,
    idempotency_key text DEFAULT NULL,
    run_at timestamptz DEFAULT NULL,
    max_attempts integer DEFAULT NULL,
    traceparent text DEFAULT NULL,
    serial_key text DEFAULT NULL
) RETURNS uuid
LANGUAGE plpgsql SECURITY DEFINER SET search_path = runpool, pg_catalog, pg_temp
AS $$
#variable_conflict use_column
DECLARE
    cfg runpool.config;
    -- clock_timestamp, not now(): runs enqueued in one transaction keep their order.
    available timestamptz := greatest(coalesce(enqueue.run_at, clock_timestamp()),
                                      clock_timestamp());
    new_id uuid;
    waits boolean := false;
    position bigint;
BEGIN
    IF enqueue.tenant IS NULL OR length(enqueue.tenant) NOT BETWEEN 1 AND 200 THEN
        RAISE EXCEPTION 'runpool.enqueue: tenant must be 1 to 200 characters'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF enqueue.handler IS NULL OR length(enqueue.handler) NOT BETWEEN 1 AND 200 THEN
        RAISE EXCEPTION 'runpool.enqueue: handler must be 1 to 200 characters'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF enqueue.priority IS NULL OR enqueue.priority NOT BETWEEN -100 AND 100 THEN
        RAISE EXCEPTION 'runpool.enqueue: priority must be between -100 and 100, got %',
            coalesce(enqueue.priority::text, 'NULL') USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF enqueue.max_attempts IS NOT NULL AND enqueue.max_attempts NOT BETWEEN 1 AND 1000 THEN
        RAISE EXCEPTION 'runpool.enqueue: max_attempts must be between 1 and 1000, got %',
            enqueue.max_attempts USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF enqueue.idempotency_key IS NOT NULL AND length(enqueue.idempotency_key) NOT BETWEEN 1 AND 200 THEN
        RAISE EXCEPTION 'runpool.enqueue: idempotency_key must be 1 to 200 characters'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF enqueue.serial_key IS NOT NULL AND length(enqueue.serial_key) NOT BETWEEN 1 AND 200 THEN
        RAISE EXCEPTION 'runpool.enqueue: serial_key must be 1 to 200 characters'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF enqueue.traceparent IS NOT NULL AND length(enqueue.traceparent) > 128 THEN
        RAISE EXCEPTION 'runpool.enqueue: traceparent is longer than 128 characters'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    SELECT * INTO cfg FROM runpool.config;
    IF octet_length(coalesce(enqueue.input, '{}')::text) > cfg.max_input_bytes THEN
        RAISE EXCEPTION 'runpool.enqueue: input is % bytes, over the limit of % bytes',
            octet_length(enqueue.input::text), cfg.max_input_bytes
            USING ERRCODE = 'program_limit_exceeded';
    END IF;

    IF enqueue.serial_key IS NOT NULL THEN
        -- Under the key's lock, and in statements of their own: the check below sees every
        -- run of the key committed before the lock was granted.
        PERFORM runpool._lock_serial_key(enqueue.tenant, enqueue.serial_key);
        position := nextval('runpool.serial_order');
        waits := EXISTS (SELECT 1 FROM runpool.runs r
                         WHERE r.tenant = enqueue.tenant AND r.serial_key = enqueue.serial_key
                           AND r.status IN ('queued', 'running'));
    END IF;

    INSERT INTO runpool.tenants (tenant) VALUES (enqueue.tenant) ON CONFLICT DO NOTHING;
    INSERT INTO runpool.runs AS r (
        tenant, handler, input, priority, idempotency_key, available_at, rank,
        max_attempts, traceparent, serial_key, serial_order, held
    ) VALUES (
        enqueue.tenant, enqueue.handler, coalesce(enqueue.input, '{}'), enqueue.priority,
        enqueue.idempotency_key, available,
        extract(epoch FROM available) - enqueue.priority * cfg.aging_seconds,
        coalesce(enqueue.max_attempts, cfg.default_max_attempts), enqueue.traceparent,
        enqueue.serial_key, position, waits
    )
    ON CONFLICT (tenant, idempotency_key) WHERE idempotency_key IS NOT NULL DO NOTHING
    RETURNING r.id INTO new_id;

    IF new_id IS NULL THEN
        -- A concurrent or earlier enqueue won; under READ COMMITTED this statement sees it.
        SELECT r.id INTO new_id FROM runpool.runs r
        WHERE r.tenant = enqueue.tenant AND r.idempotency_key = enqueue.idempotency_key;
        RETURN new_id;
    END IF;

    INSERT INTO runpool.run_events (run_id, kind, attempt, detail)
    VALUES (new_id, 'enqueued', 0, CASE WHEN waits
        THEN jsonb_build_object('held_by_serial_key', enqueue.serial_key) END);
    -- The doorbell carries no payload: identical notifications collapse within a transaction,
    -- so a bulk enqueue rings once.
    PERFORM pg_notify('runpool_wakeup', '');
    RETURN new_id;
END
$$;

-- Cancel a run: queued → cancelled at once (out of its serial key's line); running → flagged
-- and the worker notified.
CREATE FUNCTION runpool.cancel_run(run_id uuid, reason text DEFAULT NULL, tenant text DEFAULT NULL)
RETURNS text
LANGUAGE plpgsql SECURITY DEFINER SET search_path = runpool, pg_catalog, pg_temp
AS $$
#variable_conflict use_column
DECLARE
    run runpool.runs;
BEGIN
    IF cancel_run.reason IS NOT NULL AND length(cancel_run.reason) > 2000 THEN
        RAISE EXCEPTION 'runpool.cancel_run: reason is longer than 2000 characters'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    SELECT * INTO run FROM runpool.runs r WHERE r.id = cancel_run.run_id FOR UPDATE;
    -- Another tenant's run answers exactly like a missing one: no existence leak.
    IF NOT FOUND OR (cancel_run.tenant IS NOT NULL AND run.tenant <> cancel_run.tenant) THEN
        RETURN NULL;
    END IF;
    IF run.status = 'queued' THEN
        UPDATE runpool.runs r SET
            status = 'cancelled', finished_at = now(), held = false,
            cancel_requested_at = now(), cancel_reason = cancel_run.reason
        WHERE r.id = run.id;
        INSERT INTO runpool.run_events (run_id, kind, attempt, detail)
        VALUES (run.id, 'cancelled', run.attempt, jsonb_build_object('reason', cancel_run.reason));
        RETURN 'cancelled';
    ELSIF run.status = 'running' THEN
        IF run.cancel_requested_at IS NULL THEN
            UPDATE runpool.runs r SET cancel_requested_at = now(), cancel_reason = cancel_run.reason
            WHERE r.id = run.id;
            INSERT INTO runpool.run_events (run_id, kind, attempt, worker_id, detail)
            VALUES (run.id, 'cancel_requested', run.attempt, run.worker_id,
                    jsonb_build_object('reason', cancel_run.reason));
        END IF;
        -- Ids only: the worker re-reads the flag, so a forged notification is harmless.
        PERFORM pg_notify('runpool_cancel', run.id::text);
        RETURN 'cancelling';
    END IF;
    RETURN run.status;
END
$$;

-- Put a failed or cancelled run back in the queue with a fresh attempt budget (a run with a
-- serial key rejoins its key's line at the back).
CREATE FUNCTION runpool.retry_run(run_id uuid)
RETURNS text
LANGUAGE plpgsql SECURITY DEFINER SET search_path = runpool, pg_catalog, pg_temp
AS $$
#variable_conflict use_column
DECLARE
    run runpool.runs;
    step double precision;
    waits boolean := false;
    position bigint;
BEGIN
    SELECT * INTO run FROM runpool.runs r WHERE r.id = retry_run.run_id FOR UPDATE;
    IF NOT FOUND THEN
        RETURN NULL;
    END IF;
    IF run.status NOT IN ('failed', 'cancelled') THEN
        RETURN run.status;
    END IF;
    IF run.serial_key IS NOT NULL THEN
        PERFORM runpool._lock_serial_key(run.tenant, run.serial_key);
        position := nextval('runpool.serial_order');
        waits := EXISTS (SELECT 1 FROM runpool.runs r
                         WHERE r.tenant = run.tenant AND r.serial_key = run.serial_key
                           AND r.status IN ('queued', 'running') AND r.id <> run.id);
    END IF;
    SELECT aging_seconds INTO step FROM runpool.config;
    UPDATE runpool.runs r SET
        status = 'queued', attempt_offset = r.attempt, available_at = clock_timestamp(),
        rank = extract(epoch FROM clock_timestamp()) - r.priority * step,
        finished_at = NULL, lease_expires_at = NULL, worker_id = NULL,
        cancel_requested_at = NULL, cancel_reason = NULL,
        serial_order = coalesce(position, r.serial_order), held = waits
    WHERE r.id = run.id;
    INSERT INTO runpool.run_events (run_id, kind, attempt, detail)
    VALUES (run.id, 'retried', run.attempt, jsonb_build_object('from', run.status));
    PERFORM pg_notify('runpool_wakeup', '');
    RETURN 'queued';
END
$$;

-- Set a tenant's concurrency quota; NULL returns it to the pool default, 0 pauses the tenant.
CREATE FUNCTION runpool.set_tenant_quota(tenant text, max_running integer)
RETURNS void
LANGUAGE plpgsql SECURITY DEFINER SET search_path = runpool, pg_catalog, pg_temp
AS $$
#variable_conflict use_column
BEGIN
    IF set_tenant_quota.tenant IS NULL OR length(set_tenant_quota.tenant) NOT BETWEEN 1 AND 200 THEN
        RAISE EXCEPTION 'runpool.set_tenant_quota: tenant must be 1 to 200 characters'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF set_tenant_quota.max_running IS NOT NULL
       AND set_tenant_quota.max_running NOT BETWEEN 0 AND 1000000 THEN
        RAISE EXCEPTION 'runpool.set_tenant_quota: max_running must be between 0 and 1000000, got %',
            set_tenant_quota.max_running USING ERRCODE = 'invalid_parameter_value';
    END IF;
    INSERT INTO runpool.tenants AS t (tenant, max_running)
    VALUES (set_tenant_quota.tenant, set_tenant_quota.max_running)
    ON CONFLICT (tenant) DO UPDATE SET max_running = excluded.max_running;
    -- A raised quota frees capacity that idle workers should use now.
    PERFORM pg_notify('runpool_wakeup', '');
END
$$;

REVOKE ALL ON FUNCTION
    runpool._lock_serial_key(text, text),
    runpool._serial_key_ended(),
    runpool.enqueue(text, text, jsonb, integer, text, timestamptz, integer, text, text),
    runpool.cancel_run(uuid, text, text),
    runpool.retry_run(uuid),
    runpool.set_tenant_quota(text, integer)
FROM PUBLIC;
GRANT EXECUTE ON FUNCTION
    runpool.enqueue(text, text, jsonb, integer, text, timestamptz, integer, text, text),
    runpool.cancel_run(uuid, text, text),
    runpool.retry_run(uuid)
TO runpool_api, runpool_worker;
GRANT EXECUTE ON FUNCTION runpool.set_tenant_quota(text, integer) TO runpool_worker;
