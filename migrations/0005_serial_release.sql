-- 0005_serial_release: the serial-key release that the worker's outcome writer can take over.
-- A migration of its own, not an edit of 0002: a worker whose outcome writer releases keys
-- set-based must never meet the older trigger (both would release, and a key would get two
-- heads), and the migration number is what a worker checks before it starts.

-- When a key's head (its one run not held) ends — finish, reap, release, cancel, even a manual
-- UPDATE — release the next waiting run of its key. A held run that ends (cancelled in the
-- middle of the line) releases nothing: the head is still there. A row trigger whose WHEN
-- clause is checked before any function call, so unkeyed runs pay nothing. The key's lock
-- comes first and the release is a statement of its own, so it sees every enqueue committed
-- before the lock was granted. A transaction that sets runpool.release to its own transaction
-- id (the worker's outcome writer, see queries.sql) releases the keys it ends itself,
-- set-based; a value left in a session by anyone else can never match.
CREATE OR REPLACE FUNCTION runpool._serial_key_ended() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = runpool, pg_catalog, pg_temp
AS $$
BEGIN
    -- _lock_serial_key's lock, spelled out: a nested SECURITY DEFINER call per ended run cost
    -- W10 a sixth of its throughput.
    PERFORM pg_advisory_xact_lock(hashtextextended(NEW.tenant || chr(31) || NEW.serial_key,
                                                   7370));
    -- At most one run of a key is ever not held (enqueue, retry_run and this release all
    -- decide under the key's lock), so the head that ended was the only one. FOR UPDATE: a
    -- waiting run being cancelled right now (cancel_run takes no key lock) is waited for and,
    -- if it was cancelled, passed over for the next one.
    UPDATE runpool.runs r SET held = false
    WHERE r.id = (SELECT w.id FROM runpool.runs w
                  WHERE w.tenant = NEW.tenant AND w.serial_key = NEW.serial_key AND w.held
                  ORDER BY w.serial_order LIMIT 1 FOR UPDATE)
      AND r.held;
    -- A worker ending a run claims again right away; anyone else (an API cancelling a run,
    -- say) rings the doorbell so the released run starts now rather than at the next poll.
    IF FOUND AND current_setting('runpool.session', true) IS DISTINCT FROM 'worker' THEN
        PERFORM pg_notify('runpool_wakeup', '');
    END IF;
    RETURN NULL;
END
$$;

DROP TRIGGER serial_key_ended ON runpool.runs;
CREATE TRIGGER serial_key_ended
AFTER UPDATE OF status ON runpool.runs
FOR EACH ROW
WHEN (NEW.serial_key IS NOT NULL
      AND NEW.status IN ('succeeded', 'failed', 'cancelled')
      AND OLD.status IN ('queued', 'running')
      AND NOT OLD.held
      AND current_setting('runpool.release', true) IS DISTINCT FROM pg_current_xact_id()::text)
EXECUTE FUNCTION runpool._serial_key_ended();
