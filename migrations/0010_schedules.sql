-- 0010_schedules: recurring runs (issue 16). A schedule is one row; its whole firing state is
-- next_fire_at (the next plan time, NULL until a pool has computed it from the cron) and
-- last_fire_at (the latest plan time fired). Pools fire a due plan by enqueueing its run with
-- the idempotency key schedule:<name>:<plan time> and advancing next_fire_at in the same
-- transaction, with the row locked (SKIP LOCKED): exactly one run per plan time however many
-- pools race for it. Cron is evaluated by the pools (Python, cronsim): SQL checks the shape of
-- the expression; a pool that finds a bad one sets `error` and leaves the schedule alone.

CREATE TABLE runpool.schedules (
    name         text PRIMARY KEY
        CONSTRAINT schedule_name_length CHECK (length(name) BETWEEN 1 AND 100),
    cron         text NOT NULL
        CONSTRAINT cron_length CHECK (length(cron) BETWEEN 1 AND 200),
    timezone     text NOT NULL DEFAULT 'UTC'
        CONSTRAINT timezone_length CHECK (length(timezone) BETWEEN 1 AND 100),
    -- 200: runpool.max_name_length(), spelled out as 0008 explains (tests/test_rules.py).
    tenant       text NOT NULL
        CONSTRAINT tenant_length CHECK (length(tenant) BETWEEN 1 AND 200),
    handler      text NOT NULL
        CONSTRAINT handler_length CHECK (length(handler) BETWEEN 1 AND 200),
    -- An object: each fired run gets it with "scheduled_at" (the plan time) added.
    input        jsonb NOT NULL DEFAULT '{}'
        CONSTRAINT input_object CHECK (jsonb_typeof(input) = 'object'),
    catch_up     text NOT NULL DEFAULT 'latest'
        CONSTRAINT catch_up_known CHECK (catch_up IN ('skip', 'latest', 'all')),
    priority     integer NOT NULL DEFAULT 0
        CONSTRAINT priority_range CHECK (priority BETWEEN -100 AND 100),
    serial_key   text
        CONSTRAINT serial_key_length CHECK (length(serial_key) BETWEEN 1 AND 200),
    enabled      boolean NOT NULL DEFAULT true,
    -- Within what every pool's clock arithmetic handles (no infinity, no year 10000).
    next_fire_at timestamptz
        CONSTRAINT next_fire_at_range CHECK (next_fire_at BETWEEN '1970-01-01' AND '9999-01-01'),
    last_fire_at timestamptz
        CONSTRAINT last_fire_at_range CHECK (last_fire_at BETWEEN '1970-01-01' AND '9999-01-01'),
    -- Why no pool can fire it (a cron or time zone the pools cannot evaluate, an input the
    -- enqueue refuses): it stays out of firing until set_schedule changes it.
    error        text,
    created_at   timestamptz NOT NULL DEFAULT now(),
    updated_at   timestamptz NOT NULL DEFAULT now()
);
-- The firing order, and the earliest plan a pool sleeps until; NULLs (plans not computed yet)
-- first, so a pool finds them with one probe.
CREATE INDEX schedules_next ON runpool.schedules (next_fire_at NULLS FIRST)
    WHERE enabled AND error IS NULL;

-- Any change to when a schedule fires (a new or deleted schedule, a new next plan time, enabled
-- or erred) rings the pools' schedule doorbell, so each re-reads the earliest plan time; a
-- direct UPDATE by an operator counts too. Ids-free and identical, so a transaction changing
-- many rows rings once.
CREATE FUNCTION runpool._schedules_changed() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, runpool, pg_temp
AS $$
BEGIN
    PERFORM pg_notify('runpool_schedules', '');
    RETURN NULL;
END
$$;

CREATE TRIGGER schedules_added_or_removed
AFTER INSERT OR DELETE ON runpool.schedules
FOR EACH ROW EXECUTE FUNCTION runpool._schedules_changed();

CREATE TRIGGER schedules_timing_changed
AFTER UPDATE ON runpool.schedules
FOR EACH ROW
WHEN (OLD.next_fire_at IS DISTINCT FROM NEW.next_fire_at
      OR OLD.enabled IS DISTINCT FROM NEW.enabled
      OR OLD.error IS DISTINCT FROM NEW.error)
EXECUTE FUNCTION runpool._schedules_changed();

