-- When the dead letter of a failed key was confirmed by the broker. A failed key without it
-- was failed by a worker that died before its dead letter went out: the next delivery of the
-- message is dead-lettered again instead of being acknowledged as a duplicate.
ALTER TABLE dedupe_claims ADD COLUMN dead_lettered_at timestamptz;
