-- The transactional outbox: what handlers publish (ctx.publish) is written here in the same
-- transaction as their ctx.db writes and their claim's completion, so a zombie's or a rolled-back
-- run's messages never escape and a crash after the commit loses none. Every worker of the app
-- relays committed rows with publisher confirms, in order per producing key, then marks them sent.
CREATE TABLE dedupe_outbox (
    id            bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    producer      text        NOT NULL,   -- the scope and key of the run that published: order
    channel       text        NOT NULL,
    message_id    text        NOT NULL,
    body          bytea       NOT NULL,
    headers       jsonb       NOT NULL DEFAULT '{}',
    content_type  text,
    created_at    timestamptz NOT NULL DEFAULT now(),
    sent_at       timestamptz,
    attempts      integer     NOT NULL DEFAULT 0,
    last_error    text,
    next_try_at   timestamptz NOT NULL DEFAULT now(),
    expires_at    timestamptz NOT NULL
);
-- The relay's work: unsent rows, oldest first (a small partial index: sent rows leave it).
CREATE INDEX dedupe_outbox_unsent_idx ON dedupe_outbox (id) WHERE sent_at IS NULL;
-- Clean-up of sent rows.
CREATE INDEX dedupe_outbox_expires_idx ON dedupe_outbox (expires_at) WHERE sent_at IS NOT NULL;

-- Durable steps (ctx.step): a step's JSON result under its claim's (scope, key) and its name,
-- committed as soon as the step returns and returned again to later attempts of the key.
CREATE TABLE dedupe_steps (
    scope       text        NOT NULL,
    key         text        NOT NULL,
    name        text        NOT NULL,
    result      jsonb       NOT NULL,
    token       bigint      NOT NULL,     -- the run that recorded it
    created_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (scope, key, name)
);

-- A claim's steps go with it when clean-up or a purge deletes it (they outlive a release or
-- a dead-letter replay: re-running a failed key must not repeat a charge that succeeded).
CREATE FUNCTION dedupe_claim_steps_gc() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    DELETE FROM dedupe_steps s USING gone g WHERE s.scope = g.scope AND s.key = g.key;
    RETURN NULL;
END
$$;

CREATE TRIGGER dedupe_claims_steps_gc AFTER DELETE ON dedupe_claims
    REFERENCING OLD TABLE AS gone FOR EACH STATEMENT
    EXECUTE FUNCTION dedupe_claim_steps_gc();
