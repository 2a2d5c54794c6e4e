-- 0022_enqueue_fixes: what an attack on 0021 found (tests/test_attack3_enqueue.py).
--   * enqueue_many took deadlines and timeouts enqueue refuses (a deadline in the year 9999,
--     in 1960 or 20 years ahead; a timeout of 365 days, over interval '1 year'): the two
--     checked them with rules written twice. One rule each now (timeout_problem,
--     deadline_problem), in enqueue's words, called by both.
--   * A run enqueued while an operator's unpause (set_tenant_quota(t, NULL)) was uncommitted
--     stayed paused (out of the claim's index until a heal sweep): 0021 read the tenant's row
--     (enqueue) or skipped the upsert for a known tenant (enqueue_many), so neither waited for
--     the operator's update of that row. A tenant that reads as paused is upserted again
--     (ON CONFLICT DO NOTHING waits for a transaction updating the row; its quota is then read
--     anew). One that reads as not paused is not: an enqueue never waits for an operator
--     holding an unpaused tenant's row (tests/test_attack_one_trip.py). What that leaves: a
--     run enqueued while a pause (quota 0) is uncommitted is written unpaused, which costs a
--     claim a look at it but never starts it (the claim checks the quota, tenant_capacity).
--   * Two enqueue_many calls with the same idempotency keys in opposite orders deadlocked:
--     keyed runs are inserted in key order (ids still drawn in input order).

-- What is wrong with a run's timeout, in enqueue's words; NULL when nothing (or none given).
-- `shown` is the value as the caller gave it, when that is not the interval itself
-- (enqueue_many's seconds). Inlined (one SQL expression).
CREATE FUNCTION runpool.timeout_problem(timeout interval, shown text DEFAULT NULL) RETURNS text
LANGUAGE sql STABLE PARALLEL SAFE
RETURN CASE WHEN timeout IS NOT NULL AND NOT (timeout > interval '0' AND timeout <= interval '1 year')
            THEN 'timeout must be more than 0 and at most a year, got ' || coalesce(shown, timeout::text)
       END;

-- A number of seconds as an interval, for timeout_problem: clamped to [-1 s, 10^10 s] first
-- (make_interval overflows from ~9.2 * 10^12 s, float8 from 10^308), which keeps the rule's
-- verdict (its bounds, 0 and a year, lie inside); under a microsecond is an interval of 0.
CREATE FUNCTION runpool.seconds_interval(secs numeric) RETURNS interval
LANGUAGE sql IMMUTABLE PARALLEL SAFE
-- (greatest and least skip a NULL: none given stays NULL by the CASE).
RETURN CASE WHEN secs IS NOT NULL
            THEN make_interval(secs => least(greatest(secs, -1), 10000000000)::float8) END;

-- What is wrong with a run's deadline, in enqueue's words; NULL when nothing (or none given).
-- A past deadline is accepted: the run ends deadline_exceeded without starting. As for run_at,
-- a time centuries away is a unit mistake; and one in the year 10000 (UTC), or before the year
-- 1, is stored but no Python client can read it back: every psycopg read of a list of runs
-- holding it would fail, other tenants' runs and all. VOLATILE: clock_timestamp().
CREATE FUNCTION runpool.deadline_problem(deadline timestamptz) RETURNS text
LANGUAGE sql VOLATILE PARALLEL SAFE
RETURN CASE WHEN deadline IS NOT NULL AND (NOT isfinite(deadline)
                                           OR deadline < '1970-01-01 00:00:00+00'
                                           OR deadline > clock_timestamp() + interval '10 years')
            THEN 'deadline must be a finite time from 1970 to 10 years ahead, got ' || deadline
       END;

-- enqueue_many (0021's): timeout and deadline through enqueue's rules, its paused tenants
-- upserted (waiting for an operator's uncommitted quota change), keyed runs in key order.
CREATE OR REPLACE FUNCTION runpool.enqueue_many(runs jsonb) RETURNS SETOF uuid
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, runpool, pg_temp
AS $$
#variable_conflict use_column
DECLARE
    cfg runpool.config;
    bad_i bigint;
    bad_problem text;
    keys bigint;
    keyed boolean;
    budgets boolean;
    run_tenants text[];
    ids uuid[];
    idem_keys text[];
    inserted bigint;
    started timestamptz := clock_timestamp();
    -- A run's id carries its arrival time (new_run_id): microseconds, ending at started.
    started_us bigint := runpool.epoch_us(started);
    salt bigint := runpool.new_run_salt();
    total bigint;
    read_committed boolean := current_setting('transaction_isolation') = 'read committed';
    known constant text[] := ARRAY['tenant', 'handler', 'input', 'priority', 'idempotency_key',
                                   'run_at', 'max_attempts', 'traceparent', 'serial_key',
                                   'timeout', 'deadline', 'budget'];
    optional constant text[] := ARRAY['priority', 'idempotency_key', 'run_at', 'max_attempts',
                                      'traceparent', 'serial_key', 'timeout', 'deadline',
                                      'budget'];
    max_input integer;
BEGIN
    IF enqueue_many.runs IS NULL OR jsonb_typeof(enqueue_many.runs) <> 'array' THEN
        RAISE EXCEPTION 'runpool.enqueue_many: runs must be a JSON array of objects'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    total := jsonb_array_length(enqueue_many.runs);
    IF total = 0 THEN
        RETURN;
    END IF;
    SELECT * INTO cfg FROM runpool.config;
    max_input := cfg.max_input_bytes;
    -- In one pass over the batch: the first bad element, in enqueue's words (its checks,
    -- 0012), and what the rest of the call needs to know of the batch.
    SELECT min(p.i) FILTER (WHERE p.problem IS NOT NULL),
           (array_agg(p.problem ORDER BY p.i) FILTER (WHERE p.problem IS NOT NULL))[1],
           count(DISTINCT ARRAY[p.tenant, p.serial_key]) FILTER (WHERE p.serial_key IS NOT NULL),
           bool_or(p.idempotency_key IS NOT NULL), bool_or(p.budget),
           array_agg(DISTINCT p.tenant)
    INTO bad_i, bad_problem, keys, keyed, budgets, run_tenants
    FROM (
        SELECT e.n - 1 AS i, e.v ->> 'tenant' AS tenant, e.v ->> 'serial_key' AS serial_key,
               e.v ->> 'idempotency_key' AS idempotency_key,
               jsonb_typeof(e.v -> 'budget') = 'object' AS budget, CASE
               WHEN jsonb_typeof(e.v) IS DISTINCT FROM 'object' THEN 'must be a JSON object'
               WHEN e.v - known <> '{}'::jsonb
                   THEN 'unknown key ' || (SELECT min(quote_literal(k)) FROM jsonb_object_keys(e.v - known) k)
               WHEN jsonb_typeof(e.v -> 'tenant') IS DISTINCT FROM 'string'
                    OR length(e.v ->> 'tenant') NOT BETWEEN 1 AND runpool.max_name_length()
                   THEN 'tenant must be 1 to ' || runpool.max_name_length() || ' characters'
               WHEN jsonb_typeof(e.v -> 'handler') IS DISTINCT FROM 'string'
                    OR length(e.v ->> 'handler') NOT BETWEEN 1 AND runpool.max_name_length()
                   THEN 'handler must be 1 to ' || runpool.max_name_length() || ' characters'
               -- Most runs give none of the optional keys: their checks are skipped whole
               -- (the same checks in the same order otherwise).
               WHEN NOT e.v ?| optional THEN CASE
                   WHEN octet_length(coalesce(e.v -> 'input', '{}')::text) > max_input
                       THEN 'input is ' || octet_length((e.v -> 'input')::text) || ' bytes, over the limit of '
                            || max_input || ' bytes'
                   END
               ELSE CASE
                   WHEN coalesce(jsonb_typeof(e.v -> 'priority'), 'null') NOT IN ('null', 'number')
                        OR (e.v ->> 'priority')::numeric NOT BETWEEN -100 AND 100
                        OR (e.v ->> 'priority')::numeric <> trunc((e.v ->> 'priority')::numeric)
                       THEN 'priority must be an integer between -100 and 100, got ' || (e.v -> 'priority')::text
                   WHEN coalesce(jsonb_typeof(e.v -> 'max_attempts'), 'null') NOT IN ('null', 'number')
                        OR (e.v ->> 'max_attempts')::numeric NOT BETWEEN 1 AND 1000
                        OR (e.v ->> 'max_attempts')::numeric <> trunc((e.v ->> 'max_attempts')::numeric)
                       THEN 'max_attempts must be an integer between 1 and 1000, got '
                            || (e.v -> 'max_attempts')::text
                   WHEN coalesce(jsonb_typeof(e.v -> 'idempotency_key'), 'null') NOT IN ('null', 'string')
                        OR length(e.v ->> 'idempotency_key') NOT BETWEEN 1 AND runpool.max_name_length()
                       THEN 'idempotency_key must be 1 to ' || runpool.max_name_length() || ' characters'
                   WHEN coalesce(jsonb_typeof(e.v -> 'serial_key'), 'null') NOT IN ('null', 'string')
                        OR length(e.v ->> 'serial_key') NOT BETWEEN 1 AND runpool.max_name_length()
                       THEN 'serial_key must be 1 to ' || runpool.max_name_length() || ' characters'
                   WHEN coalesce(jsonb_typeof(e.v -> 'traceparent'), 'null') NOT IN ('null', 'string')
                        OR length(e.v ->> 'traceparent') > 128
                       THEN 'traceparent must be text of at most 128 characters'
                   WHEN coalesce(jsonb_typeof(e.v -> 'run_at'), 'null') NOT IN ('null', 'string')
                        OR (e.v ->> 'run_at' IS NOT NULL AND NOT coalesce(
                               isfinite(runpool._time_or_null(e.v ->> 'run_at'))
                               AND runpool._time_or_null(e.v ->> 'run_at') <= clock_timestamp() + interval '10 years',
                               false))
                       THEN 'run_at must be a finite time at most 10 years ahead, got ' || (e.v -> 'run_at')::text
                   -- Seconds, as the Python API sends a timeout.
                   WHEN coalesce(jsonb_typeof(e.v -> 'timeout'), 'null') NOT IN ('null', 'number')
                       THEN 'timeout must be a number of seconds, got ' || (e.v -> 'timeout')::text
                   WHEN coalesce(jsonb_typeof(e.v -> 'deadline'), 'null') NOT IN ('null', 'string')
                        OR (e.v ->> 'deadline' IS NOT NULL
                            AND runpool._time_or_null(e.v ->> 'deadline') IS NULL)
                       THEN 'deadline must be a time (ISO 8601 text), got ' || (e.v -> 'deadline')::text
                   -- enqueue's rules themselves (timeout_problem, deadline_problem; coalesce stops
                   -- at the first problem, so the checks keep their order).
                   ELSE coalesce(
                       runpool.timeout_problem(runpool.seconds_interval((e.v ->> 'timeout')::numeric),
                                               (e.v ->> 'timeout') || ' seconds'),
                       runpool.deadline_problem(runpool._time_or_null(e.v ->> 'deadline')),
                       CASE WHEN coalesce(jsonb_typeof(e.v -> 'budget'), 'null') NOT IN ('null', 'object')
                           THEN 'budget must be a JSON object' END,
                       CASE WHEN octet_length(coalesce(e.v -> 'input', '{}')::text) > max_input
                           THEN 'input is ' || octet_length((e.v -> 'input')::text) || ' bytes, over the limit of '
                                || max_input || ' bytes' END)
                   END
           END AS problem
        FROM jsonb_array_elements(enqueue_many.runs) WITH ORDINALITY AS e(v, n)
    ) p;
    IF bad_i IS NOT NULL THEN
        RAISE EXCEPTION 'runpool.enqueue_many: runs[%]: %', bad_i, bad_problem
            USING ERRCODE = CASE WHEN bad_problem LIKE 'input is %' THEN 'program_limit_exceeded'
                                 ELSE 'invalid_parameter_value' END;
    END IF;
    IF budgets THEN
        -- Budgets through enqueue's own check (its message names the budget's field).
        PERFORM runpool.check_budget(e.v -> 'budget')
        FROM jsonb_array_elements(enqueue_many.runs) WITH ORDINALITY AS e(v, n)
        WHERE jsonb_typeof(e.v -> 'budget') = 'object'
        ORDER BY e.n;
    END IF;

    IF keys > 1000 THEN
        RAISE EXCEPTION 'runpool.enqueue_many: % distinct serial keys in one call, over the limit of 1000 (each holds a lock until commit): split the batch and commit each part',
            keys USING ERRCODE = 'program_limit_exceeded';
    END IF;
    IF keys > 0 THEN
        -- As enqueue does, before its check of the key's runs: the check below sees every run
        -- of each key committed before its lock was granted.
        PERFORM pg_advisory_xact_lock(runpool.serial_key_lock(k.tenant, k.serial_key))
        FROM (SELECT DISTINCT e.v ->> 'tenant' AS tenant, e.v ->> 'serial_key' AS serial_key
              FROM jsonb_array_elements(enqueue_many.runs) AS e(v)
              WHERE e.v ->> 'serial_key' IS NOT NULL
              ORDER BY 1, 2) k;
    END IF;

    -- New tenants, and known ones that read as paused, are upserted: the conflict check waits
    -- for a transaction updating the tenant's row (an operator's set_tenant_quota), so the
    -- runs' paused flag below (a later statement) reads the quota it committed, and an
    -- unpause cannot miss them. An unpaused tenant is not: no wait for an operator holding it
    -- (a run written unpaused is never started against its quota: the claim checks it).
    INSERT INTO runpool.tenants (tenant)
    SELECT t.tenant FROM unnest(run_tenants) AS t(tenant)
    WHERE NOT EXISTS (SELECT 1 FROM runpool.tenants o
                      WHERE o.tenant = t.tenant AND o.max_running IS DISTINCT FROM 0)
    ORDER BY 1
    ON CONFLICT DO NOTHING;

    IF keys = 0 AND NOT keyed THEN
        -- No idempotency key, no serial key: every run is inserted, none waits. The ids grow
        -- with n (new_run_id), so their order is input order.
        RETURN QUERY
        WITH ins AS (
            INSERT INTO runpool.runs AS r (
                id, tenant, handler, input, priority, available_at, rank, max_attempts,
                traceparent, deferred, paused, attempt_timeout, deadline, budget
            )
            SELECT x.id, x.tenant, x.handler, x.input, x.priority, x.available,
                   runpool.rank(x.available, x.priority, cfg.aging_seconds),
                   coalesce(x.max_attempts, cfg.default_max_attempts), x.traceparent,
                   coalesce(x.run_at > clock_timestamp(), false),
                   EXISTS (SELECT 1 FROM runpool.tenants t
                           WHERE t.tenant = x.tenant AND t.max_running = 0),
                   x.timeout, x.deadline, x.budget
            FROM (
                SELECT runpool.new_run_id(started_us - (total - e.n), salt) AS id,
                       e.v ->> 'tenant' AS tenant, e.v ->> 'handler' AS handler,
                       coalesce(nullif(e.v -> 'input', 'null'::jsonb), '{}') AS input,
                       coalesce((e.v ->> 'priority')::numeric::int, 0) AS priority,
                       -- A microsecond apart, ending now: the batch keeps its order in the
                       -- queue. Valid by now (checked above): plain casts.
                       greatest((e.v ->> 'run_at')::timestamptz,
                                started - (total - e.n) * interval '1 microsecond') AS available,
                       (e.v ->> 'run_at')::timestamptz AS run_at,
                       (e.v ->> 'max_attempts')::numeric::int AS max_attempts,
                       e.v ->> 'traceparent' AS traceparent,
                       make_interval(secs => (e.v ->> 'timeout')::float8) AS timeout,
                       (e.v ->> 'deadline')::timestamptz AS deadline,
                       nullif(e.v -> 'budget', 'null'::jsonb) AS budget
                FROM jsonb_array_elements(enqueue_many.runs) WITH ORDINALITY AS e(v, n)
                OFFSET 0
            ) x
            RETURNING r.id
        ), ev AS (
            INSERT INTO runpool.run_events (run_id, kind, attempt)
            SELECT ins.id, 'enqueued', 0 FROM ins
        )
        SELECT ins.id FROM ins ORDER BY ins.id;
        PERFORM pg_notify('runpool_wakeup', '');
        RETURN;
    END IF;

    -- The runs, their events and the ids in input order (NULL where an idempotency key
    -- conflicted: looked up below, in a statement of its own, as enqueue does).
    WITH p AS MATERIALIZED (
        SELECT e.n, runpool.new_run_id(started_us - (total - e.n), salt) AS id,
               e.v ->> 'tenant' AS tenant,
               e.v ->> 'handler' AS handler,
               coalesce(nullif(e.v -> 'input', 'null'::jsonb), '{}') AS input,
               coalesce((e.v ->> 'priority')::numeric::int, 0) AS priority,
               e.v ->> 'idempotency_key' AS idempotency_key,
               -- Valid by now (checked above): plain casts.
               (e.v ->> 'run_at')::timestamptz AS run_at,
               (e.v ->> 'max_attempts')::numeric::int AS max_attempts,
               e.v ->> 'traceparent' AS traceparent, e.v ->> 'serial_key' AS serial_key,
               make_interval(secs => (e.v ->> 'timeout')::float8) AS timeout,
               (e.v ->> 'deadline')::timestamptz AS deadline,
               nullif(e.v -> 'budget', 'null'::jsonb) AS budget,
               -- A microsecond apart, ending now: the batch keeps its order in the queue.
               started - (total - e.n) * interval '1 microsecond' AS arrival,
               -- Taken in input order (this scan's): a key's runs run in the order given.
               CASE WHEN e.v ->> 'serial_key' IS NOT NULL THEN nextval('runpool.serial_order')
               END AS position
        FROM jsonb_array_elements(enqueue_many.runs) WITH ORDINALITY AS e(v, n)
    ), q AS (
        SELECT p.*, greatest(coalesce(p.run_at, p.arrival), p.arrival) AS available,
               p.serial_key IS NOT NULL AND (
                   NOT read_committed
                   -- an earlier run of the key in this call, or one queued or running
                   OR count(*) FILTER (WHERE p.serial_key IS NOT NULL)
                          OVER (PARTITION BY p.tenant, p.serial_key ORDER BY p.n) > 1
                   OR EXISTS (SELECT 1 FROM runpool.runs r
                              WHERE r.tenant = p.tenant AND r.serial_key = p.serial_key
                                AND r.status IN ('queued', 'running'))) AS waits,
               EXISTS (SELECT 1 FROM runpool.tenants t
                       WHERE t.tenant = p.tenant AND t.max_running = 0) AS is_paused
        FROM p
    ), ins AS (
        INSERT INTO runpool.runs AS r (
            id, tenant, handler, input, priority, idempotency_key, available_at, rank,
            max_attempts, traceparent, serial_key, serial_order, held, deferred, paused,
            attempt_timeout, deadline, budget
        )
        SELECT q.id, q.tenant, q.handler, q.input, q.priority, q.idempotency_key, q.available,
               runpool.rank(q.available, q.priority, cfg.aging_seconds),
               coalesce(q.max_attempts, cfg.default_max_attempts), q.traceparent,
               q.serial_key, q.position, q.waits,
               coalesce(q.run_at > clock_timestamp(), false), q.is_paused,
               q.timeout, q.deadline, q.budget
        -- In key order, not input order: two batches holding the same keys in opposite orders
        -- would each wait for the other's first key (a deadlock, 40P01). Ids and serial
        -- positions were drawn in input order above; the earlier of a repeated key still wins.
        FROM q ORDER BY q.tenant, q.idempotency_key, q.n
        ON CONFLICT (tenant, idempotency_key) WHERE idempotency_key IS NOT NULL DO NOTHING
        RETURNING r.id, r.held, r.serial_key
    ), ev AS (
        INSERT INTO runpool.run_events (run_id, kind, attempt, detail)
        SELECT ins.id, 'enqueued', 0, CASE WHEN ins.held
            THEN jsonb_build_object('held_by_serial_key', ins.serial_key) END
        -- The events in input order still (ids grow with it).
        FROM ins ORDER BY ins.id
    )
    SELECT array_agg(ins.id ORDER BY p.n), array_agg(p.idempotency_key ORDER BY p.n),
           array_agg(p.tenant ORDER BY p.n), count(ins.id)
    INTO ids, idem_keys, run_tenants, inserted
    FROM p LEFT JOIN ins ON ins.id = p.id;

    IF array_position(ids, NULL) IS NOT NULL THEN
        -- An earlier run (committed, this call's, or a concurrent enqueue's that won) holds
        -- the key; under READ COMMITTED this statement sees it.
        SELECT array_agg(coalesce(x.id, (SELECT r.id FROM runpool.runs r
                                         WHERE r.tenant = x.tenant
                                           AND r.idempotency_key = x.idempotency_key))
                         ORDER BY x.n)
        INTO ids
        FROM unnest(ids, run_tenants, idem_keys) WITH ORDINALITY AS x(id, tenant, idempotency_key, n);
    END IF;
    -- One doorbell for the batch, when it added a run (a repeat of known keys adds none).
    IF inserted > 0 THEN
        PERFORM pg_notify('runpool_wakeup', '');
    END IF;
    RETURN QUERY SELECT unnest(ids);
END
$$;

-- enqueue (0021's): timeout and deadline through the shared rules, and the tenant's row
-- upserted again when it reads as paused (waiting for an operator's uncommitted quota change).
CREATE OR REPLACE FUNCTION runpool.enqueue(
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
    stamp timestamptz;
    problem text;
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
    -- The rules enqueue_many applies too (one definition each, above).
    problem := coalesce(runpool.timeout_problem(enqueue.timeout),
                        runpool.deadline_problem(enqueue.deadline));
    IF problem IS NOT NULL THEN
        RAISE EXCEPTION 'runpool.enqueue: %', problem USING ERRCODE = 'invalid_parameter_value';
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

    -- The tenant's row read (0021: no speculative insertion, no wait for an operator holding
    -- it). Missing, or paused: upserted, whose conflict check waits for a transaction updating
    -- the row (an operator's set_tenant_quota), and read again, so an unpause cannot miss this
    -- run. A pause uncommitted meanwhile leaves the run unpaused: never started against the
    -- quota (the claim checks it), only looked at.
    SELECT coalesce(t.max_running = 0, false) INTO is_paused
    FROM runpool.tenants t WHERE t.tenant = enqueue.tenant;
    IF NOT FOUND OR is_paused THEN
        INSERT INTO runpool.tenants (tenant) VALUES (enqueue.tenant) ON CONFLICT DO NOTHING;
        is_paused := EXISTS (SELECT 1 FROM runpool.tenants t
                             WHERE t.tenant = enqueue.tenant AND t.max_running = 0);
    END IF;
    available := greatest(coalesce(enqueue.run_at, clock_timestamp()), clock_timestamp());
    new_rank := runpool.rank(available, enqueue.priority, cfg.aging_seconds);
    -- A time-ordered id (new_run_id): the primary key's new entries land at its right edge.
    -- Its time from a variable: with clock_timestamp() as its argument the SQL functions
    -- would not be inlined, and a call not inlined is planned anew in every transaction.
    stamp := clock_timestamp();
    new_id := runpool.new_run_id(runpool.epoch_us(stamp), runpool.new_run_salt());
    IF enqueue.idempotency_key IS NULL THEN
        -- Nothing to conflict on: a plain INSERT (no speculative insertion).
        INSERT INTO runpool.runs AS r (
            id, tenant, handler, input, priority, available_at, rank,
            max_attempts, traceparent, serial_key, serial_order, held, deferred, paused,
            attempt_timeout, deadline, budget
        ) VALUES (
            new_id, enqueue.tenant, enqueue.handler, coalesce(enqueue.input, '{}'),
            enqueue.priority, available, new_rank,
            coalesce(enqueue.max_attempts, cfg.default_max_attempts), enqueue.traceparent,
            enqueue.serial_key, position, waits,
            coalesce(enqueue.run_at > clock_timestamp(), false), is_paused,
            enqueue.timeout, enqueue.deadline, enqueue.budget
        );
    ELSE
        INSERT INTO runpool.runs AS r (
            id, tenant, handler, input, priority, idempotency_key, available_at, rank,
            max_attempts, traceparent, serial_key, serial_order, held, deferred, paused,
            attempt_timeout, deadline, budget
        ) VALUES (
            new_id, enqueue.tenant, enqueue.handler, coalesce(enqueue.input, '{}'),
            enqueue.priority, enqueue.idempotency_key, available, new_rank,
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
    END IF;

    INSERT INTO runpool.run_events (run_id, kind, attempt, detail)
    VALUES (new_id, 'enqueued', 0, CASE WHEN waits
        THEN jsonb_build_object('held_by_serial_key', enqueue.serial_key) END);
    PERFORM pg_notify('runpool_wakeup', '');
    RETURN new_id;
END
$$;

REVOKE ALL ON FUNCTION
    runpool.timeout_problem(interval, text),
    runpool.seconds_interval(numeric),
    runpool.deadline_problem(timestamptz)
FROM PUBLIC;
