-- A key a stopping worker handed back (error 'handed back', see give_back) and claimed
-- again is recorded as 'handed_back', not 'taken_over': a rolling deploy is not trouble.
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
        INSERT INTO dedupe_claim_events (scope, key, event, token, owner, attempts, detail)
        VALUES (NEW.scope, NEW.key, 'failed', NEW.token, NEW.owner, NEW.attempts, NEW.error);
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
