-- Operations (issue 18): dead-letter alerts in batches, and a claim plan that does not read the
-- whole runs table.

-- == Dead-letter alerts in batches (runpool/alerts.py) ============================================

-- A sender takes each tenant's oldest due alerts together, so a tenant failing 10,000 runs is
-- posted in batches rather than 10,000 posts, and the tenants with the oldest due alert go
-- first, so a flood delays nobody else.

-- Undelivered alerts by tenant, then due time: the sender walks the tenants with a due alert
-- (one index probe each, skipping from tenant to tenant) and takes each one's oldest; the
-- alerts_due index (by due time alone) would read a whole flood to find the other tenants.
CREATE INDEX alerts_due_by_tenant ON runpool.alerts (tenant, next_at) WHERE delivered_at IS NULL;

-- == The claim's plan no longer grows with the runs table =======================================

-- tenant_capacity (0008) cross-joined the one-row config table, which is never analysed (it
-- never changes enough for autovacuum to analyse it), so the planner took it for 1,660 rows
-- and multiplied every estimate of the claim by that. The workers' generic plans then judged
-- hundreds of thousands of candidate runs likely and joined them to runs by hashing a
-- sequential scan of the whole table, twice a claim, whenever the queue was more than a few
-- per cent of the table (one claim's buffers, 4,000 queued among 20,000 runs: 1,436; among
-- 50,000: 1,912; 40,000 among 200,000: 6,463; with this and the claim's array probe: 266, 300,
-- 312).
-- The default quota as a scalar subquery multiplies nothing: the probes stay index probes
-- whatever the table holds (tests/test_rules.py). Same columns, same meaning (the config row
-- always exists: 0001 inserts it and nothing deletes it).
CREATE OR REPLACE VIEW runpool.tenant_capacity AS
SELECT t.tenant,
       coalesce(t.max_running, (SELECT c.default_quota FROM runpool.config c)) AS quota,
       (SELECT count(*) FROM runpool.runs l
        WHERE l.tenant = t.tenant AND l.status = 'running' AND l.lease_expires_at > now()) AS live
FROM runpool.tenants t;
