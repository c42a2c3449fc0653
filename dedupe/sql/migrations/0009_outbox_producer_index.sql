-- The relay's take looks up the unsent rows of the producers it took. Without an index by
-- producer that was a scan of every unsent row (and of the sent ones kept until they expire)
-- in every round, so draining a backlog took time quadratic in its size.
CREATE INDEX dedupe_outbox_producer_unsent_idx ON dedupe_outbox (producer, id)
    WHERE sent_at IS NULL;
