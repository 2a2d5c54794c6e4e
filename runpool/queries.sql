-- How a worker's statement says running. A statement that reads given runs (a fence, a batch
-- of outcomes, a heartbeat) says a run is running as `lease_expires_at IS NOT NULL` (the
-- running_has_lease check makes it the same as `status = 'running'`) and never names the
-- status: a statement that does lets its plan read the runs through runs_lease or
-- runs_running_tenant, whose predicate it then implies. Those partial indexes keep an entry
-- for every run that ran since the last vacuum (a bitmap scan never marks one dead), and
-- statistics taken while the running runs were few (after a bulk load, say) make scanning one
-- whole look as cheap as the primary key: W1's outcome batches read 1,500-20,000 entries each
-- (up to 7.6 ms) and every checkpoint write of W11cpu read all 500 running runs' entries
-- (tests/test_worker_plans.py). Statements that look for running runs by their lease (the
-- reap, the quota's count) compare lease_expires_at, which those indexes serve.

-- name: reap_expired
-- Return runs whose lease expired to the queue (keeping their rank), or end them: failed past
-- max_attempts, cancelled if a cancel was requested, failed deadline_exceeded past the run's
-- deadline. An attempt whose worker died after its timeout came is recorded as a timeout.
-- Rings the doorbell when work came back, and an ended run's own (0009). Each status change
-- stores its live event in its run_events row, numbered here (see 0017 and claim_runs).
WITH expired AS (
    SELECT id, lease_expires_at
    FROM runpool.runs
    WHERE status = 'running'
      AND lease_expires_at < now()
    ORDER BY lease_expires_at
    LIMIT 1000
    FOR UPDATE SKIP LOCKED
),
bumped AS (
    -- After the locks, in a snapshot of its own (0020).
    SELECT b.run_id, b.seq FROM runpool._bump_event_seqs(ARRAY(SELECT id FROM expired)) b
),
reaped AS (
    UPDATE runpool.runs r SET
        status = CASE
            WHEN r.cancel_requested_at IS NOT NULL THEN 'cancelled'
            WHEN r.deadline <= now() THEN 'failed'
            WHEN runpool.attempts_used(r.attempt, r.attempt_offset) >= r.max_attempts THEN 'failed'
            ELSE 'queued' END,
        error = CASE
            WHEN r.cancel_requested_at IS NOT NULL THEN r.error
            WHEN r.deadline <= now()
            THEN jsonb_build_object('reason', 'deadline_exceeded',
                                    'message', 'the run passed its deadline (its worker stopped)')
            -- Recorded on a reclaim too (a follower's status event names it).
            WHEN r.attempt_due < r.lease_expires_at
            THEN jsonb_build_object('reason', 'timeout',
                                    'message', 'the attempt passed its timeout (its worker stopped)')
            WHEN runpool.attempts_used(r.attempt, r.attempt_offset) >= r.max_attempts
            THEN jsonb_build_object('reason', 'lease_expired',
                                    'message', 'lease expired on the last allowed attempt')
            ELSE r.error END,
        finished_at = CASE
            WHEN r.cancel_requested_at IS NOT NULL OR r.deadline <= now()
              OR runpool.attempts_used(r.attempt, r.attempt_offset) >= r.max_attempts THEN now() END,
        lease_expires_at = NULL,
        available_at = now(),
        deferred = false,
        event_seq = coalesce(b.seq, r.event_seq + 1)
    FROM expired LEFT JOIN bumped b ON b.run_id = expired.id
    WHERE r.id = expired.id
    RETURNING r.id, r.attempt, r.status, r.worker_id, r.event_seq, r.cancel_reason,
              r.error ->> 'reason' AS error_reason,
              CASE WHEN r.status = 'failed' AND r.error ->> 'reason' = 'deadline_exceeded'
                   THEN 'deadline_exceeded'
                   WHEN r.attempt_due < expired.lease_expires_at THEN 'timeout'
                   ELSE 'lease_expired' END AS reason
),
events AS (
    INSERT INTO runpool.run_events (run_id, kind, attempt, worker_id, detail, seq, status, reason)
    SELECT id, CASE status WHEN 'queued' THEN 'reclaimed' ELSE status END, attempt, worker_id,
           jsonb_build_object('reason', reason), event_seq, status,
           CASE status WHEN 'cancelled' THEN coalesce(cancel_reason, error_reason)
                       WHEN 'failed' THEN error_reason
                       ELSE reason END
    FROM reaped
)
SELECT count(*) AS reaped,
       (CASE WHEN bool_or(status = 'queued') THEN pg_notify('runpool_wakeup', '') END) IS NOT NULL
           AS rang,
       count(runpool._ring(id)) FILTER (WHERE status <> 'queued') AS ended
FROM reaped;

-- name: schedule_probe
-- Seconds until the earliest schedule plan (NULL: none) and whether a schedule waits for its
-- next plan time to be computed: rides in the claim's reap (index probes), so a scheduler
-- that missed a doorbell, or runs without LISTEN, still learns within a poll.
SELECT extract(epoch FROM (SELECT min(next_fire_at) FROM runpool.schedules
                           WHERE enabled AND error IS NULL) - now())::float8,
       EXISTS (SELECT 1 FROM runpool.schedules
               WHERE enabled AND error IS NULL AND next_fire_at IS NULL);

-- name: expire_deadlines
-- End queued and waiting runs past their deadline (failed, deadline_exceeded), without a
-- worker: at the reaper's cadence, a bounded batch of each, through the indexes of queued
-- (0012) and waiting (0013) runs with a deadline. A run someone holds right now is left to
-- the next sweep. A run waiting behind its serial key leaves the line (held = false), as a
-- cancel does; a run waiting durably has its wait closed unanswered (state 'cancelled').
WITH due_queued AS (
    SELECT id
    FROM runpool.runs
    WHERE deadline IS NOT NULL AND status = 'queued' AND deadline <= now()
    ORDER BY deadline
    LIMIT 1000
    FOR UPDATE SKIP LOCKED
),
due_waiting AS (
    -- With its pending wait's row (a waiting run has one), skipped while another session
    -- holds it: the sweep runs in every claim, which must not wait for anyone.
    SELECT r.id
    FROM runpool.runs r
    JOIN runpool.waits w ON w.run_id = r.id AND w.state = 'pending'
    WHERE r.deadline IS NOT NULL AND r.status = 'waiting' AND r.deadline <= now()
    ORDER BY r.deadline
    LIMIT 1000
    FOR UPDATE OF r, w SKIP LOCKED
),
ended AS (
    UPDATE runpool.runs r SET
        status = 'failed',
        error = jsonb_build_object('reason', 'deadline_exceeded',
                                   'message', 'the run passed its deadline before it could end'),
        finished_at = now(),
        held = false,
        deferred = false
    WHERE r.id IN (SELECT id FROM due_queued UNION ALL SELECT id FROM due_waiting)
    RETURNING r.id, r.attempt
),
unanswered AS (
    UPDATE runpool.waits w SET state = 'cancelled', resolved_at = now()
    WHERE w.run_id IN (SELECT id FROM due_waiting) AND w.state = 'pending'
)
INSERT INTO runpool.run_events (run_id, kind, attempt, detail)
SELECT id, 'failed', attempt, '{"reason": "deadline_exceeded"}'::jsonb FROM ended;

-- name: promote_due
-- Put runs whose time has come (run_at, retry backoff) into the claim's index (0006: runs
-- waiting for their time stay out of it, so the claim never walks them). Rows another
-- transaction holds are left to the next claim.
-- Held runs wait for their key, not for the clock: they are not in runs_deferred (promoted
-- once released). An id array, not IN (subquery): the planner sized the subquery by its LIMIT
-- and joined it to a scan of the whole table.
UPDATE runpool.runs r SET deferred = false
WHERE r.id = ANY(ARRAY(SELECT d.id FROM runpool.runs d
                       WHERE d.status = 'queued' AND d.deferred AND NOT d.held
                         AND d.available_at <= now()
                       ORDER BY d.available_at
                       LIMIT 1000
                       FOR NO KEY UPDATE SKIP LOCKED));

-- name: wake_due
-- Queue again the waiting runs whose sleep ended or whose wait timed out, and parents whose
-- children ended while their row was busy (0013). The function is called only when one
-- exists: a probe of the index waits_due (10,000 runs waiting cost it one entry read) and one
-- of an (almost always empty) join_checks table.
SELECT runpool._wake_due()
WHERE EXISTS (SELECT 1 FROM runpool.waits w
              WHERE w.state = 'pending' AND w.until IS NOT NULL AND w.until <= now())
   OR EXISTS (SELECT 1 FROM runpool.join_checks);

-- name: ready_handlers
-- The handlers with runs ready to claim, for a claimer that serves every handler (tests,
-- benchmarks): a loose index scan, one probe per handler. A pool passes its own list instead.
WITH RECURSIVE every_handler AS (
    (SELECT r.handler FROM runpool.ready_runs r ORDER BY r.handler LIMIT 1)
    UNION ALL
    SELECT n.handler
    FROM every_handler h CROSS JOIN LATERAL (
        SELECT r.handler FROM runpool.ready_runs r
        WHERE r.handler > h.handler
        ORDER BY r.handler LIMIT 1) n
)
SELECT handler FROM every_handler;

-- name: lock_tenants
-- The tenants the claim may take from: of those with runs that can start now (of a handler
-- this pool serves) and that look under quota, the %(limit)s whose best run ranks best (only
-- they can supply the %(limit)s best runs), among those it could lock. Only those with a
-- quota are locked: the lock is what makes claim_runs' recount of a quota exact. A tenant
-- without one needs no count, and no lock: concurrent claimers take its runs side by side
-- (claim_runs skips the rows another claimer holds), where a lock would queue them all behind
-- one claim's commit (W16: 14 of 16 claimers waiting on one tenant's row). A quota'd tenant
-- whose row another transaction holds (another claimer, or an operator's open
-- set_tenant_quota) is skipped, not waited for: it gets nothing from this claim, and the
-- next-ranked tenant takes its place (a claim of one run, a one-slot worker's or a last free
-- slot's, would otherwise get nothing for as long as the best-ranked tenant is held). It comes
-- back marked `skipped`, so the worker claims again shortly (see Worker; set_tenant_quota
-- also rings the doorbell at its commit).
-- The candidates are walked in rank order, each quota'd one locked as it is reached, until
-- %(limit)s are chosen: a quota'd tenant ranked below them is not locked (another claimer
-- may want it), nor is one that could not be.
-- The count here may be stale; claim_runs recounts under the lock. Each tenant comes with
-- whether it was locked: claim_runs takes nothing of one that got a quota since (see there).
-- A roomy quota'd tenant (see "Roomy tenants" below) is not locked at all, when %(roomy)s.
-- The lists are also left in the transaction's settings runpool.claim_tenants,
-- runpool.claim_limited and runpool.claim_roomy, where claim_runs reads them: the statements
-- travel in one round trip, the claim never waiting on this answer (read after COMMIT).
--
-- Roomy tenants. A quota'd tenant whose free quota is at least runpool.quota_margin (twice
-- the slots of every worker not stopped, 0025) cannot be pushed over its quota by any set of
-- concurrent claims: together they cannot hold more runs than the fleet has slots. Its row is
-- not locked, so claimers take its runs side by side instead of in turn (the peer harness's
-- W1, quota 100,000: 797 of 2,797 claims of 2 x 10 came back empty). The rule is judged
-- twice: here, to decide not to lock, and again in claim_runs, in a snapshot taken after this
-- statement holds the fleet fence in share mode, whose word alone counts. The fence (advisory
-- key 1920298608, 25) is what makes the fleet the claim counts the whole fleet: a worker that
-- registers takes it in exclusive mode before its first claim (fence_fleet), so it waits out
-- every claim that judged without its slots, and a claim that cannot take the share mode (a
-- registration waits for it) locks the tenant as before. %(roomy)s: the claimer's own slots
-- are in the margin (a registered, fenced worker; a bare claim() is not).
WITH RECURSIVE served AS (
    -- A loose index scan per served handler: one probe per tenant with ready runs of it,
    -- giving its best rank. Runs of handlers this pool does not serve are never read.
    SELECT s.handler, n.tenant, n.rank
    FROM unnest(%(handlers)s::text[]) AS s(handler)
    CROSS JOIN LATERAL (
        SELECT r.tenant, r.rank FROM runpool.ready_runs r
        WHERE r.handler = s.handler
        ORDER BY r.tenant, r.rank LIMIT 1) n
    UNION ALL
    SELECT h.handler, n.tenant, n.rank
    FROM served h CROSS JOIN LATERAL (
        SELECT r.tenant, r.rank FROM runpool.ready_runs r
        WHERE r.handler = h.handler AND r.tenant > h.tenant
        ORDER BY r.tenant, r.rank LIMIT 1) n
),
heads AS (
    SELECT tenant, min(rank) AS rank FROM served GROUP BY tenant
),
room AS MATERIALIZED (
    -- Each head tenant's free quota (NULL: it has none), its live runs counted once.
    SELECT h.tenant, h.rank, CASE WHEN q.quota IS NOT NULL THEN q.quota - q.live END AS room
    FROM heads h
    JOIN runpool.tenant_capacity q ON q.tenant = h.tenant
),
fence AS (
    -- The fleet fence in share mode, tried at most once (never waited for), only by a claim
    -- whose own slots the margin counts, and only once a tenant is roomy by its count.
    SELECT %(roomy)s::boolean AND pg_try_advisory_xact_lock_shared(1920298608, 25) AS held
),
candidates AS (
    -- The margin and the fence as scalar subqueries, judged once per tenant (the subquery
    -- kept apart, OFFSET 0): each is evaluated once, and only when a quota'd tenant asks (a
    -- claim of tenants without quotas reads neither).
    SELECT j.tenant, j.rank, j.room IS NOT NULL AND NOT j.roomy AS limited, j.roomy
    FROM (SELECT r.tenant, r.rank, r.room,
                 r.room IS NOT NULL AND r.room >= (SELECT m.margin FROM runpool.quota_margin m)
                 AND (SELECT f.held FROM fence f) AS roomy
          FROM room r
          WHERE r.room IS NULL OR r.room > 0
          OFFSET 0) j
),
chosen AS (
    -- The sorted subquery feeds the nested loop in rank order and the limit stops it: the
    -- lateral lock runs only for the quota'd candidates reached (a skipped one, not chosen,
    -- does not count toward the limit).
    SELECT c.tenant, c.rank, c.limited, c.roomy
    FROM (SELECT tenant, rank, limited, roomy FROM candidates ORDER BY rank, tenant) c
    LEFT JOIN LATERAL (
        SELECT t.tenant
        FROM runpool.tenants t
        WHERE c.limited AND t.tenant = c.tenant
        FOR NO KEY UPDATE OF t SKIP LOCKED) l ON true
    WHERE NOT c.limited OR l.tenant IS NOT NULL
    ORDER BY c.rank, c.tenant
    LIMIT %(limit)s
),
noted AS (
    -- One aggregate row: the settings are written exactly once, empty when no tenant
    -- qualifies (transaction-local: they end with the claim's COMMIT, also through
    -- PgBouncer's transaction mode).
    SELECT set_config('runpool.claim_tenants',
                      coalesce(array_agg(tenant ORDER BY tenant), '{}')::text, true) AS tenants,
           set_config('runpool.claim_limited',
                      coalesce(array_agg(tenant) FILTER (WHERE limited), '{}')::text,
                      true) AS limited,
           set_config('runpool.claim_roomy',
                      coalesce(array_agg(tenant) FILTER (WHERE roomy), '{}')::text,
                      true) AS roomy
    FROM chosen
)
SELECT tenant, limited, skipped FROM (
    SELECT c.tenant, c.tenant = ANY(n.limited::text[]) AS limited, false AS skipped, c.i
    FROM noted n CROSS JOIN LATERAL unnest(n.tenants::text[]) WITH ORDINALITY AS c(tenant, i)
    UNION ALL
    -- The quota'd tenants passed over because their row was held: the unchosen ones the walk
    -- reached (ranked ahead of the last chosen; all of them when it ran out of candidates).
    SELECT c.tenant, true, true, NULL
    FROM candidates c
    WHERE c.limited AND c.tenant NOT IN (SELECT tenant FROM chosen)
      AND ((SELECT count(*) FROM chosen) < %(limit)s
           OR (c.rank, c.tenant) < (SELECT rank, tenant FROM chosen
                                    ORDER BY rank DESC, tenant DESC LIMIT 1))
) AS answer
ORDER BY skipped, i, tenant;

-- name: claim_runs
-- Claim up to %(limit)s runs of the tenants chosen by lock_tenants earlier in the same
-- transaction (it left them in runpool.claim_tenants, and those it locked in
-- runpool.claim_limited), best rank first, within each tenant's free quota. Takes a lease in
-- database time and increments the fencing token.
-- The status change's live event is its run_events row, with the run's next seq: taken here,
-- in the same row update (so 0009's trigger, which would number and store it again, stands
-- aside: 0017), or from the run's counter row once it wrote a checkpoint (kept equal).
WITH handlers AS (
    SELECT DISTINCT unnest(%(handlers)s::text[]) AS handler
),
capacity AS MATERIALIZED (
    -- A quota is recounted under its tenant's lock, in this statement's fresh snapshot: no
    -- other claimer can add a live lease for the tenant until we commit, so it is exact. A
    -- tenant without a quota is neither locked (see lock_tenants) nor counted. A roomy one
    -- (see lock_tenants) is judged again here, in a snapshot taken after lock_tenants took
    -- the fleet fence: this is the judgement that counts. One that got a quota (its own or
    -- the default) after lock_tenants chose it unlocked, or is no longer roomy, gets nothing
    -- now: a count without the lock is not exact (two such claimers would each see the
    -- other's claim uncommitted and both take the last free slot); the next claim locks it.
    -- MATERIALIZED, and the free quota in a subquery kept apart (OFFSET 0): each tenant's
    -- live runs are counted once, not once for every mention of `live` and of `depth` (the
    -- view's count would otherwise be copied into each: 4 counts of 10,000 live runs).
    SELECT c.tenant,
           CASE WHEN c.room IS NULL THEN %(limit)s
                WHEN c.tenant = ANY(coalesce(nullif(current_setting('runpool.claim_limited',
                                                                    true), '')::text[], '{}'))
                     OR (c.tenant = ANY(coalesce(nullif(current_setting('runpool.claim_roomy',
                                                                       true), '')::text[],
                                                 '{}'))
                         AND c.room >= (SELECT m.margin FROM runpool.quota_margin m))
                THEN greatest(least(c.room, %(limit)s), 0)
                ELSE 0 END AS depth
    FROM (SELECT q.tenant, CASE WHEN q.quota IS NOT NULL THEN q.quota - q.live END AS room
          FROM runpool.tenant_capacity q
          WHERE q.tenant = ANY(nullif(current_setting('runpool.claim_tenants', true),
                                      '')::text[])
          OFFSET 0) c
),
candidates AS (
    -- How many runs the claim wants of each tenant and handler: the best %(limit)s of the
    -- tenants' heads, within each one's free quota. Only the head of each tenant's queue is
    -- read, per handler this pool serves: cost does not grow with queue depth, nor with runs
    -- of handlers nobody here serves.
    SELECT head.tenant, head.handler
    FROM capacity cap
    CROSS JOIN LATERAL (
        SELECT one.tenant, one.handler, one.rank
        FROM handlers s
        CROSS JOIN LATERAL (
            SELECT r.tenant, r.handler, r.rank
            FROM runpool.ready_runs r
            WHERE r.handler = s.handler
              AND r.tenant = cap.tenant
              AND r.available_at <= clock_timestamp()
            ORDER BY r.rank
            LIMIT cap.depth) one
        ORDER BY one.rank
        LIMIT cap.depth
    ) head
    ORDER BY head.rank
    LIMIT %(limit)s
),
wanted AS (
    SELECT tenant, handler, count(*) AS n FROM candidates GROUP BY tenant, handler
),
locked AS (
    -- Then that many of each, best rank first, locked as the index scan reaches them: a run
    -- another claimer holds (a concurrent claim of a tenant without a quota, or a cancel
    -- right now) is skipped, not waited for, and the next one taken instead; one another
    -- claimer took since this statement's snapshot fails the recheck of its latest version
    -- (no longer queued) and is passed over too. So claimers of one tenant take its runs side
    -- by side, never the same ones, and none comes back short while the queue has more.
    -- `reclaimed`: the run's latest event is the reaper's (its previous attempt's lease
    -- expired; a retry after a failure or a release is not one): one backward index probe,
    -- only for a later attempt.
    SELECT pick.id, pick.reclaimed
    FROM wanted w
    CROSS JOIN LATERAL (
        SELECT r.id,
               CASE WHEN r.attempt > 0 THEN coalesce(
                   (SELECT e.kind FROM runpool.run_events e WHERE e.run_id = r.id
                    ORDER BY e.id DESC LIMIT 1) = 'reclaimed', false)
                    ELSE false END AS reclaimed
        FROM runpool.runs r
        -- ready_runs' own conditions, spelled out: a view cannot be locked row by row here.
        WHERE r.status = 'queued' AND NOT r.held AND NOT r.deferred AND NOT r.paused
          AND r.handler = w.handler
          AND r.tenant = w.tenant
          AND r.available_at <= clock_timestamp()
          -- Past its deadline a run never starts (the deadline sweep ends it).
          AND (r.deadline IS NULL OR r.deadline > now())
        ORDER BY r.rank
        LIMIT w.n
        FOR UPDATE OF r SKIP LOCKED) pick
),
bumped AS (
    -- After the locks, in a snapshot of its own: a counter row a checkpoint write made and
    -- committed while this statement ran is seen (0020).
    SELECT b.run_id, b.seq FROM runpool._bump_event_seqs(ARRAY(SELECT id FROM locked)) b
),
claimed AS (
    UPDATE runpool.runs r SET
        status = 'running',
        attempt = r.attempt + 1,
        worker_id = %(worker_id)s,
        lease_expires_at = now() + %(lease_seconds)s * interval '1 second',
        started_at = now(),
        attempt_due = now() + r.attempt_timeout,
        event_seq = coalesce(b.seq, r.event_seq + 1)
    FROM locked LEFT JOIN bumped b ON b.run_id = locked.id
    -- The ids as an array too: a plan cannot tell how few rows `locked` holds (its LIMITs
    -- are per tenant, from the data; a generic plan knows none), and must still read runs
    -- through its primary key, never a sequential scan.
    WHERE r.id = ANY(ARRAY(SELECT id FROM locked)) AND r.id = locked.id
    RETURNING r.id, r.tenant, r.handler, r.attempt,
              runpool.attempts_used(r.attempt, r.attempt_offset) AS attempts_used,
              r.max_attempts,
              r.input, r.traceparent, r.created_at, r.serial_key, r.rank, r.budget, r.usage,
              -- Seconds until the attempt's timeout or the run's deadline, by this clock.
              extract(epoch FROM least(r.attempt_due, r.deadline) - now())::float8 AS due_in,
              locked.reclaimed,
              -- The queue wait, by this clock: since the run became claimable (created, or
              -- its retry's backoff, delay or wake-up ended) until this claim.
              greatest(extract(epoch FROM clock_timestamp() - r.available_at), 0)::float8
                  AS waited,
              r.event_seq
),
events AS (
    INSERT INTO runpool.run_events (run_id, kind, attempt, worker_id, seq, status)
    SELECT id, 'claimed', attempt, %(worker_id)s, event_seq, 'running' FROM claimed
)
SELECT id, tenant, handler, attempt, attempts_used, max_attempts, input, traceparent, created_at,
       serial_key, budget, usage, due_in, reclaimed, waited
FROM claimed
ORDER BY rank;

-- name: renew_busy
-- Renew one lease the heartbeat found busy, waiting for its row's lock: usually this worker's
-- own checkpoint write holds it (the fence's share lock) for a moment, and a run writing back
-- to back is in one nearly always, so a heartbeat that skips it may never renew it. Run alone
-- in a transaction whose lock_timeout bounds the wait (another session's open cancel may hold
-- the row much longer), holding no other row while it waits. The row is locked before its
-- lease is read, as in heartbeat; the same answer as heartbeat's renewed rows.
WITH locked AS (
    SELECT id FROM runpool.runs WHERE id = %(id)s
    FOR NO KEY UPDATE
)
UPDATE runpool.runs r SET
    lease_expires_at = now() + %(lease_seconds)s * interval '1 second'
FROM locked
WHERE r.id = locked.id
  AND r.attempt = %(attempt)s
  AND r.lease_expires_at > clock_timestamp()  -- running, and its lease not yet lost
RETURNING r.id, r.cancel_requested_at IS NOT NULL AS cancel_requested,
          CASE WHEN r.deadline <= clock_timestamp() THEN 'deadline_exceeded'
               WHEN r.attempt_due <= clock_timestamp() THEN 'timeout' END AS overdue;

-- name: heartbeat
-- Renew the leases this worker still holds (fenced by attempt) and mark the worker alive;
-- returns the runs still held and whether each has a cancel request, and, with NULL for the
-- flag, the held runs whose row someone else has locked right now (busy: not renewed, not
-- lost). A caller's open transaction (a cancel, say) is skipped, never waited for: one row
-- must not stall the leases of every run of this worker. An expired lease is not held:
-- claimers stopped counting it against the tenant's quota the moment it expired, so reviving
-- it (a worker back from a freeze) could put the tenant over its quota. The clock is read at
-- the row, after its lock, not at the statement's start. `overdue` names a run past its
-- deadline ('deadline_exceeded') or its attempt past its timeout ('timeout'): the worker stops
-- it.
WITH held AS (
    SELECT * FROM unnest(%(ids)s::uuid[], %(attempts)s::integer[]) AS h(id, attempt)
),
free AS (
    -- The rows at this worker's attempt that this statement could lock (the attempt checked
    -- on the row as locked, its latest version). Each given run is one probe of the primary
    -- key: the update below then names them as an array, joined to nothing. (A generic plan
    -- cannot tell how many runs a worker holds; joined to `held` there, it rescanned all of
    -- them for each row: 1,000 runs cost ~10^6 comparisons, ~50 ms a beat, every row
    -- locked meanwhile and every checkpoint write to them waiting.)
    SELECT r.id FROM held h
    JOIN runpool.runs r ON r.id = h.id AND r.attempt = h.attempt
    WHERE r.id = ANY(%(ids)s::uuid[])
    FOR NO KEY UPDATE OF r SKIP LOCKED
),
renewed AS (
    UPDATE runpool.runs r SET
        lease_expires_at = now() + %(lease_seconds)s * interval '1 second'
    WHERE r.id = ANY(ARRAY(SELECT id FROM free))
      AND r.lease_expires_at > clock_timestamp()  -- running, and its lease not yet lost
    RETURNING r.id, r.cancel_requested_at IS NOT NULL AS cancel_requested,
              CASE WHEN r.deadline <= clock_timestamp() THEN 'deadline_exceeded'
                   WHEN r.attempt_due <= clock_timestamp() THEN 'timeout' END AS overdue
),
alive AS (
    UPDATE runpool.workers SET last_seen_at = now() WHERE id = %(worker_id)s
)
SELECT id, cancel_requested, overdue FROM renewed
UNION ALL
SELECT r.id, NULL, NULL
FROM runpool.runs r
JOIN held ON r.id = held.id AND r.attempt = held.attempt
WHERE r.id = ANY(%(ids)s::uuid[]) AND r.lease_expires_at IS NOT NULL
  AND r.id NOT IN (SELECT id FROM free);

-- name: heal_serial_keys
-- Give every headless serial key its head (0006: a release that found its key locked by a
-- caller's open transaction leaves the key to this sweep).
SELECT runpool.heal_serial_keys();

-- name: defer_serial_release
-- Until lock_ended_serial_keys, this transaction releases the serial keys it ends itself, in
-- one statement, instead of the per-row trigger (see 0002's _serial_key_ended): W10 +20 %.
-- The statements below find the runs it ended by xmin: no savepoint may come in between.
SELECT set_config('runpool.release', pg_current_xact_id()::text, true);

-- name: lock_ended_serial_keys
-- Take, shared, the commit lock (0006) of each serial key whose head this transaction ended
-- (the rows it wrote last: xmin); then the trigger is in charge again. Never waits: a key whose
-- commit lock is taken exclusively right now (an enqueue's commit check) is left to
-- heal_serial_keys, so one key can never hold the outcomes of a whole batch hostage, and a
-- caller's open transaction holding the key's enqueue lock does not matter (see 0006).
SELECT set_config('runpool.release', '', true), (
    SELECT count(*) FILTER (WHERE pg_try_advisory_xact_lock_shared(
               runpool.serial_commit_lock(k.tenant, k.serial_key)))
    FROM (SELECT DISTINCT r.tenant, r.serial_key
          FROM runpool.runs r
          WHERE r.id = ANY(%(ids)s::uuid[])
            AND r.serial_key IS NOT NULL
            AND r.status IN ('succeeded', 'failed', 'cancelled')
            AND r.xmin = pg_current_xact_id()::xid
          ORDER BY 1, 2) k
) AS locked;

-- name: release_serial_keys
-- Release the next waiting run of each of those keys whose commit lock it holds: a statement
-- of its own, after the locks, so it sees every enqueue committed before they were granted.
-- A waiting run locked by someone else (a cancel_run of it in flight: it is leaving the line)
-- is passed over for the next, never waited for.
UPDATE runpool.runs r SET held = false
WHERE r.held AND r.id IN (
    SELECT (SELECT w.id FROM runpool.runs w
            WHERE w.tenant = k.tenant AND w.serial_key = k.serial_key AND w.held
            ORDER BY w.serial_order LIMIT 1 FOR UPDATE SKIP LOCKED)
    FROM (SELECT DISTINCT e.tenant, e.serial_key
          FROM runpool.runs e
          WHERE e.id = ANY(%(ids)s::uuid[])
            AND e.serial_key IS NOT NULL
            AND e.status IN ('succeeded', 'failed', 'cancelled')
            AND e.xmin = pg_current_xact_id()::xid) k
    -- Only the keys whose commit lock this transaction holds (granted again at once).
    WHERE pg_try_advisory_xact_lock_shared(runpool.serial_commit_lock(k.tenant, k.serial_key))
);

-- name: finish_runs
-- Record finished attempts in one statement, each fenced by its attempt: succeeded, failed,
-- cancelled, or retry (queued again after its backoff, or failed when the budget is spent).
-- A run whose row someone else holds right now (an API session's open cancel_run, say) is
-- skipped, never waited for, and answered 'busy': the writer submits it again, so one caller
-- cannot hold a whole batch of outcomes hostage. Each status change stores its live event in
-- its run_events row, numbered here (see 0017 and claim_runs); an ended run rings its doorbell.
WITH outcome AS (
    SELECT *
    FROM unnest(%(ids)s::uuid[], %(attempts)s::integer[], %(outcomes)s::text[],
                %(results)s::jsonb[], %(errors)s::jsonb[], %(delays)s::double precision[])
         AS o(id, attempt, outcome, result, error, delay)
),
free AS (
    -- The row as locked: its latest version, not this statement's snapshot of it. The
    -- outcome is decided on it, and only on it: reading the runs again by status would have
    -- the generic plan scan every running run of the fleet (2,000 in W11) for each batch.
    SELECT r.id, r.attempt, r.status, r.priority, r.cancel_requested_at, r.attempt_offset,
           r.max_attempts
    -- By the ids themselves: with `id IN (SELECT id FROM outcome)` a generic plan, which
    -- cannot tell how few ids a batch holds, may hash them against all of `runs`.
    FROM runpool.runs r
    WHERE r.id = ANY(%(ids)s::uuid[])
    FOR NO KEY UPDATE OF r SKIP LOCKED
),
decided AS (
    -- Exactly the runs `done` updates: held by this statement, running at that attempt.
    SELECT o.*, f.priority,
           CASE
               WHEN o.outcome <> 'retry' THEN o.outcome
               -- A cancel requested while the attempt failed ends the run; it does not retry.
               WHEN f.cancel_requested_at IS NOT NULL THEN 'cancelled'
               WHEN runpool.attempts_used(f.attempt, f.attempt_offset) >= f.max_attempts THEN 'failed'
               ELSE 'queued'
           END AS status
    FROM outcome o
    JOIN free f ON f.id = o.id AND f.attempt = o.attempt AND f.status = 'running'
),
bumped AS (
    -- The counters of exactly the runs `done` updates (a counter taken for a run left
    -- unchanged would leave a gap after its last event, and a follower would wait for it);
    -- after the locks, in a snapshot of its own (0020).
    SELECT b.run_id, b.seq FROM runpool._bump_event_seqs(ARRAY(SELECT id FROM decided)) b
),
done AS (
    UPDATE runpool.runs r SET
        status = d.status,
        result = d.result,
        error = d.error,
        lease_expires_at = NULL,
        finished_at = CASE WHEN d.status = 'queued' THEN NULL ELSE now() END,
        available_at = CASE WHEN d.status = 'queued'
                            THEN now() + d.delay * interval '1 second' ELSE r.available_at END,
        -- A backoff keeps the run out of the claim's index until promote_due.
        deferred = d.status = 'queued' AND d.delay > 0,
        -- A retry is a new arrival: it ages from the end of its backoff.
        rank = CASE WHEN d.status = 'queued'
                    THEN runpool.rank(now() + d.delay * interval '1 second', d.priority,
                                      (SELECT aging_seconds FROM runpool.config))
                    ELSE r.rank END,
        event_seq = coalesce(b.seq, r.event_seq + 1)
    FROM decided d LEFT JOIN bumped b ON b.run_id = d.id
    -- `decided` holds only rows `free` locked while running at that attempt.
    WHERE r.id = ANY(%(ids)s::uuid[]) AND r.id = d.id AND r.attempt = d.attempt
    RETURNING r.id, r.attempt, r.status, r.worker_id, r.error, r.event_seq,
              CASE r.status WHEN 'cancelled' THEN coalesce(r.cancel_reason, r.error ->> 'reason')
                            WHEN 'failed' THEN r.error ->> 'reason'
                            WHEN 'queued' THEN coalesce(r.error ->> 'reason', 'retry') END
                  AS reason
),
events AS (
    INSERT INTO runpool.run_events (run_id, kind, attempt, worker_id, detail, seq, status, reason)
    SELECT id, CASE status WHEN 'queued' THEN 'retry_scheduled' ELSE status END,
           attempt, worker_id, error, event_seq, status, reason
    FROM done
),
rung AS (
    SELECT count(runpool._ring(id)) AS ended FROM done WHERE status <> 'queued'
)
-- Each answer names its attempt: a batch may hold an earlier attempt's outcome (its lease
-- lost while it waited to be written) beside the outcome of the attempt that holds the run.
SELECT id, attempt, status FROM done CROSS JOIN rung
UNION ALL
-- Asked per outcome left out of `free` (usually none), through the primary key.
SELECT o.id, o.attempt, 'busy'
FROM outcome o
WHERE o.id NOT IN (SELECT id FROM free)
  AND (SELECT r.lease_expires_at IS NOT NULL FROM runpool.runs r
       WHERE r.id = o.id AND r.attempt = o.attempt);

-- name: release_runs
-- Give leases back at once (a draining worker): the runs are claimable immediately and the
-- released attempt does not count against max_attempts. Each status change stores its live
-- event in its run_events row, numbered here (see 0017 and claim_runs).
WITH held AS (
    SELECT * FROM unnest(%(ids)s::uuid[], %(attempts)s::integer[]) AS h(id, attempt)
),
mine AS (
    -- Held until commit, checked again as locked: exactly the runs `released` updates (a
    -- counter taken for a run left unchanged would leave a gap a follower waits for).
    SELECT r.id FROM runpool.runs r
    JOIN held ON r.id = held.id AND r.attempt = held.attempt
    WHERE r.id = ANY(%(ids)s::uuid[]) AND r.lease_expires_at IS NOT NULL
    FOR NO KEY UPDATE OF r
),
bumped AS (
    -- After the locks, in a snapshot of its own (0020).
    SELECT b.run_id, b.seq FROM runpool._bump_event_seqs(ARRAY(SELECT id FROM mine)) b
),
released AS (
    UPDATE runpool.runs r SET
        status = CASE WHEN r.cancel_requested_at IS NOT NULL THEN 'cancelled' ELSE 'queued' END,
        finished_at = CASE WHEN r.cancel_requested_at IS NOT NULL THEN now() END,
        attempt_offset = r.attempt_offset + 1,
        lease_expires_at = NULL,
        available_at = now(),
        deferred = false,
        event_seq = coalesce(b.seq, r.event_seq + 1)
    FROM mine LEFT JOIN bumped b ON b.run_id = mine.id
    WHERE r.id = mine.id
    RETURNING r.id, r.attempt, r.status, r.event_seq,
              CASE WHEN r.status = 'cancelled'
                   THEN coalesce(r.cancel_reason, r.error ->> 'reason') ELSE 'released' END
                  AS reason
),
events AS (
    INSERT INTO runpool.run_events (run_id, kind, attempt, worker_id, detail, seq, status, reason)
    SELECT id, CASE status WHEN 'queued' THEN 'released' ELSE status END, attempt,
           %(worker_id)s, '{"reason": "worker_shutdown"}'::jsonb, event_seq, status, reason
    FROM released
)
SELECT count(*) AS released, pg_notify('runpool_wakeup', '') AS rang,
       count(runpool._ring(id)) FILTER (WHERE status = 'cancelled') AS ended
FROM released;

-- name: register_worker
-- Announce a worker process and the handlers it serves (explain_run reads them).
INSERT INTO runpool.workers (id, host, pid, concurrency, handlers)
VALUES (%(worker_id)s, %(host)s, %(pid)s, %(concurrency)s, %(handlers)s);

-- name: update_config
-- Apply pool-wide settings given explicitly to this pool (NULL leaves a value unchanged).
UPDATE runpool.config SET
    aging_seconds = coalesce(%(aging_seconds)s, aging_seconds),
    default_max_attempts = coalesce(%(max_attempts)s, default_max_attempts),
    default_quota = CASE WHEN %(set_quota)s THEN %(default_quota)s ELSE default_quota END,
    max_input_bytes = coalesce(%(max_input_bytes)s, max_input_bytes);

-- name: fence_fleet
-- Wait for every claim that may have judged a tenant roomy without this worker's slots (see
-- "Roomy tenants" at lock_tenants): a worker takes the fleet fence in exclusive mode once,
-- after its registration committed and before its first claim.
SELECT pg_advisory_xact_lock(1920298608, 25);

-- name: touch_worker
-- Mark a worker alive (idle workers do it inside their poll's claim transaction).
UPDATE runpool.workers SET last_seen_at = now() WHERE id = %(worker_id)s;

-- name: stop_worker
-- Mark a worker as stopped on a clean exit.
UPDATE runpool.workers SET stopped_at = now(), last_seen_at = now() WHERE id = %(worker_id)s;

-- name: read_cancel_flags
-- Which of these runs, still held at this attempt, have a cancel request (re-read on NOTIFY).
SELECT r.id
FROM runpool.runs r
JOIN unnest(%(ids)s::uuid[], %(attempts)s::integer[]) AS h(id, attempt)
  ON r.id = h.id AND r.attempt = h.attempt
WHERE r.id = ANY(%(ids)s::uuid[]) AND r.lease_expires_at IS NOT NULL
  AND r.cancel_requested_at IS NOT NULL;

-- name: confirm_cancel_notices
-- Which of these runs are held with a cancel request (the host relay passes on only those).
SELECT r.id
FROM runpool.runs r
WHERE r.id = ANY(%(ids)s::uuid[]) AND r.lease_expires_at IS NOT NULL
  AND r.cancel_requested_at IS NOT NULL;

-- name: purge_turn
-- This pool's turn at the background purge (see 0015_ops): NULL when it is not its turn, else
-- the runs one batch removed.
SELECT runpool._purge_turn(make_interval(secs => %(older_than)s), %(batch_size)s,
                           make_interval(secs => %(every)s))
