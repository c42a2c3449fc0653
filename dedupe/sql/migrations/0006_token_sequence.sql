-- Fencing tokens come from one database-wide sequence, on every claim and take-over, so that a
-- token is never issued twice: a row deleted by clean-up or `claims purge` and claimed again
-- used to restart at token 1, and a zombie still holding token 1 passed the fence. Workers of
-- an earlier version count tokens per row: stop them before this migration runs. The sequence
-- belongs to no column, so recreating the table (docs/operations.md: partitioning) keeps it.
CREATE SEQUENCE dedupe_claim_tokens AS bigint;
SELECT setval('dedupe_claim_tokens', coalesce((SELECT max(token) FROM dedupe_claims), 0) + 1, false);
ALTER TABLE dedupe_claims ALTER COLUMN token SET DEFAULT nextval('dedupe_claim_tokens');

-- The claim statement that took the row (a random id per statement). The same statement sent
-- again after its reply was lost on a broken connection finds its own claims by it, instead of
-- taking them for someone else's live lease.
ALTER TABLE dedupe_claims ADD COLUMN claim_request_id bigint;
