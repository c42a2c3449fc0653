-- Fingerprints (dedupe/fingerprints.py): what "the same payload" means is a handler's choice,
-- stored with each claim, so that changing it does not turn every key stored under the old
-- scheme into a conflict (claim_batch compares under the stored scheme when it can).
-- All three are NULL on the rows that exist when this runs: those are raw claims, payload_hash
-- being the SHA-256 of their bytes. Adding a NULL column rewrites nothing.
-- The scheme's name ('json', 'json exclude=[...]', 'callable module:name'); NULL: raw.
ALTER TABLE dedupe_claims ADD COLUMN fingerprint text;
-- Under a scheme other than raw: the SHA-256 of the body bytes, beside payload_hash.
ALTER TABLE dedupe_claims ADD COLUMN raw_hash bytea;
-- The first payload, kept with its claim by handlers with keep_payload=True (64 KiB at most),
-- so that a conflict can show which paths differ. It goes with the claim.
ALTER TABLE dedupe_claims ADD COLUMN payload bytea;

-- Conflicts people can act on: a message refused because its key was first claimed with
-- another payload, with both fingerprints, the paths that differ (values never stored: see
-- dedupe/conflicts.py) and, for handlers with keep_payload=True, the second payload, so that
-- `dedupe-worker conflicts settle` can discard it or run it under a new key. One row per
-- (scope, key, payload_hash): a conflicting message delivered again counts a delivery.
CREATE TABLE dedupe_conflicts (
    id                   bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    scope                text        NOT NULL,
    key                  text        NOT NULL,
    payload_hash         bytea       NOT NULL,  -- the second payload's, under its scheme
    fingerprint          text        NOT NULL,  -- the second payload's: scheme and hash
    claimed_fingerprint  text        NOT NULL,  -- the claim's, as it was at the conflict
    diff                 jsonb,                 -- the paths that differ; NULL: not known
    diff_more            integer     NOT NULL DEFAULT 0,
    note                 text,
    channel              text        NOT NULL,
    message_id           text,
    headers              jsonb       NOT NULL DEFAULT '{}',
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
