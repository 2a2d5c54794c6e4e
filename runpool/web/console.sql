-- The statements of the web console, the run API and /metrics. Each reads a bounded number of
-- index entries (a LIMIT, a capped count, or a probe per tenant of one page), so a refresh
-- costs the same with a million finished runs as with none: nothing here scans history.

-- name: tenants
-- One page of tenants (by name, after %(after)s): their quota and live leases (the rule's
-- view, tenant_capacity), runs stuck on an expired lease, and capped counts — queued runs
-- that can start now (the rule's view, ready_runs) and all queued runs, up to %(cap)s each (the
-- difference waits: scheduled, in retry backoff, behind its serial key, or of a paused
-- tenant; so do runs in the 'waiting' status of durable waits); runs that failed for good in the last 24 hours, up to %(failed_cap)s (a tenant's
-- whole dead-letter history could be any size); and since when the oldest ready run waits.
-- Every count is index-only on runs_queued_tenant or runs_failed_tenant (0011). What the
-- tenant spent in the last 24 hours: at most 25 hours x 8 shards of runpool.tenant_usage (0014).
SELECT q.tenant, q.quota, t.max_running IS NULL AS default_quota, q.live AS running,
       s.tokens_24h, s.cost_24h,
       (SELECT count(*) FROM runpool.runs r
        WHERE r.tenant = q.tenant AND r.status = 'running'
          AND r.lease_expires_at <= now()) AS stuck,
       n.ready, greatest(n.queued - n.ready, 0) + n.waiting AS waiting,
       n.queued >= %(cap)s OR n.waiting >= %(cap)s AS queued_capped,
       f.failed, f.failed >= %(failed_cap)s AS failed_capped,
       extract(epoch FROM now() - (
           SELECT min(r.available_at) FROM runpool.ready_runs r
           WHERE r.tenant = q.tenant))::float8 AS oldest_wait_s
FROM runpool.tenant_capacity q
JOIN runpool.tenants t ON t.tenant = q.tenant
CROSS JOIN LATERAL (
    SELECT (SELECT count(*) FROM (SELECT 1 FROM runpool.runs r
                                  WHERE r.tenant = q.tenant AND r.status = 'queued'
                                  LIMIT %(cap)s) x) AS queued,
           (SELECT count(*) FROM (SELECT 1 FROM runpool.ready_runs r
                                  WHERE r.tenant = q.tenant LIMIT %(cap)s) x) AS ready,
           (SELECT count(*) FROM (SELECT 1 FROM runpool.runs r
                                  WHERE r.tenant = q.tenant AND r.status = 'waiting'
                                  LIMIT %(cap)s) x) AS waiting
) n
CROSS JOIN LATERAL (
    SELECT count(*) AS failed
    FROM (SELECT 1 FROM runpool.runs r
          WHERE r.tenant = q.tenant AND r.status = 'failed'
            AND r.finished_at > now() - interval '24 hours'
          LIMIT %(failed_cap)s) x
) f
CROSS JOIN LATERAL (
    SELECT sum(u.input_tokens + u.output_tokens)::bigint AS tokens_24h,
           sum(u.cost)::float8 AS cost_24h
    FROM runpool.tenant_usage u
    WHERE u.tenant = q.tenant
      AND u.hour >= date_bin('1 hour', now() - interval '24 hours',
                             timestamptz '2000-01-01 00:00:00+00')
) s
WHERE q.tenant > %(after)s
ORDER BY q.tenant
LIMIT %(limit)s;

-- name: in_flight
-- Runs holding a lease, the one that runs out first first: how long each has run, its lease
-- left (negative: stuck, reclaimed by the next claim) and its worker.
SELECT r.id, r.tenant, r.handler, r.attempt, r.worker_id, w.host, w.pid,
       extract(epoch FROM now() - r.started_at)::float8 AS running_s,
       extract(epoch FROM r.lease_expires_at - now())::float8 AS lease_left_s,
       r.cancel_requested_at IS NOT NULL AS cancelling
