-- Key-level insight for operators (dedupe-worker claims show, the status page, tracing).

-- The trace of the run that completed the key (OpenTelemetry, 32 hex digits), so that a
-- duplicate's span can point at the run that did the work. Written only where tracing is on.
ALTER TABLE dedupe_claims ADD COLUMN trace_id text;

-- A claim's history: the rare events only (take-overs, retries, failures, releases, dead
-- letters, conflicts). A completion writes no event: that would double the cost of the hot
-- path, and the claim row itself says when and by whom it completed.
CREATE TABLE dedupe_claim_events (
    id        bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    scope     text        NOT NULL,
    key       text        NOT NULL,
    at        timestamptz NOT NULL DEFAULT now(),
    event     text        NOT NULL,
    token     bigint,
    owner     text,
    attempts  integer,
    detail    text
);
CREATE INDEX dedupe_claim_events_key_idx ON dedupe_claim_events (scope, key, at);
CREATE INDEX dedupe_claim_events_at_idx ON dedupe_claim_events (at);

-- Events are written by a trigger, so every writer (workers, receivers, operators, an old
-- worker that knows nothing of this table) records them. Its WHEN clause is evaluated in
-- the executor without calling the function: a heartbeat or a completion costs nothing more.
CREATE FUNCTION dedupe_claim_history() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.token <> OLD.token THEN
        INSERT INTO dedupe_claim_events (scope, key, event, token, owner, attempts, detail)
        VALUES (NEW.scope, NEW.key,
                CASE WHEN OLD.status = 'in_progress' THEN 'taken_over' ELSE 'reclaimed' END,
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

CREATE TRIGGER dedupe_claims_history AFTER UPDATE ON dedupe_claims FOR EACH ROW
    WHEN (NEW.token <> OLD.token
          OR NEW.attempts > OLD.attempts
          OR (NEW.status = 'failed' AND OLD.status <> 'failed')
          OR (NEW.retryable AND NOT OLD.retryable)
          OR (NEW.dead_lettered_at IS NOT NULL AND OLD.dead_lettered_at IS NULL))
    EXECUTE FUNCTION dedupe_claim_history();

-- A claim's events go with it when clean-up (or an operator's purge) deletes it: one
-- statement per deleted batch, through the transition table.
CREATE FUNCTION dedupe_claim_history_gc() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    DELETE FROM dedupe_claim_events e USING gone g WHERE e.scope = g.scope AND e.key = g.key;
    RETURN NULL;
END
$$;

CREATE TRIGGER dedupe_claims_history_gc AFTER DELETE ON dedupe_claims
    REFERENCING OLD TABLE AS gone FOR EACH STATEMENT
    EXECUTE FUNCTION dedupe_claim_history_gc();

-- Per scope, what the claims table cannot tell: duplicates suppressed and conflicts seen.
-- Workers and receivers add their counts every few seconds (not per message).
CREATE TABLE dedupe_scope_counts (
    scope        text        PRIMARY KEY,
    duplicates   bigint      NOT NULL DEFAULT 0,
    conflicts    bigint      NOT NULL DEFAULT 0,
    updated_at   timestamptz NOT NULL DEFAULT now()
);