-- Create or update a schedule by name. Unchanged values write nothing (every pool re-applies
-- its app's schedules when it starts); a new cron or time zone, re-enabling, or clearing an
-- error makes the pools compute the next plan time afresh (from now: plans of the old
-- definition are not caught up). enabled => NULL keeps the current value (true for a new
-- schedule): pools upsert their code's schedules that way, so an operator's pause survives a
-- restart. A schedule's tenant cannot be changed (delete it first): a tenant-scoped service
-- calling this cannot take over another tenant's schedule.
CREATE FUNCTION runpool.set_schedule(
    name text,
    cron text,
    tenant text,
    handler text,
    input jsonb DEFAULT '{}',
    timezone text DEFAULT 'UTC',
    catch_up text DEFAULT 'latest',
    priority integer DEFAULT 0,
    enabled boolean DEFAULT true,
    serial_key text DEFAULT NULL
) RETURNS void
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, runpool, pg_temp
SET plan_cache_mode = force_custom_plan
AS $$
#variable_conflict use_column
DECLARE
    current runpool.schedules;
    limit_bytes integer;
BEGIN
    IF set_schedule.name IS NULL OR length(set_schedule.name) NOT BETWEEN 1 AND 100
       OR set_schedule.name ~ '[[:cntrl:]]' THEN
        RAISE EXCEPTION 'runpool.set_schedule: name must be 1 to 100 characters, no control'
                        ' characters' USING ERRCODE = 'invalid_parameter_value';
    END IF;
    -- The shape only (5 fields of cron characters, or an @alias); the pools parse the rest
    -- and set `error` for what they cannot evaluate (a minute of 61, say).
    IF set_schedule.cron IS NULL OR length(set_schedule.cron) > 200 OR NOT (
           set_schedule.cron ~* '^\s*@(yearly|annually|monthly|weekly|daily|midnight|hourly)\s*$'
           OR set_schedule.cron ~ '^\s*[0-9A-Za-z*/,?#-]+(\s+[0-9A-Za-z*/,?#-]+){4}\s*$') THEN
        RAISE EXCEPTION 'runpool.set_schedule: cron must be 5 fields (minute hour day-of-month'
                        ' month day-of-week) or one of @yearly @annually @monthly @weekly'
                        ' @daily @midnight @hourly, got %', quote_nullable(set_schedule.cron)
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF set_schedule.tenant IS NULL
       OR length(set_schedule.tenant) NOT BETWEEN 1 AND runpool.max_name_length() THEN
        RAISE EXCEPTION 'runpool.set_schedule: tenant must be 1 to % characters',
            runpool.max_name_length() USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF set_schedule.handler IS NULL
       OR length(set_schedule.handler) NOT BETWEEN 1 AND runpool.max_name_length() THEN
        RAISE EXCEPTION 'runpool.set_schedule: handler must be 1 to % characters',
            runpool.max_name_length() USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF set_schedule.input IS NOT NULL AND jsonb_typeof(set_schedule.input) <> 'object' THEN
        RAISE EXCEPTION 'runpool.set_schedule: input must be a JSON object (each run gets it'
                        ' with "scheduled_at" added), got a JSON %',
            jsonb_typeof(set_schedule.input) USING ERRCODE = 'invalid_parameter_value';
    END IF;
    SELECT c.max_input_bytes INTO limit_bytes FROM runpool.config c;
    IF octet_length(coalesce(set_schedule.input, '{}')::text) > limit_bytes THEN
        RAISE EXCEPTION 'runpool.set_schedule: input is % bytes, over the limit of % bytes',
            octet_length(set_schedule.input::text), limit_bytes
            USING ERRCODE = 'program_limit_exceeded';
    END IF;
    IF set_schedule.catch_up IS NULL OR set_schedule.catch_up NOT IN ('skip', 'latest', 'all') THEN
        RAISE EXCEPTION 'runpool.set_schedule: catch_up must be skip, latest or all, got %',
            quote_nullable(set_schedule.catch_up) USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF set_schedule.priority IS NULL OR set_schedule.priority NOT BETWEEN -100 AND 100 THEN
        RAISE EXCEPTION 'runpool.set_schedule: priority must be between -100 and 100, got %',
            coalesce(set_schedule.priority::text, 'NULL')
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF set_schedule.serial_key IS NOT NULL
       AND length(set_schedule.serial_key) NOT BETWEEN 1 AND runpool.max_name_length() THEN
        RAISE EXCEPTION 'runpool.set_schedule: serial_key must be 1 to % characters',
            runpool.max_name_length() USING ERRCODE = 'invalid_parameter_value';
    END IF;
    SELECT * INTO current FROM runpool.schedules s WHERE s.name = set_schedule.name FOR UPDATE;
    -- The zone list is read from disk (~20 ms): only for a new or changed time zone.
    IF set_schedule.timezone IS NULL OR length(set_schedule.timezone) NOT BETWEEN 1 AND 100
       OR (current.timezone IS DISTINCT FROM set_schedule.timezone
           AND NOT EXISTS (SELECT 1 FROM pg_timezone_names z
                           WHERE z.name = set_schedule.timezone)) THEN
        RAISE EXCEPTION 'runpool.set_schedule: timezone must be an IANA time zone name such as'
                        ' Europe/Berlin (see pg_timezone_names), got %',
            quote_nullable(set_schedule.timezone) USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF current.name IS NULL THEN
        INSERT INTO runpool.schedules (name, cron, timezone, tenant, handler, input, catch_up,
                                       priority, serial_key, enabled)
        VALUES (set_schedule.name, set_schedule.cron, set_schedule.timezone, set_schedule.tenant,
                set_schedule.handler, coalesce(set_schedule.input, '{}'), set_schedule.catch_up,
                set_schedule.priority, set_schedule.serial_key,
                coalesce(set_schedule.enabled, true))
        ON CONFLICT DO NOTHING;
        IF FOUND THEN
            RETURN;
        END IF;
        -- Another session created it meanwhile (pools starting together): update that one.
        SELECT * INTO current FROM runpool.schedules s
        WHERE s.name = set_schedule.name FOR UPDATE;
    END IF;
    IF current.tenant <> set_schedule.tenant THEN
        RAISE EXCEPTION 'runpool.set_schedule: schedule % belongs to another tenant;'
                        ' delete_schedule it first to move it', quote_literal(set_schedule.name)
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    UPDATE runpool.schedules s SET
        cron = set_schedule.cron, timezone = set_schedule.timezone,
        handler = set_schedule.handler, input = coalesce(set_schedule.input, '{}'),
        catch_up = set_schedule.catch_up, priority = set_schedule.priority,
        serial_key = set_schedule.serial_key,
        enabled = coalesce(set_schedule.enabled, s.enabled),
        next_fire_at = CASE
            WHEN s.cron <> set_schedule.cron OR s.timezone <> set_schedule.timezone
              OR s.error IS NOT NULL
              OR (NOT s.enabled AND coalesce(set_schedule.enabled, s.enabled))
            THEN NULL ELSE s.next_fire_at END,
        error = NULL,
        updated_at = now()
    WHERE s.name = set_schedule.name
      AND (s.cron, s.timezone, s.handler, s.input, s.catch_up, s.priority, s.serial_key,
           s.enabled, s.error)
          IS DISTINCT FROM
          (set_schedule.cron, set_schedule.timezone, set_schedule.handler,
           coalesce(set_schedule.input, '{}'), set_schedule.catch_up, set_schedule.priority,
           set_schedule.serial_key, coalesce(set_schedule.enabled, s.enabled), NULL::text);
END
$$;

-- Delete a schedule; true if it existed. Runs it already fired are left as they are.
CREATE FUNCTION runpool.delete_schedule(name text)
RETURNS boolean
LANGUAGE sql SECURITY DEFINER SET search_path = pg_catalog, runpool, pg_temp
AS $$
    WITH gone AS (DELETE FROM runpool.schedules s WHERE s.name = delete_schedule.name
                  RETURNING 1)
    SELECT EXISTS (SELECT 1 FROM gone)
$$;

-- The tenant-scoped delete: another tenant's schedule answers false, exactly like a missing one.
CREATE FUNCTION runpool.delete_schedule(name text, tenant text)
RETURNS boolean
LANGUAGE sql SECURITY DEFINER SET search_path = pg_catalog, runpool, pg_temp
AS $$
    WITH gone AS (DELETE FROM runpool.schedules s
                  WHERE s.name = delete_schedule.name
                    AND (delete_schedule.tenant IS NULL OR s.tenant = delete_schedule.tenant)
                  RETURNING 1)
    SELECT EXISTS (SELECT 1 FROM gone)
$$;

REVOKE ALL ON FUNCTION
    runpool._schedules_changed(),
    runpool.set_schedule(text, text, text, text, jsonb, text, text, integer, boolean, text),
    runpool.delete_schedule(text),
    runpool.delete_schedule(text, text)
FROM PUBLIC;
GRANT EXECUTE ON FUNCTION
    runpool.set_schedule(text, text, text, text, jsonb, text, text, integer, boolean, text),
    runpool.delete_schedule(text),
    runpool.delete_schedule(text, text)
TO runpool_api, runpool_worker;

-- Readers see schedules; pools advance them (set_schedule and delete_schedule are the way in
-- and out: no INSERT or DELETE for the worker role).
GRANT SELECT ON runpool.schedules TO runpool_api;
GRANT SELECT, UPDATE ON runpool.schedules TO runpool_worker;