FROM runpool.runs r
LEFT JOIN runpool.workers w ON w.id = r.worker_id
WHERE r.status = 'running'
ORDER BY r.lease_expires_at
LIMIT %(limit)s;

-- name: stuck
-- Runs whose lease ran out and that no claim reclaimed yet (their worker stopped renewing:
-- hung, frozen, or cut off), the longest stuck first.
SELECT r.id, r.tenant, r.handler, r.attempt, r.worker_id, w.host, w.pid,
       w.last_seen_at, extract(epoch FROM now() - r.lease_expires_at)::float8 AS stuck_s,
       r.cancel_requested_at IS NOT NULL AS cancelling
FROM runpool.runs r
LEFT JOIN runpool.workers w ON w.id = r.worker_id
WHERE r.status = 'running' AND r.lease_expires_at < now()
ORDER BY r.lease_expires_at
LIMIT %(limit)s;

-- name: dead_letters
-- One page of the dead-letter list (failed runs), newest first, after the run (%(before)s,
-- %(before_id)s) that ended the previous page: runs one outcome batch ended share their
-- finished_at, so the id breaks the tie (runs_failed, then a sort of the tied few).
SELECT r.id, r.tenant, r.handler, r.attempt, r.finished_at,
       r.error ->> 'reason' AS reason, left(r.error ->> 'message', 300) AS message
FROM runpool.runs r
WHERE r.status = 'failed' AND r.finished_at <= %(before)s
  AND (r.finished_at, r.id) < (%(before)s, %(before_id)s)
ORDER BY r.finished_at DESC, r.id DESC
LIMIT %(limit)s;

-- name: dead_letters_of_tenant
-- The same page for one tenant, on runs_failed_tenant: runs_failed (by time only) would walk
-- every other tenant's failures to find this one's, and the planner picked it whenever it
-- guessed this tenant's share of failures large. The row comparison on (tenant, finished_at)
-- is an index condition on runs_failed_tenant only, which settles it.
SELECT r.id, r.tenant, r.handler, r.attempt, r.finished_at,
       r.error ->> 'reason' AS reason, left(r.error ->> 'message', 300) AS message
FROM runpool.runs r
WHERE r.tenant = %(tenant)s AND r.status = 'failed'
  AND (r.tenant, r.finished_at) <= (%(tenant)s, %(before)s)
  AND (r.finished_at, r.id) < (%(before)s, %(before_id)s)
ORDER BY r.tenant DESC, r.finished_at DESC, r.id DESC
LIMIT %(limit)s;

-- name: workers
-- Live workers (seen within two minutes, not stopped), with the runs each holds: the running
-- runs are counted once, not once per worker.
SELECT w.id, w.host, w.pid, w.concurrency, w.handlers, w.started_at, w.last_seen_at,
       extract(epoch FROM now() - w.last_seen_at)::float8 AS seen_s,
       coalesce(h.running, 0) AS running
FROM runpool.workers w
LEFT JOIN (SELECT r.worker_id, count(*) AS running FROM runpool.runs r
           WHERE r.status = 'running' GROUP BY r.worker_id) h ON h.worker_id = w.id
WHERE w.stopped_at IS NULL AND w.last_seen_at > now() - interval '2 minutes'
ORDER BY w.started_at
LIMIT %(limit)s;

-- name: schedules
-- The schedules (a table of configuration, set by code or SQL), the next to fire first: when,
-- what, and whether a pool found its cron unusable (error).
SELECT s.name, s.cron, s.timezone, s.tenant, s.handler, s.catch_up, s.enabled,
       s.next_fire_at, s.last_fire_at, s.error,
       extract(epoch FROM s.next_fire_at - now())::float8 AS next_in_s
FROM runpool.schedules s
ORDER BY s.next_fire_at NULLS LAST, s.name
LIMIT %(limit)s;

