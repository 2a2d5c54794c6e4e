-- 0021_enqueue: enqueue (one run and many) writes less per run for the same contract.
--
-- Why (issue 20, bulk enqueue at 0.84x pgqueuer): a third of enqueue_many's server CPU was
-- btree inserts, and every run paid for a random uuid twice over (gen_random_uuid() draws
-- from the kernel's strong random source, ~0.8 µs a call; and a random key lands on a random
-- leaf of runs_pkey and of run_events_run). So:
--   * Run ids are time-ordered (UUID version 7 layout, RFC 9562): the time in the top 60 bits,
--     62 random bits below. New ids land at the right edge of both indexes.
--   * A batch with no idempotency key and no serial key takes a plain INSERT (no ON CONFLICT
--     speculative insertion: a lock and an extra WAL record per run), its events straight from
--     the INSERT's RETURNING, and no window, sort or join to put ids in input order: within a
--     batch the ids grow with the input position, so ordering by id is input order.
--   * One pass over the batch finds the first bad element and what the batch needs (serial
--     keys, idempotency keys, budgets, its tenants): four passes before.

-- A run id in the UUID version 7 layout: the 48 bits of milliseconds since 1970 of `at_us`
-- (microseconds since 1970) and 12 bits of the millisecond's fraction, the version and
-- variant bits, and 62 random bits: random() (the session's fast generator, 52 bits a draw)
-- XORed with `salt` (the caller's strong random bits, below 2^62: new_run_salt, once a call)
-- so a session's setseed() cannot make ids repeat. Ids of distinct microseconds order as
-- their times. Inlined (one SQL expression), so a batch pays no call per run. The low 64 bits
-- stay random from run to run, as a trace-id-ratio sampler wants them (a run's trace id may
-- be its run id). Ids are not secrets (a tenant-scoped call checks the run's tenant): they
-- need to be unique, not unguessable.
CREATE FUNCTION runpool.new_run_id(at_us bigint, salt bigint) RETURNS uuid
LANGUAGE sql VOLATILE PARALLEL SAFE
RETURN (lpad(to_hex(at_us / 1000 << 16 | 28672 | at_us % 1000 * 4096 / 1000), 16, '0')
        || to_hex((random() * 4611686018427387904)::bigint # salt # -9223372036854775808))::uuid;

-- 60 strong random bits (from gen_random_uuid: the 15 hex digits after its variant digit).
CREATE FUNCTION runpool.new_run_salt() RETURNS bigint
LANGUAGE sql VOLATILE PARALLEL SAFE
RETURN ('x' || right(replace(gen_random_uuid()::text, '-', ''), 15))::bit(60)::bigint;

-- Microseconds since 1970 of a time (a run id's time). STABLE, as extract() on a timestamptz
-- is: declared IMMUTABLE it would never be inlined, and a call not inlined is planned again in
-- every transaction.
CREATE FUNCTION runpool.epoch_us(t timestamptz) RETURNS bigint
LANGUAGE sql STABLE PARALLEL SAFE
RETURN (extract(epoch FROM t) * 1000000)::bigint;

-- Enqueue many runs in one call: `runs` is a JSON array of objects keyed by enqueue's
-- parameter names (tenant and handler required; a timeout in seconds, times as ISO text).
-- All or none: the first bad element is named (runs[i], counted from 0) and nothing is
-- written. Ids come back in input order; a repeated idempotency key (in the table or earlier
-- in the array) gives the existing run's id, as enqueue does. Runs of one call keep their
-- order (their arrival times are a microsecond apart, never ahead of the clock). Serial keys:
-- every distinct key is locked first (in key order, so two batches cannot deadlock), at most
-- 1,000 distinct keys a call (each lock is held until commit; the server's lock table is
-- shared and fixed). One doorbell for the whole batch. 0016's contract; see 0021's header for
-- what changed.
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
                        OR (e.v ->> 'timeout')::numeric <= 0 OR (e.v ->> 'timeout')::numeric > 366 * 86400
                        -- under a microsecond is an interval of 0
                        OR make_interval(secs => (e.v ->> 'timeout')::float8) <= interval '0'
                       THEN 'timeout must be a number of seconds, more than 0 and at most a year, got '
                            || (e.v -> 'timeout')::text
                   WHEN coalesce(jsonb_typeof(e.v -> 'deadline'), 'null') NOT IN ('null', 'string')
                        OR (e.v ->> 'deadline' IS NOT NULL
                            AND NOT coalesce(isfinite(runpool._time_or_null(e.v ->> 'deadline')), false))
                       THEN 'deadline must be a finite time, got ' || (e.v -> 'deadline')::text
                   WHEN coalesce(jsonb_typeof(e.v -> 'budget'), 'null') NOT IN ('null', 'object')
                       THEN 'budget must be a JSON object'
                   WHEN octet_length(coalesce(e.v -> 'input', '{}')::text) > max_input
                       THEN 'input is ' || octet_length((e.v -> 'input')::text) || ' bytes, over the limit of '
                            || max_input || ' bytes'
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

    INSERT INTO runpool.tenants (tenant)
    SELECT t.tenant FROM unnest(run_tenants) AS t(tenant)
    WHERE NOT EXISTS (SELECT 1 FROM runpool.tenants o WHERE o.tenant = t.tenant)
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
        FROM q ORDER BY q.n
        ON CONFLICT (tenant, idempotency_key) WHERE idempotency_key IS NOT NULL DO NOTHING
        RETURNING r.id, r.held, r.serial_key
    ), ev AS (
        INSERT INTO runpool.run_events (run_id, kind, attempt, detail)
        SELECT ins.id, 'enqueued', 0, CASE WHEN ins.held
            THEN jsonb_build_object('held_by_serial_key', ins.serial_key) END
        FROM ins
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

-- enqueue (0012's contract and checks): the tenant's row read before it is upserted, a plain
-- INSERT when the run has no idempotency key, and a time-ordered id (new_run_id).
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

    -- The tenant's row is there but for its first run: read, not upserted (an INSERT ... ON
    -- CONFLICT is a speculative insertion, ~15 % of an enqueue's statements).
    SELECT coalesce(t.max_running = 0, false) INTO is_paused
    FROM runpool.tenants t WHERE t.tenant = enqueue.tenant;
    IF NOT FOUND THEN
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
    runpool.new_run_id(bigint, bigint),
    runpool.new_run_salt(),
    runpool.epoch_us(timestamptz)
FROM PUBLIC;
