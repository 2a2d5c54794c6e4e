-- 0011_console_indexes: what the web console and /metrics read on every refresh, indexed so a
-- page costs the same with a million finished runs as with none (issue 14).

-- A tenant's queue depth and oldest wait: capped index-only counts (of all its queued runs,
-- and of those ready_runs (0008) can start now) and the first ready entry, per tenant. The
-- claim's index (runs_ready) holds only the ready ones, handler first.
CREATE INDEX runs_queued_tenant ON runpool.runs (tenant, available_at)
    INCLUDE (held, deferred, paused) WHERE status = 'queued';
-- A tenant's runs in the 'waiting' status of durable waits (DESIGN.md: a signal, a sleep, child
-- runs), counted as waiting beside its queued runs that cannot start yet; none before then.
CREATE INDEX runs_waiting_tenant ON runpool.runs (tenant) WHERE status = 'waiting';
-- A tenant's dead letters, newest first, and their capped count: runs_failed is by time
-- across tenants, so a tenant's count or page would walk every other tenant's failures.
CREATE INDEX runs_failed_tenant ON runpool.runs (tenant, finished_at) WHERE status = 'failed';
-- Live workers: the table keeps a row for every worker process that ever started.
CREATE INDEX workers_live ON runpool.workers (last_seen_at) WHERE stopped_at IS NULL;
