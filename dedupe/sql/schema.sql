-- The whole schema of dedupe-worker, in one file to read top to bottom.
--
-- What builds a database is the numbered migrations beside this file (migrations/NNNN_*.sql),
-- applied in order by `dedupe-worker migrate` (dedupe/claims/database.py). This file is the
-- schema they build today, written as if it were made in one go: the place to learn what each
-- table and column is for. tests/integration/test_schema.py builds one database with the
-- migrations and another with this file and fails when their catalogs differ, so a migration
-- comes with its change here, and a change here with its migration. Only the order of a
-- table's columns may differ: here they are grouped by what they are for, where a migrated
-- table has them in the order the migrations added them.
--
-- It also records the migrations it stands for in the runner's bookkeeping table (at the end),
-- so a database made from this file (`psql -f schema.sql`) is one that `dedupe-worker migrate`
-- finds up to date, and later migrations apply to it as to any other.
--
-- Times come from the database's now(), never from a worker's clock. Every name starts with
-- `dedupe_`, so the tables can live beside a handler's own ones (its `ctx.db` writes commit in
-- the same transaction as its claim's completion).


-- == Claims ==================================================================================

-- Fencing tokens: one database-wide sequence drawn on every claim and take-over, so a token is
-- never issued twice (a row deleted by clean-up or `claims purge` and claimed again used to
-- restart at 1, and a zombie still holding 1 passed the fence). It belongs to no column, so
-- recreating the claims table (docs/operations.md: partitioning) keeps it.
CREATE SEQUENCE dedupe_claim_tokens AS bigint;

-- One row per (scope, key): the claim of an idempotency key and, once the run is over, its
-- outcome, kept until expires_at. Uniqueness is the primary key's job: a claim is an INSERT
-- ... ON CONFLICT (claim_batch in queries.sql), never a SELECT then an INSERT.
CREATE TABLE dedupe_claims (
    -- The key. scope is the handler's name (or a webhook source), with `/<tenant>` when the
    -- handler is scoped per tenant; `claims list --handler` finds a scope and its tenants.
    scope             text        NOT NULL,
    key               text        NOT NULL,

    -- What "the same payload" means is the handler's fingerprint (dedupe/claims/fingerprints.py),
    -- stored with each claim so that changing it does not turn the keys stored under the old
    -- scheme into conflicts.
    payload_hash      bytea       NOT NULL,  -- SHA-256 of the payload under `fingerprint`
    fingerprint       text,                  -- 'json', 'json exclude=[...]', 'callable m:n'; NULL: raw bytes
    raw_hash          bytea,                 -- under a scheme other than raw: SHA-256 of the bytes
    payload           bytea,                 -- the first payload (keep_payload=True, 64 KiB at most),
                                             -- so a conflict can show which paths differ

    -- The claim: who holds the key, until when, under which token.
    status            text        NOT NULL CHECK (status IN ('in_progress', 'completed', 'failed')),
    retryable         boolean     NOT NULL DEFAULT false,  -- a released failure: claimable again
    token             bigint      NOT NULL DEFAULT nextval('dedupe_claim_tokens'),  -- the fence
    owner             text        NOT NULL,  -- the worker (or receiver, or operator) that wrote it
    attempts          integer     NOT NULL DEFAULT 1,  -- runs started, counted before each one
    lease_until       timestamptz,           -- in progress: a take-over may happen after it
    -- The claim statement that took the row (a random id per statement): sent again after its
    -- reply was lost on a broken connection, it finds its own claims by it, instead of taking
    -- them for someone else's live lease.
    claim_request_id  bigint,

    -- The outcome.
    result            jsonb,                 -- completed: the handler's result, replayed to duplicates
    -- Failed: why, a dedupe.claims.records.Reason value ('handler_error', 'rejected', ...), the
    -- x-dedupe-reason of its dead letter. NULL on every other row, and on a failure recorded
    -- without one (read as handler_error). No CHECK on its values: a reason added later would
    -- need a migration, and a worker of an older version could not fail a key with it.
    reason            text,
    -- A failed key's detail (the x-dedupe-detail: 'ValueError: ...'), an in-progress key's last
    -- retried error, or 'handed back' on a key a stopping worker gave back (give_back), so that
    -- its next claim is not counted as a crash ('handed back after a take-over' on a dead
    -- worker's key it had taken over: that crash stays in its history). A heartbeat skips both.
    error             text,
    -- When the broker confirmed a failed key's dead letter. A failed key without it was failed
    -- by a worker that died before its dead letter went out: its next delivery is dead-lettered
    -- again instead of being acknowledged as a duplicate.
    dead_lettered_at  timestamptz,
    -- The trace of the run that completed the key (OpenTelemetry, 32 hex digits), so that a
    -- duplicate's span can point at the run that did the work. Written only where tracing is on.
    trace_id          text,

    -- Times. Stuck-work ages (the oldest-in-progress gauge, the status page, `claims list
    -- --older-than-s`) count from claimed_at, the current run's claim; created_at stays the
    -- key's first claim, so a key replayed days after it failed does not show as days-old work.
    created_at        timestamptz NOT NULL DEFAULT now(),
    claimed_at        timestamptz NOT NULL DEFAULT now(),
    updated_at        timestamptz NOT NULL DEFAULT now(),  -- `claims purge` cuts off by it
    expires_at        timestamptz NOT NULL,  -- clean-up (gc) deletes the row after it

    PRIMARY KEY (scope, key)
);

-- Clean-up walks expired rows oldest first.
CREATE INDEX dedupe_claims_expires_at_idx ON dedupe_claims (expires_at);

-- Operators look for stuck work: a small partial index keeps that cheap on a large table.
CREATE INDEX dedupe_claims_in_progress_idx ON dedupe_claims (lease_until)
    WHERE status = 'in_progress';


-- == A claim's history =======================================================================

-- The rare events only: take-overs, hand-backs, releases, retries, failures, dead letters,
-- conflicts (and their settling). A completion writes no event: that would double the cost of
-- the hot path, and the claim row itself says when and by whom it completed. Written by the
-- trigger below, and by workers, receivers and operators for conflicts (add_events).
CREATE TABLE dedupe_claim_events (
    id        bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    scope     text        NOT NULL,
    key       text        NOT NULL,
    at        timestamptz NOT NULL DEFAULT now(),
    -- taken_over, handed_back, reclaimed, attempt, failed, released, dead_lettered,
    -- conflict, conflict_settled
    event     text        NOT NULL,
    token     bigint,
    owner     text,
    attempts  integer,
    reason    text,       -- a failure's reason (the claim's, at the time); NULL for the others
    detail    text        -- what happened: the error of a retry or a failure, a take-over's
                          -- previous owner, how a conflict was settled
);
-- `claims show`: one key's events in order.
CREATE INDEX dedupe_claim_events_key_idx ON dedupe_claim_events (scope, key, at);
-- The status page and `status`: the latest events of some kinds.
CREATE INDEX dedupe_claim_events_at_idx ON dedupe_claim_events (at);

