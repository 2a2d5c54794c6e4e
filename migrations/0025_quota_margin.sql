-- 0025_quota_margin: how far under its quota a tenant must be for a claim to take its runs
-- without locking its row (see "Roomy tenants" in runpool/queries.sql).
--
-- Why: a quota is exact because the claim recounts it under the tenant's row lock, held until
-- the claim commits; two workers claiming from one quota'd tenant therefore took turns, the
-- second skipping it and retrying 5 ms later (the peer harness's W1 sets a quota of 100,000:
-- 797 of 2,797 claims came back empty and the 2 x 10 drain lost a quarter to it). A tenant
-- whose free quota covers every run the whole fleet could hold cannot be pushed over by any
-- set of concurrent claims, so there the lock buys nothing.
--
-- The margin: twice the slots of every worker not marked stopped. A worker holds at most its
-- concurrency in slots, plus (for one outcome batch) the runs whose outcome a held row turned
-- away while the batch's refill took their slots: at most twice its concurrency. Rows of
-- workers that died unannounced stay counted until the retention purge removes them, which
-- only makes the margin larger (a claim then locks, as before this migration).

-- A worker registers with 1 to 10,000 slots (Settings); a row saying fewer than 1 (written by
-- hand, or by a login with the worker role) would shrink the margin below what the fleet
-- holds. NOT VALID: rows already there are not scanned (none can say so through runpool).
ALTER TABLE runpool.workers
    ADD CONSTRAINT concurrency_positive CHECK (concurrency >= 1) NOT VALID;

CREATE VIEW runpool.quota_margin AS
SELECT 2 * coalesce(sum(w.concurrency), 0)::bigint AS margin
FROM runpool.workers w
WHERE w.stopped_at IS NULL;

GRANT SELECT ON runpool.quota_margin TO runpool_api, runpool_worker;
