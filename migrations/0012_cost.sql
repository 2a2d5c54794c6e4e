-- 0012_cost: cost control (issue 17) — per-attempt timeouts, run deadlines, budgets, usage
-- totals and token-bucket rate limits shared by every worker on every host.
--
-- Everything is enforced by the database's clock through the existing machinery: the claim
-- stamps an attempt's due time, the heartbeat reports runs past it (or past their deadline),
-- the reaper ends a dead worker's run past its deadline, and a sweep at the reaper's cadence
-- ends queued runs past their deadline. Runs without any of these pay nothing: NULL columns,
-- and the sweep probes an index holding only queued runs that have a deadline.

ALTER TABLE runpool.runs
    -- The longest one attempt may run (enqueue's timeout); NULL: no limit.
    ADD COLUMN attempt_timeout interval,
    -- When the current attempt is due (the claim sets now() + attempt_timeout).
    ADD COLUMN attempt_due timestamptz,
    -- The run must end by then, queued or running; NULL: no deadline.
    ADD COLUMN deadline timestamptz,
    -- {"max_tokens"?, "max_cost"?, "max_tool_calls"?, "max_turns"?} (check_budget); NULL: none.
    ADD COLUMN budget jsonb,
    -- Totals across attempts: {"input_tokens", "output_tokens", "cost", "tool_calls", "turns"};
    -- NULL until the run records usage.
    ADD COLUMN usage jsonb,
    -- The last record_usage write ('attempt:n'): a write repeated after a lost acknowledgement
    -- is recognised and not added twice.
    ADD COLUMN usage_write text;

-- Queued runs that have a deadline, for the deadline sweep (bounded, oldest deadline first).
CREATE INDEX runs_deadline ON runpool.runs (deadline)
    WHERE deadline IS NOT NULL AND status = 'queued';

-- A budget as enqueue accepts it: NULL, or an object of known limits, each a number >= 0
-- (the counts whole numbers). The one definition of a valid budget.
CREATE FUNCTION runpool.check_budget(budget jsonb) RETURNS void
LANGUAGE plpgsql IMMUTABLE SECURITY DEFINER SET search_path = pg_catalog, runpool, pg_temp
AS $$
DECLARE
    k text;
    v jsonb;
BEGIN
    IF budget IS NULL THEN
        RETURN;
    END IF;
    IF jsonb_typeof(budget) <> 'object' THEN
        RAISE EXCEPTION 'runpool.enqueue: budget must be a JSON object, got %', jsonb_typeof(budget)
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    FOR k, v IN SELECT * FROM jsonb_each(budget) LOOP
        IF k NOT IN ('max_tokens', 'max_cost', 'max_tool_calls', 'max_turns') THEN
            RAISE EXCEPTION 'runpool.enqueue: budget.% is not a budget limit (max_tokens, max_cost, max_tool_calls, max_turns)',
                left(k, 64) USING ERRCODE = 'invalid_parameter_value';
        END IF;
        IF jsonb_typeof(v) <> 'number' OR v::numeric < 0 OR v::numeric > 1e15 THEN
            RAISE EXCEPTION 'runpool.enqueue: budget.% must be a number from 0 to 1e15, got %',
                k, left(v::text, 64) USING ERRCODE = 'invalid_parameter_value';
        END IF;
        IF k <> 'max_cost' AND v::numeric <> trunc(v::numeric) THEN
            RAISE EXCEPTION 'runpool.enqueue: budget.% must be a whole number, got %', k, v
                USING ERRCODE = 'invalid_parameter_value';
        END IF;
    END LOOP;
END
$$;

-- enqueue gains timeout, deadline and budget (after serial_key). CREATE OR REPLACE cannot add
-- parameters, and an overload would make every call ambiguous: the old one is dropped. The
-- body is 0008's, with the three new checks and columns.
DROP FUNCTION runpool.enqueue(text, text, jsonb, integer, text, timestamptz, integer, text, text);

CREATE FUNCTION runpool.enqueue(
    tenant text,
    handler text,
    input jsonb DEFAULT '{}',
    priority integer DEFAULT 0,
    idempotency_key text DEFAULT NULL,
    run_at timestamptz DEFAULT NULL,
    max_attempts integer DEFAULT NULL,
    traceparent text DEFAULT NULL,
    serial_key text DEFAULT NULL,
    timeout interval DEFAULT NULL,
    deadline timestamptz DEFAULT NULL,
    budget jsonb DEFAULT NULL
) RETURNS uuid
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, runpool, pg_temp
SET plan_cache_mode = auto
AS $$
#variable_conflict use_column
DECLARE
    cfg runpool.config;
    -- clock_timestamp, not now(): runs enqueued in one transaction keep their order.
    available timestamptz;
    new_id uuid;
    waits boolean := false;
    position bigint;
    is_paused boolean;
    -- Computed apart from the INSERT (a simple expression, planned once per session): the
    -- keyed path replans its statements on every call, and the rule would be inlined anew.
    new_rank double precision;
BEGIN
    IF enqueue.tenant IS NULL OR length(enqueue.tenant) NOT BETWEEN 1 AND runpool.max_name_length() THEN
        RAISE EXCEPTION 'runpool.enqueue: tenant must be 1 to % characters',
            runpool.max_name_length()
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF enqueue.handler IS NULL OR length(enqueue.handler) NOT BETWEEN 1 AND runpool.max_name_length() THEN
        RAISE EXCEPTION 'runpool.enqueue: handler must be 1 to % characters',
            runpool.max_name_length()
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
    IF enqueue.idempotency_key IS NOT NULL AND length(enqueue.idempotency_key) NOT BETWEEN 1 AND runpool.max_name_length() THEN
        RAISE EXCEPTION 'runpool.enqueue: idempotency_key must be 1 to % characters',
            runpool.max_name_length()
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF enqueue.serial_key IS NOT NULL AND length(enqueue.serial_key) NOT BETWEEN 1 AND runpool.max_name_length() THEN
        RAISE EXCEPTION 'runpool.enqueue: serial_key must be 1 to % characters',
            runpool.max_name_length()
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF enqueue.traceparent IS NOT NULL AND length(enqueue.traceparent) > 128 THEN
        RAISE EXCEPTION 'runpool.enqueue: traceparent is longer than 128 characters'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    -- 'infinity' would make a run that never starts yet is kept forever; a date centuries
    -- away is a unit mistake (milliseconds taken for seconds), not a plan.
    IF enqueue.run_at IS NOT NULL AND (NOT isfinite(enqueue.run_at)
                                       OR enqueue.run_at > clock_timestamp() + interval '10 years') THEN
        RAISE EXCEPTION 'runpool.enqueue: run_at must be a finite time at most 10 years ahead, got %',
            enqueue.run_at USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF enqueue.timeout IS NOT NULL AND NOT (enqueue.timeout > interval '0'
                                            AND enqueue.timeout <= interval '1 year') THEN
        RAISE EXCEPTION 'runpool.enqueue: timeout must be more than 0 and at most a year, got %',
            enqueue.timeout USING ERRCODE = 'invalid_parameter_value';
    END IF;
    -- A past deadline is accepted: the run ends deadline_exceeded without starting. As for
    -- run_at, a time centuries away is a unit mistake; and one in the year 10000 (UTC), or
    -- before the year 1, is stored but no Python client can read it back: every psycopg read
    -- of a list of runs holding it would fail, other tenants' runs and all.
    IF enqueue.deadline IS NOT NULL AND (NOT isfinite(enqueue.deadline)
                                         OR enqueue.deadline < '1970-01-01 00:00:00+00'
                                         OR enqueue.deadline > clock_timestamp() + interval '10 years') THEN
        RAISE EXCEPTION 'runpool.enqueue: deadline must be a finite time from 1970 to 10 years ahead, got %',
            enqueue.deadline USING ERRCODE = 'invalid_parameter_value';
    END IF;
    -- Only when given: a nested SECURITY DEFINER call costs every enqueue (see 0008).
    IF enqueue.budget IS NOT NULL THEN
        PERFORM runpool.check_budget(enqueue.budget);
    END IF;
    SELECT * INTO cfg FROM runpool.config;
    IF octet_length(coalesce(enqueue.input, '{}')::text) > cfg.max_input_bytes THEN
        RAISE EXCEPTION 'runpool.enqueue: input is % bytes, over the limit of % bytes',
            octet_length(enqueue.input::text), cfg.max_input_bytes
            USING ERRCODE = 'program_limit_exceeded';
    END IF;

    IF enqueue.serial_key IS NOT NULL THEN
        -- Custom plans for the rest of this call (the SET above scopes it to the call): the
        -- generic plan PL/pgSQL switches to after five calls estimates the key check below
        -- from every tenant's keyed runs and reads the whole table once they are many. The
        -- unkeyed path keeps its cached plans (replanning it costs ~25 % of an enqueue).
        PERFORM set_config('plan_cache_mode', 'force_custom_plan', true);
        -- Under the key's lock, and in statements of their own: the check below sees every
        -- run of the key committed before the lock was granted (read committed only).
        PERFORM pg_advisory_xact_lock(runpool.serial_key_lock(enqueue.tenant, enqueue.serial_key));
        position := nextval('runpool.serial_order');
        waits := current_setting('transaction_isolation') <> 'read committed'
                 OR EXISTS (SELECT 1 FROM runpool.runs r
                            WHERE r.tenant = enqueue.tenant AND r.serial_key = enqueue.serial_key
                              AND r.status IN ('queued', 'running'));
    END IF;

    INSERT INTO runpool.tenants (tenant) VALUES (enqueue.tenant) ON CONFLICT DO NOTHING;
    is_paused := EXISTS (SELECT 1 FROM runpool.tenants t
                         WHERE t.tenant = enqueue.tenant AND t.max_running = 0);
    available := greatest(coalesce(enqueue.run_at, clock_timestamp()), clock_timestamp());
    new_rank := runpool.rank(available, enqueue.priority, cfg.aging_seconds);
    INSERT INTO runpool.runs AS r (
        tenant, handler, input, priority, idempotency_key, available_at, rank,
        max_attempts, traceparent, serial_key, serial_order, held, deferred, paused,
        attempt_timeout, deadline, budget
    ) VALUES (
        enqueue.tenant, enqueue.handler, coalesce(enqueue.input, '{}'), enqueue.priority,
        enqueue.idempotency_key, available,
        new_rank,
        coalesce(enqueue.max_attempts, cfg.default_max_attempts), enqueue.traceparent,
        enqueue.serial_key, position, waits,
        coalesce(enqueue.run_at > clock_timestamp(), false), is_paused,
        enqueue.timeout, enqueue.deadline, enqueue.budget
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
    PERFORM pg_notify('runpool_wakeup', '');
    RETURN new_id;
END
$$;


-- Token buckets shared by every worker (GCRA, "virtual scheduling"): `tat` is the theoretical
-- time at which every unit admitted so far has been paid for at per_minute; a request may start
-- once tat - burst units' worth of time has come. One row per key; one UPDATE per acquire.
CREATE TABLE runpool.rate_limits (
    key        text PRIMARY KEY
        CONSTRAINT rate_limit_key_length CHECK (length(key) BETWEEN 1 AND 200),
    per_minute double precision NOT NULL
        CONSTRAINT rate_limit_per_minute CHECK (per_minute > 0 AND per_minute <= 1e12),
    burst      double precision NOT NULL DEFAULT 0
        CONSTRAINT rate_limit_burst CHECK (burst >= 0 AND burst <= 1e12),
    tat        timestamptz NOT NULL DEFAULT now(),
    -- The units of the key's last reservation, not given back yet: release_rate returns at
    -- most these (tat is readable, so a caller could otherwise erase the whole line).
    last_units double precision NOT NULL DEFAULT 0,
    updated_at timestamptz NOT NULL DEFAULT now()
);

-- Create or change a rate limit (per_minute units a minute, burst extra units at once after
-- idling; NULL burst: 0, strictly paced). Changing it keeps what was admitted already.
CREATE FUNCTION runpool.set_rate_limit(key text, per_minute double precision,
                                       burst double precision DEFAULT NULL) RETURNS void
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, runpool, pg_temp
AS $$
#variable_conflict use_column
BEGIN
    IF set_rate_limit.key IS NULL OR length(set_rate_limit.key) NOT BETWEEN 1 AND runpool.max_name_length() THEN
        RAISE EXCEPTION 'runpool.set_rate_limit: key must be 1 to % characters',
            runpool.max_name_length() USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF set_rate_limit.per_minute IS NULL OR NOT (set_rate_limit.per_minute > 0
                                                 AND set_rate_limit.per_minute <= 1e12) THEN
        RAISE EXCEPTION 'runpool.set_rate_limit: per_minute must be more than 0 (at most 1e12), got %',
            coalesce(set_rate_limit.per_minute::text, 'NULL') USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF set_rate_limit.burst IS NOT NULL AND NOT (set_rate_limit.burst >= 0
                                                 AND set_rate_limit.burst <= 1e12) THEN
        RAISE EXCEPTION 'runpool.set_rate_limit: burst must be 0 or more (at most 1e12), got %',
            set_rate_limit.burst USING ERRCODE = 'invalid_parameter_value';
    END IF;
    INSERT INTO runpool.rate_limits AS l (key, per_minute, burst)
    VALUES (set_rate_limit.key, set_rate_limit.per_minute, coalesce(set_rate_limit.burst, 0))
    ON CONFLICT (key) DO UPDATE
        SET per_minute = excluded.per_minute, burst = excluded.burst, updated_at = now();
END
$$;

-- Admit `units` of a rate-limited key: reserves them at once (FIFO: each reservation starts
-- no earlier than the one before) and returns the seconds the caller must wait before using
-- them (0: admitted now), when that is by the database's clock, and the key's tat after this
-- reservation (release_rate's token). No lock is held while the caller waits. Units above
-- what the key admits in a minute plus its burst could never be admitted without starving the
-- key for everyone else: refused.
CREATE FUNCTION runpool.acquire_rate(key text, units double precision DEFAULT 1,
                                     OUT wait double precision, OUT starts_at timestamptz,
                                     OUT reserved_until timestamptz)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, runpool, pg_temp
AS $$
#variable_conflict use_column
DECLARE
    at timestamptz := clock_timestamp();
    limit_per_minute double precision;
    limit_burst double precision;
BEGIN
    IF acquire_rate.units IS NULL OR NOT (acquire_rate.units > 0) THEN
        RAISE EXCEPTION 'runpool.acquire: units must be more than 0, got %',
            coalesce(acquire_rate.units::text, 'NULL') USING ERRCODE = 'invalid_parameter_value';
    END IF;
    UPDATE runpool.rate_limits l
    SET tat = greatest(l.tat, at) + acquire_rate.units * (60.0 / l.per_minute) * interval '1 second',
        last_units = acquire_rate.units
    WHERE l.key = acquire_rate.key
      AND acquire_rate.units <= l.per_minute + l.burst
    -- The reservation starts at max(now, old tat - burst's time): the old tat is the new one
    -- less these units' time.
    RETURNING greatest(0, extract(epoch FROM
                  l.tat - at - (acquire_rate.units + l.burst) * (60.0 / l.per_minute) * interval '1 second')),
              l.tat
    INTO wait, reserved_until;
    IF FOUND THEN
        starts_at := at + wait * interval '1 second';
        RETURN;
    END IF;
    SELECT l.per_minute, l.burst INTO limit_per_minute, limit_burst
    FROM runpool.rate_limits l WHERE l.key = acquire_rate.key;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'runpool.acquire: no rate limit named "%" (set it with runpool.set_rate_limit)',
            left(acquire_rate.key, 200) USING ERRCODE = 'invalid_parameter_value';
    END IF;
    RAISE EXCEPTION 'runpool.acquire: units % are more than rate limit "%" admits (per_minute % + burst %)',
        acquire_rate.units, acquire_rate.key, limit_per_minute, limit_burst
        USING ERRCODE = 'invalid_parameter_value';
END
$$;

-- Give back a reservation that will not be used (its run was cancelled while it waited), if
-- it is still the key's last one (tat = its reserved_until): then no later reservation was
-- planned after it, and the key is exactly as if it had never been made. Otherwise nothing
-- changes (returning units from the middle of the line could let the key exceed its limit),
-- nor for more units than that reservation took, nor twice (NULL: nothing given back).
CREATE FUNCTION runpool.release_rate(key text, units double precision,
                                     reserved_until timestamptz) RETURNS boolean
LANGUAGE sql SECURITY DEFINER SET search_path = pg_catalog, runpool, pg_temp
AS $$
UPDATE runpool.rate_limits l
SET tat = l.tat - release_rate.units * (60.0 / l.per_minute) * interval '1 second',
    last_units = 0
WHERE l.key = release_rate.key AND l.tat = release_rate.reserved_until
  AND release_rate.units > 0 AND release_rate.units <= l.last_units
RETURNING true
$$;

REVOKE ALL ON FUNCTION
    runpool.check_budget(jsonb),
    runpool.enqueue(text, text, jsonb, integer, text, timestamptz, integer, text, text,
                    interval, timestamptz, jsonb),
    runpool.set_rate_limit(text, double precision, double precision),
    runpool.acquire_rate(text, double precision),
    runpool.release_rate(text, double precision, timestamptz)
FROM PUBLIC;
GRANT EXECUTE ON FUNCTION
    runpool.enqueue(text, text, jsonb, integer, text, timestamptz, integer, text, text,
                    interval, timestamptz, jsonb),
    runpool.acquire_rate(text, double precision),
    runpool.release_rate(text, double precision, timestamptz)
TO runpool_api, runpool_worker;
-- Setting limits is the operator's (as set_tenant_quota is).
GRANT EXECUTE ON FUNCTION runpool.set_rate_limit(text, double precision, double precision)
TO runpool_worker;
GRANT SELECT ON runpool.rate_limits TO runpool_api, runpool_worker;