-- name: run
-- One run, as a JSON object of its columns (those a later migration adds, such as usage,
-- included), or nothing when it belongs to another tenant than %(tenant)s (NULL: any).
-- event_seq is its last event's seq: the checkpoints' counter once it has one (0009).
SELECT (to_jsonb(r) - 'rank' - 'serial_order' - 'attempt_offset')
       || jsonb_build_object('event_seq', coalesce(
              (SELECT s.seq FROM runpool.event_seqs s WHERE s.run_id = r.id), r.event_seq))
           AS run,
       r.max_attempts - runpool.attempts_used(r.attempt, r.attempt_offset) AS attempts_left
FROM runpool.runs r
WHERE r.id = %(id)s AND (r.tenant = %(tenant)s::text OR %(tenant)s::text IS NULL);

-- name: messages
-- The end of a run's conversation (the live page follows on from it), newest first.
SELECT seq, role, content, attempt, call_id, created_at
FROM runpool.messages WHERE run_id = %(id)s
ORDER BY seq DESC
LIMIT %(limit)s;

-- name: tool_calls
-- A run's latest tool calls, newest first.
SELECT call_id, name, arguments, status, result, attempt, executions, started_at, finished_at
FROM runpool.tool_calls WHERE run_id = %(id)s
ORDER BY started_at DESC, call_id DESC
LIMIT %(limit)s;

-- name: snapshot
-- The run page reads in one snapshot: the events it shows and the seq its live stream
-- starts after (the run's last event seq, 0009) agree.
SET TRANSACTION ISOLATION LEVEL REPEATABLE READ READ ONLY;

-- name: run_events
-- A run's state changes, oldest first.
SELECT at, kind, attempt, worker_id, detail
FROM runpool.run_events WHERE run_id = %(id)s
ORDER BY id
LIMIT %(limit)s;

-- name: explain
-- explain_run's answer for a run (the tenant-scoped variant: NULL for another tenant's run).
SELECT runpool.explain_run(%(id)s, %(tenant)s::text);

-- name: cancel
-- cancel_run's answer (NULL: no such run, or another tenant's).
SELECT runpool.cancel_run(%(id)s, %(reason)s::text, %(tenant)s::text);

-- name: retry
-- retry_run's answer (NULL: no such run, or another tenant's).
SELECT runpool.retry_run(%(id)s, %(tenant)s::text);

-- name: signal
-- signal_run's answer (NULL: no such run, or another tenant's).
SELECT runpool.signal_run(%(id)s, %(name)s, %(payload)s, %(tenant)s::text);

-- name: live_workers
-- How many workers are live, and their run slots.
SELECT count(*) AS workers, coalesce(sum(w.concurrency), 0) AS slots
FROM runpool.workers w
WHERE w.stopped_at IS NULL AND w.last_seen_at > now() - interval '2 minutes';

-- name: event_mark
-- Where the event log ends now: counting starts here (the history before is not read).
SELECT coalesce(max(id), 0) FROM runpool.run_events;

-- name: events_since
-- The next events after %(mark)s, in id order, with the run's tenant and handler and the
-- timings the histograms need: at most %(limit)s per read (the rest come in the next one).
-- Every value is read from the run as it is now: a run retried since has another started_at,
-- so a timing that comes out negative is not observed.
SELECT e.id, e.kind, e.at >= now() - %(lag)s * interval '1 second' AS recent,
       e.attempt, e.detail ->> 'reason' AS reason, r.tenant, r.handler,
       extract(epoch FROM e.at - r.created_at)::float8 AS since_created,
       extract(epoch FROM e.at - r.started_at)::float8 AS since_started,
       extract(epoch FROM e.at - r.cancel_requested_at)::float8 AS since_cancel
FROM runpool.run_events e
LEFT JOIN runpool.runs r ON r.id = e.run_id
WHERE e.id > %(mark)s
ORDER BY e.id
LIMIT %(limit)s;

-- name: healthz
-- The database answers, and says when.
SELECT now();