-- Events are written by a trigger, so every writer (workers, receivers, operators, an old
-- worker that knows nothing of this table) records them. Its WHEN clause is evaluated in the
-- executor without calling the function: a heartbeat or a completion costs nothing more. A key
-- a stopping worker handed back (error 'handed back', see give_back) and claimed again is
-- recorded as 'handed_back', not 'taken_over': a rolling deploy is not trouble.
CREATE FUNCTION dedupe_claim_history() RETURNS trigger LANGUAGE plpgsql AS $$
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


-- == Counts per scope ========================================================================

-- What the claims table cannot tell: duplicates suppressed and conflicts seen (the status page,
-- `status`). Workers and receivers add their counts every few seconds, not per message.
CREATE TABLE dedupe_scope_counts (
    scope        text        PRIMARY KEY,
    duplicates   bigint      NOT NULL DEFAULT 0,
    conflicts    bigint      NOT NULL DEFAULT 0,
    updated_at   timestamptz NOT NULL DEFAULT now()
);


-- == Conflicts ===============================================================================

-- Conflicts people can act on: a message refused because its key was first claimed with
-- another payload, with both fingerprints, the paths that differ (values never stored: see
-- dedupe/claims/conflicts.py) and, for handlers with keep_payload=True, the second payload, so
-- that `dedupe-worker conflicts settle` can discard it or run it under a new key. One row per
-- (scope, key, payload_hash): a conflicting message delivered again counts a delivery, so a
-- flood of one payload is one row. Written before the message is settled (its dead letter, the
-- receiver's or the HTTP middleware's 422: dedupe/claims/conflict_records.py), never buffered.
CREATE TABLE dedupe_conflicts (
    id                   bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    scope                text        NOT NULL,
    key                  text        NOT NULL,
    payload_hash         bytea       NOT NULL,  -- the second payload's, under its scheme
    fingerprint          text        NOT NULL,  -- the second payload's: scheme and hash
    claimed_fingerprint  text        NOT NULL,  -- the claim's, as it was at the conflict
    diff                 jsonb,                 -- the paths that differ; NULL: not known
    diff_more            integer     NOT NULL DEFAULT 0,  -- differing paths left out of diff
    note                 text,                  -- what the diff cannot say ('the same JSON value')
    channel              text,                  -- where a run-as copy is published; NULL: HTTP
    http_request         text,                  -- the HTTP middleware's: 'POST /orders' (no query)
    message_id           text,
    headers              jsonb       NOT NULL DEFAULT '{}',  -- the sender's, for a run-as copy
    content_type         text,
    payload              bytea,                 -- the second payload (keep_payload)
    source               text,                  -- the webhook source that refused it
    deliveries           integer     NOT NULL DEFAULT 1,
    at                   timestamptz NOT NULL DEFAULT now(),
    last_at              timestamptz NOT NULL DEFAULT now(),
    settled_at           timestamptz,
    settled              text,                  -- 'discarded' or 'run as <key>'
    UNIQUE (scope, key, payload_hash)
);
-- The status page and `conflicts list`: what is still to settle.
CREATE INDEX dedupe_conflicts_unsettled_idx ON dedupe_conflicts (at) WHERE settled_at IS NULL;

