-- The claims table: one row per (scope, key); uniqueness is the primary key's job.
CREATE TABLE dedupe_claims (
    scope         text        NOT NULL,
    key           text        NOT NULL,
    payload_hash  bytea       NOT NULL,
    status        text        NOT NULL CHECK (status IN ('in_progress', 'completed', 'failed')),
    retryable     boolean     NOT NULL DEFAULT false,
    token         bigint      NOT NULL DEFAULT 1,
    owner         text        NOT NULL,
    attempts      integer     NOT NULL DEFAULT 1,
    lease_until   timestamptz,
    result        jsonb,
    error         text,
    created_at    timestamptz NOT NULL DEFAULT now(),
    updated_at    timestamptz NOT NULL DEFAULT now(),
    expires_at    timestamptz NOT NULL,
    PRIMARY KEY (scope, key)
);

-- Clean-up walks expired rows oldest first.
CREATE INDEX dedupe_claims_expires_at_idx ON dedupe_claims (expires_at);

-- Operators look for stuck work: a small partial index keeps that cheap on a large table.
CREATE INDEX dedupe_claims_in_progress_idx ON dedupe_claims (lease_until)
    WHERE status = 'in_progress';
