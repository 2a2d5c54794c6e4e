-- 0001_schema: the run table (which is the queue), tenants, workers, the event log, and roles.

-- Roles are cluster-wide: another database of this cluster may have created them already.
DO $$
BEGIN
    CREATE ROLE runpool_api NOLOGIN;
EXCEPTION WHEN duplicate_object THEN NULL;
END $$;
DO $$
BEGIN
    CREATE ROLE runpool_worker NOLOGIN;
EXCEPTION WHEN duplicate_object THEN NULL;
END $$;

-- Pool-wide settings read by the SQL API (enqueue needs them, and it runs in the API's session,
-- not a worker's). One row; workers write the values their operator set explicitly.
CREATE TABLE runpool.config (
    singleton            boolean PRIMARY KEY DEFAULT true CHECK (singleton),
    aging_seconds        double precision NOT NULL DEFAULT 60
        CONSTRAINT aging_seconds_positive CHECK (aging_seconds > 0),
    default_max_attempts integer NOT NULL DEFAULT 3
        CONSTRAINT default_max_attempts_range CHECK (default_max_attempts BETWEEN 1 AND 1000),
    -- NULL: tenants without their own quota are unlimited.
    default_quota        integer
        CONSTRAINT default_quota_range CHECK (default_quota BETWEEN 0 AND 1000000),
    max_input_bytes      integer NOT NULL DEFAULT 1048576
        CONSTRAINT max_input_bytes_range CHECK (max_input_bytes BETWEEN 1 AND 268435456)
);
INSERT INTO runpool.config DEFAULT VALUES;

CREATE TABLE runpool.tenants (
    tenant      text PRIMARY KEY
        CONSTRAINT tenant_length CHECK (length(tenant) BETWEEN 1 AND 200),
    -- NULL: the pool's default quota applies. 0 pauses the tenant.
    max_running integer
        CONSTRAINT max_running_range CHECK (max_running BETWEEN 0 AND 1000000),
    created_at  timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE runpool.workers (
    id           uuid PRIMARY KEY,
    host         text NOT NULL,
    pid          integer NOT NULL,
    concurrency  integer NOT NULL,
    started_at   timestamptz NOT NULL DEFAULT now(),
    last_seen_at timestamptz NOT NULL DEFAULT now(),
    stopped_at   timestamptz
);

CREATE TABLE runpool.runs (
    id                  uuid PRIMARY KEY DEFAULT gen_random_uuid(),
    tenant              text NOT NULL
        CONSTRAINT tenant_length CHECK (length(tenant) BETWEEN 1 AND 200),
    handler             text NOT NULL
        CONSTRAINT handler_length CHECK (length(handler) BETWEEN 1 AND 200),
    status              text NOT NULL DEFAULT 'queued'
        CONSTRAINT status_known
        CHECK (status IN ('queued', 'running', 'succeeded', 'failed', 'cancelled')),
    priority            integer NOT NULL DEFAULT 0
        CONSTRAINT priority_range CHECK (priority BETWEEN -100 AND 100),
    -- The fencing token: incremented by every claim, never decremented, so a write carrying an
    -- older attempt can always be told apart from the current holder's.
    attempt             integer NOT NULL DEFAULT 0
        CONSTRAINT attempt_not_negative CHECK (attempt >= 0),
    max_attempts        integer NOT NULL
        CONSTRAINT max_attempts_range CHECK (max_attempts BETWEEN 1 AND 1000),
    -- Attempts that do not count against max_attempts: leases released by a draining worker,
    -- and everything before a retry_run.
    attempt_offset      integer NOT NULL DEFAULT 0
        CONSTRAINT attempt_offset_range CHECK (attempt_offset BETWEEN 0 AND attempt),
    input               jsonb NOT NULL DEFAULT '{}',
    result              jsonb,
    -- {"reason": machine-readable, "message": human-readable, ...}
    error               jsonb,
    idempotency_key     text
        CONSTRAINT idempotency_key_length CHECK (length(idempotency_key) BETWEEN 1 AND 200),
    traceparent         text
        CONSTRAINT traceparent_length CHECK (length(traceparent) <= 128),
    available_at        timestamptz NOT NULL DEFAULT now(),
    -- Virtual deadline: available_at - priority * aging_seconds, as epoch seconds, fixed when the
    -- run becomes queued. Claiming by ascending rank is priority order with linear aging, served
    -- by an index instead of a periodic UPDATE of every waiting row.
    rank                double precision NOT NULL,
    worker_id           uuid,
    lease_expires_at    timestamptz,
    cancel_requested_at timestamptz,
    cancel_reason       text,
    created_at          timestamptz NOT NULL DEFAULT now(),
    started_at          timestamptz,
    finished_at         timestamptz,
    -- Runs sharing (tenant, serial_key) run one at a time, in serial_order (enqueue order).
    serial_key          text
        CONSTRAINT serial_key_length CHECK (length(serial_key) BETWEEN 1 AND 200),
    serial_order        bigint,
    -- Waiting behind an earlier run of its serial key, outside the claim index, so a key with
    -- 10,000 waiting runs costs the claim nothing. Only a key's head (its earliest unfinished
    -- run) is ever claimable; when it ends, the next one is released (see 0002).
    held                boolean NOT NULL DEFAULT false,
    CONSTRAINT held_only_queued CHECK (NOT held OR status = 'queued'),
    CONSTRAINT running_has_lease CHECK ((status = 'running') = (lease_expires_at IS NOT NULL)),
    CONSTRAINT finished_when_terminal
        CHECK ((status IN ('succeeded', 'failed', 'cancelled')) = (finished_at IS NOT NULL))
);

CREATE SEQUENCE runpool.serial_order;

-- The queue: each tenant's claimable runs in claim order. The claim reads only the head of it.
CREATE INDEX runs_queue ON runpool.runs (tenant, rank) WHERE status = 'queued' AND NOT held;
-- A serial key's waiting runs, in order (for releasing the next one).
CREATE INDEX runs_serial_held ON runpool.runs (tenant, serial_key, serial_order) WHERE held;
-- A serial key's runs that still block it.
CREATE INDEX runs_serial_active ON runpool.runs (tenant, serial_key)
    WHERE serial_key IS NOT NULL AND status IN ('queued', 'running');
-- Live leases per tenant (quota counting) and expired leases (the reaper).
CREATE INDEX runs_running_tenant ON runpool.runs (tenant, lease_expires_at) WHERE status = 'running';
CREATE INDEX runs_lease ON runpool.runs (lease_expires_at) WHERE status = 'running';
CREATE UNIQUE INDEX runs_idempotency ON runpool.runs (tenant, idempotency_key)
    WHERE idempotency_key IS NOT NULL;
CREATE INDEX runs_failed ON runpool.runs (finished_at) WHERE status = 'failed';

-- Every state change of a run, in order: the answer to "what happened to run X".
CREATE TABLE runpool.run_events (
    id        bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    run_id    uuid NOT NULL,
    at        timestamptz NOT NULL DEFAULT now(),
    kind      text NOT NULL,
    attempt   integer NOT NULL,
    worker_id uuid,
    detail    jsonb
);
CREATE INDEX run_events_run ON runpool.run_events (run_id, id);

GRANT USAGE ON SCHEMA runpool TO runpool_api, runpool_worker;
GRANT SELECT ON ALL TABLES IN SCHEMA runpool TO runpool_api;
GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA runpool TO runpool_worker;
GRANT USAGE ON SEQUENCE runpool.serial_order TO runpool_worker;
