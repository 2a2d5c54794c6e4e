-- Operations (issue 18): dead-letter alerts in batches, and tenant_capacity without a
-- mis-estimate that made the claim of 0016 read the whole runs table.

-- == Dead-letter alerts in batches (runpool/alerts.py) ============================================

-- A sender takes each tenant's oldest due alerts together, so a tenant failing 10,000 runs is
-- posted in batches rather than 10,000 posts, and the tenants with the oldest due alert go
-- first, so a flood delays nobody else.

-- Undelivered alerts by tenant, then due time: the sender walks the tenants with a due alert
-- (one index probe each, skipping from tenant to tenant) and takes each one's oldest; the
-- alerts_due index (by due time alone) would read a whole flood to find the other tenants.
CREATE INDEX alerts_due_by_tenant ON runpool.alerts (tenant, next_at) WHERE delivered_at IS NULL;

-- == tenant_capacity without the 1,660 rows of a one-row table =================================

-- tenant_capacity (0008) cross-joined the one-row config table, which is never analysed (it
-- never changes enough for autovacuum to analyse it), so the planner took it for 1,660 rows
-- and multiplied by that every estimate of a statement reading the view. With the claim of
-- 0016 the workers' generic plans then hashed a sequential scan of runs, twice a claim,
-- whenever the queue was more than a few per cent of the table (the soak of issue 18: 1,365 to
-- 1,388 buffers a claim; docs/claim_plan_cost.py, 4,000 queued among 50,000 runs: 1,918; 40,000
-- among 200,000: 6,460). The claim herd (queries.sql) locks its picks by index scan and no
-- longer does, with or without this; the estimates of lock_tenants, claim_runs' capacity and
-- explain_run are still multiplied by a row count nobody has. The default quota as a scalar
-- subquery multiplies nothing (tests/test_rules.py checks the generic plans read runs only
-- through indexes). Same columns, same meaning: the config row always exists (0001 inserts it
-- and nothing deletes it).
CREATE OR REPLACE VIEW runpool.tenant_capacity AS
SELECT t.tenant,
       coalesce(t.max_running, (SELECT c.default_quota FROM runpool.config c)) AS quota,
       (SELECT count(*) FROM runpool.runs l
        WHERE l.tenant = t.tenant AND l.status = 'running' AND l.lease_expires_at > now()) AS live
FROM runpool.tenants t;
