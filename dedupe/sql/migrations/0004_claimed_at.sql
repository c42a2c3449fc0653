-- When the current run's claim was taken: a new key, or a take-over of a lapsed lease or a
-- released failure. Stuck-work ages (the oldest-in-progress gauge, the status page, `claims
-- list --older-than-s`) count from here; created_at stays the key's first claim, so a key
-- replayed days after it failed does not show as days-old work while it runs normally.
-- Rows that exist when this runs get the migration's time (a constant default: no rewrite).
ALTER TABLE dedupe_claims ADD COLUMN claimed_at timestamptz NOT NULL DEFAULT now();
-- Claims in progress keep their age (they are few: the partial index finds them).
UPDATE dedupe_claims SET claimed_at = created_at WHERE status = 'in_progress';
