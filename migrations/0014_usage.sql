-- 0014_usage: what each tenant spent, by the hour (issue 17: "status and the console show usage
-- per tenant over the window").
--
-- runs.usage (0012) holds a run's totals; summing it over a tenant's runs of a window reads
-- every run of the window (a million runs a day is a million rows per refresh). Instead every
-- change of runs.usage adds its difference to the tenant's bucket of the hour it happened in,
-- in the same transaction (a trigger: whoever writes usage — record_usage, an operator's
-- UPDATE — is counted, and a rolled back write counts nothing). Reading a tenant's day is then
-- at most 25 hours x 8 shards of one index range, whatever the traffic.
--
-- Shards: every record_usage of a tenant's runs in one hour would otherwise update one row,
-- and its lock is held to each writer's commit — a tenant with a thousand runs recording usage
-- would queue them all behind one row. A run always writes to the shard its id picks (8 of
-- them): concurrent writers of one tenant collide one time in eight.
CREATE TABLE runpool.tenant_usage (
    tenant        text NOT NULL,
    -- The start of the hour (UTC, whatever the session's time zone).
    hour          timestamptz NOT NULL,
    shard         smallint NOT NULL CONSTRAINT shard_range CHECK (shard BETWEEN 0 AND 7),
    -- Runs whose first usage was recorded in this hour.
    runs          bigint NOT NULL DEFAULT 0,
    input_tokens  bigint NOT NULL DEFAULT 0,
    output_tokens bigint NOT NULL DEFAULT 0,
    cost          numeric NOT NULL DEFAULT 0,
    tool_calls    bigint NOT NULL DEFAULT 0,
    turns         bigint NOT NULL DEFAULT 0,
    PRIMARY KEY (tenant, hour, shard)
);

-- Add a change of a run's usage to its tenant's hour.
CREATE FUNCTION runpool._roll_usage() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, runpool, pg_temp
AS $$
DECLARE
    was jsonb := coalesce(OLD.usage, '{}');
    now_ jsonb := coalesce(NEW.usage, '{}');
BEGIN
    INSERT INTO runpool.tenant_usage AS u (tenant, hour, shard, runs, input_tokens,
                                           output_tokens, cost, tool_calls, turns)
    VALUES (NEW.tenant, date_bin('1 hour', now(), timestamptz '2000-01-01 00:00:00+00'),
            get_byte(uuid_send(NEW.id), 15) & 7,
            CASE WHEN OLD.usage IS NULL THEN 1 ELSE 0 END,
            coalesce((now_ ->> 'input_tokens')::bigint, 0)
                - coalesce((was ->> 'input_tokens')::bigint, 0),
            coalesce((now_ ->> 'output_tokens')::bigint, 0)
                - coalesce((was ->> 'output_tokens')::bigint, 0),
            coalesce((now_ ->> 'cost')::numeric, 0) - coalesce((was ->> 'cost')::numeric, 0),
            coalesce((now_ ->> 'tool_calls')::bigint, 0)
                - coalesce((was ->> 'tool_calls')::bigint, 0),
            coalesce((now_ ->> 'turns')::bigint, 0) - coalesce((was ->> 'turns')::bigint, 0))
    ON CONFLICT (tenant, hour, shard) DO UPDATE SET
        runs = u.runs + excluded.runs,
        input_tokens = u.input_tokens + excluded.input_tokens,
        output_tokens = u.output_tokens + excluded.output_tokens,
        cost = u.cost + excluded.cost,
        tool_calls = u.tool_calls + excluded.tool_calls,
        turns = u.turns + excluded.turns;
    RETURN NULL;
END
$$;

-- Only writes of usage fire it (claims, heartbeats and outcomes never name the column).
CREATE TRIGGER usage_rollup
AFTER UPDATE OF usage ON runpool.runs
FOR EACH ROW
WHEN (NEW.usage IS DISTINCT FROM OLD.usage)
EXECUTE FUNCTION runpool._roll_usage();

-- A tenant's spending over a window: the hours it touches, summed.
CREATE FUNCTION runpool.tenant_usage_since(since timestamptz)
RETURNS TABLE (tenant text, runs bigint, input_tokens bigint, output_tokens bigint,
               cost numeric, tool_calls bigint, turns bigint)
LANGUAGE sql STABLE SECURITY DEFINER SET search_path = pg_catalog, runpool, pg_temp
BEGIN ATOMIC
    SELECT u.tenant, sum(u.runs)::bigint, sum(u.input_tokens)::bigint,
           sum(u.output_tokens)::bigint, sum(u.cost), sum(u.tool_calls)::bigint,
           sum(u.turns)::bigint
    FROM runpool.tenant_usage u
    WHERE u.hour >= date_bin('1 hour', since, timestamptz '2000-01-01 00:00:00+00')
    GROUP BY u.tenant;
END;

REVOKE ALL ON FUNCTION runpool._roll_usage(), runpool.tenant_usage_since(timestamptz) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION runpool.tenant_usage_since(timestamptz) TO runpool_api, runpool_worker;
GRANT SELECT ON runpool.tenant_usage TO runpool_api, runpool_worker;

-- What runs already spent before this migration counts in the hour it is applied.
INSERT INTO runpool.tenant_usage (tenant, hour, shard, runs, input_tokens, output_tokens, cost,
                                  tool_calls, turns)
SELECT r.tenant, date_bin('1 hour', now(), timestamptz '2000-01-01 00:00:00+00'),
       get_byte(uuid_send(r.id), 15) & 7, count(*),
       sum(coalesce((r.usage ->> 'input_tokens')::bigint, 0)),
       sum(coalesce((r.usage ->> 'output_tokens')::bigint, 0)),
       sum(coalesce((r.usage ->> 'cost')::numeric, 0)),
       sum(coalesce((r.usage ->> 'tool_calls')::bigint, 0)),
       sum(coalesce((r.usage ->> 'turns')::bigint, 0))
FROM runpool.runs r
WHERE r.usage IS NOT NULL
GROUP BY 1, 2, 3;