-- A conflict lives as long as its claim: clean-up and purges delete it with the claim.
CREATE FUNCTION dedupe_claim_conflicts_gc() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    DELETE FROM dedupe_conflicts x USING gone g WHERE x.scope = g.scope AND x.key = g.key;
    RETURN NULL;
END
$$;

CREATE TRIGGER dedupe_claims_conflicts_gc AFTER DELETE ON dedupe_claims
    REFERENCING OLD TABLE AS gone FOR EACH STATEMENT
    EXECUTE FUNCTION dedupe_claim_conflicts_gc();


-- == Durable steps ===========================================================================

-- ctx.step: a step's JSON result under its claim's (scope, key) and its name, committed as soon
-- as the step returns and returned again to later attempts of the key.
CREATE TABLE dedupe_steps (
    scope       text        NOT NULL,
    key         text        NOT NULL,
    name        text        NOT NULL,
    result      jsonb       NOT NULL,
    token       bigint      NOT NULL,     -- the run that recorded it
    created_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (scope, key, name)
);

-- A claim's steps go with it when clean-up or a purge deletes it (they outlive a release or a
-- dead-letter replay: re-running a failed key must not repeat a charge that succeeded).
CREATE FUNCTION dedupe_claim_steps_gc() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    DELETE FROM dedupe_steps s USING gone g WHERE s.scope = g.scope AND s.key = g.key;
    RETURN NULL;
END
$$;

CREATE TRIGGER dedupe_claims_steps_gc AFTER DELETE ON dedupe_claims
    REFERENCING OLD TABLE AS gone FOR EACH STATEMENT
    EXECUTE FUNCTION dedupe_claim_steps_gc();


-- == The transactional outbox ================================================================

-- What handlers publish (ctx.publish) is written here in the same transaction as their ctx.db
-- writes and their claim's completion, so a zombie's or a rolled-back run's messages never
-- escape and a crash after the commit loses none. Every worker of the app relays committed rows
-- with publisher confirms, in order per producing key, then marks them sent (outbox.sql).
CREATE TABLE dedupe_outbox (
    id            bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    producer      text        NOT NULL,   -- the scope and key of the run that published: order
    channel       text        NOT NULL,
    message_id    text        NOT NULL,
    body          bytea       NOT NULL,
    headers       jsonb       NOT NULL DEFAULT '{}',
    content_type  text,
    created_at    timestamptz NOT NULL DEFAULT now(),
    sent_at       timestamptz,            -- confirmed by the broker; NULL: still to relay
    attempts      integer     NOT NULL DEFAULT 0,  -- refusals by the broker so far
    last_error    text,                   -- the broker's latest refusal
    next_try_at   timestamptz NOT NULL DEFAULT now(),  -- a refused row waits out its backoff
    expires_at    timestamptz NOT NULL    -- clean-up deletes sent rows after it
);
-- The relay's work: unsent rows, oldest first (a small partial index: sent rows leave it).
CREATE INDEX dedupe_outbox_unsent_idx ON dedupe_outbox (id) WHERE sent_at IS NULL;
-- The relay's take looks up the unsent rows of the producers it took: without an index by
-- producer that was a scan of every unsent row in every round, and draining a backlog took
-- time quadratic in its size.
CREATE INDEX dedupe_outbox_producer_unsent_idx ON dedupe_outbox (producer, id)
    WHERE sent_at IS NULL;
-- Clean-up of sent rows.
CREATE INDEX dedupe_outbox_expires_idx ON dedupe_outbox (expires_at) WHERE sent_at IS NOT NULL;


-- == The migrations this file stands for =====================================================

-- The migration runner's bookkeeping (dedupe/claims/database.py creates it before the first
-- migration, outside the numbered files): the migrations applied to this database. Here it
-- lists every migration this file includes, so the runner applies only later ones.
CREATE TABLE dedupe_migrations (
    version     integer     PRIMARY KEY,
    name        text        NOT NULL,
    applied_at  timestamptz NOT NULL DEFAULT now()
);
INSERT INTO dedupe_migrations (version, name) VALUES
    (1, 'claims'),
    (2, 'dead_letters'),
    (3, 'history'),
    (4, 'claimed_at'),
    (5, 'handed_back_history'),
    (6, 'token_sequence'),
    (7, 'outbox_and_steps'),
    (8, 'fingerprints'),
    (9, 'outbox_producer_index'),
    (10, 'failure_reason'),
    (11, 'conflict_records');
