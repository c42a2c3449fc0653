-- A failure's reason (dedupe.claims.records.Reason, the dead letter's x-dedupe-reason) gets a
-- column of its own; `error` keeps the detail alone. Both used to be written into `error` as
-- 'reason: detail' and split apart again where the dead letter was sent once more, which read
-- an error written without a reason as handler_error with its first words cut off.
-- Workers of an earlier version still write 'reason: detail' into `error`: stop them before this
-- migration runs (a failure one writes afterwards reads as handler_error with that whole text as
-- its detail). Adding a NULL column rewrites nothing; the backfill scans the table once and
-- rewrites the rows written in the old form (failed ones: few).
ALTER TABLE dedupe_claims ADD COLUMN reason text;
-- Events record a failure's reason beside its detail too (claims show, the status page).
ALTER TABLE dedupe_claim_events ADD COLUMN reason text;

-- The old form is split where its prefix is a reason a worker could write; any other error (a
-- retried attempt's 'ValueError: ...', 'handed back') is left whole, with no reason.
UPDATE dedupe_claims
   SET reason = split_part(error, ': ', 1), error = substr(error, strpos(error, ': ') + 2)
 WHERE strpos(error, ': ') > 0
   AND split_part(error, ': ', 1) IN ('key_conflict', 'missing_key', 'invalid_key',
                                      'invalid_payload', 'max_attempts_exceeded', 'rejected',
                                      'handler_error', 'no_handler');
UPDATE dedupe_claim_events
   SET reason = split_part(detail, ': ', 1), detail = substr(detail, strpos(detail, ': ') + 2)
 WHERE event = 'failed' AND strpos(detail, ': ') > 0
   AND split_part(detail, ': ', 1) IN ('key_conflict', 'missing_key', 'invalid_key',
                                       'invalid_payload', 'max_attempts_exceeded', 'rejected',
                                       'handler_error', 'no_handler');

-- The history trigger's function (0005's) with the failure's reason in its 'failed' event.
CREATE OR REPLACE FUNCTION dedupe_claim_history() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.token <> OLD.token THEN
        INSERT INTO dedupe_claim_events (scope, key, event, token, owner, attempts, detail)
        VALUES (NEW.scope, NEW.key,
                CASE WHEN OLD.status = 'in_progress' AND OLD.error = 'handed back'
                         THEN 'handed_back'
                     WHEN OLD.status = 'in_progress' THEN 'taken_over'
                     ELSE 'reclaimed' END,
                NEW.token, NEW.owner, NEW.attempts, 'from ' || OLD.owner || ' (' || OLD.status || ')');
    ELSIF NEW.attempts > OLD.attempts THEN
        INSERT INTO dedupe_claim_events (scope, key, event, token, owner, attempts, detail)
        VALUES (NEW.scope, NEW.key, 'attempt', NEW.token, NEW.owner, NEW.attempts, NEW.error);
    END IF;
    IF NEW.status = 'failed' AND OLD.status <> 'failed' THEN
        INSERT INTO dedupe_claim_events (scope, key, event, token, owner, attempts, reason, detail)
        VALUES (NEW.scope, NEW.key, 'failed', NEW.token, NEW.owner, NEW.attempts, NEW.reason,
                NEW.error);
    END IF;
    IF NEW.retryable AND NOT OLD.retryable THEN
        INSERT INTO dedupe_claim_events (scope, key, event, token, owner, attempts, detail)
        VALUES (NEW.scope, NEW.key, 'released', NEW.token, NEW.owner, OLD.attempts,
                'was ' || OLD.status);
    END IF;
    IF NEW.dead_lettered_at IS NOT NULL AND OLD.dead_lettered_at IS NULL THEN
        INSERT INTO dedupe_claim_events (scope, key, event, token, owner, attempts, detail)
        VALUES (NEW.scope, NEW.key, 'dead_lettered', NEW.token, NEW.owner, NEW.attempts, NULL);
    END IF;
    RETURN NULL;
END
$$;
