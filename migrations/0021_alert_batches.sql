-- Dead-letter alerts in batches (runpool/alerts.py): a sender takes each tenant's oldest due
-- alerts together, so a tenant failing 10,000 runs is posted in batches rather than 10,000
-- posts, and the tenants with the oldest due alert go first, so a flood delays nobody else.

-- Undelivered alerts by tenant, then due time: the sender walks the tenants with a due alert
-- (one index probe each, skipping from tenant to tenant) and takes each one's oldest; the
-- alerts_due index (by due time alone) would read a whole flood to find the other tenants.
CREATE INDEX alerts_due_by_tenant ON runpool.alerts (tenant, next_at) WHERE delivered_at IS NULL;
