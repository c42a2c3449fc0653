-- Named queries of the outbox and the durable steps (dedupe/outbox.py, dedupe/steps.py).

-- name: add
-- The run's publishes, in its completion transaction.
INSERT INTO dedupe_outbox (producer, channel, message_id, body, headers, content_type, expires_at)
SELECT producer, channel, message_id, body, headers::jsonb, content_type,
       now() + make_interval(secs => $7)
  FROM unnest($1::text[], $2::text[], $3::text[], $4::bytea[], $5::text[], $6::text[])
       WITH ORDINALITY AS i(producer, channel, message_id, body, headers, content_type, n)
 ORDER BY n;

-- name: take
-- The relay's next rows, inside its transaction: whole producers at a time (an advisory lock
-- per producer keeps a producer's rows with one relay, in order), the producers' unsent rows
-- in id order, locked until the relay commits that they were sent.
-- A producer is a candidate when its first unsent row is due: one whose head waits out a
-- refusal's backoff is not taken at all (its later rows never overtake it, and it takes no
-- round's room from the producers that can go). The heads are found among the first due rows
-- (the window) by a sub-plan per row on dedupe_outbox_producer_unsent_idx: a round costs its
-- window, never a scan of the backlog (a NOT EXISTS was planned as a hash anti-join over all
-- unsent rows once nothing above it limited its rows).
-- The advisory locks are tried in id order, on heads only (OFFSET 0 keeps the head test below
-- the lock: merged, the planner ran the cheaper lock first), until $1 producers are ours (the
-- LIMIT stops the scan of `heads`, so no lock is taken beyond it): a relay whose first
-- candidates another relay holds takes the next ones in the window, instead of nothing.
-- Each producer's rows are read by index up to a round's worth, unlocked (`picked`: a long
-- backlog costs a round its batch, not its backlog); only the $1 rows the round relays are
-- locked. FOR UPDATE waits rather than skips: the advisory lock already keeps other relays
-- off, and a row skipped would let its producer's later rows overtake it. A row another
-- relay marked sent since this statement's snapshot fails the re-check and is dropped (always
-- the start of its producer's chain: the order holds).
WITH heads AS (
    SELECT due.producer, due.id AS first
      FROM (SELECT id, producer FROM dedupe_outbox
             WHERE sent_at IS NULL AND next_try_at <= now() ORDER BY id LIMIT $1 * 4) AS due
     WHERE due.id = (SELECT min(head.id) FROM dedupe_outbox head
                      WHERE head.producer = due.producer AND head.sent_at IS NULL)
     ORDER BY due.id
    OFFSET 0
), mine AS (
    SELECT producer FROM heads
     WHERE pg_try_advisory_xact_lock(hashtextextended(producer, 7))
     LIMIT $1
), picked AS (
    SELECT chain.id
      FROM mine m
     CROSS JOIN LATERAL (SELECT r.id FROM dedupe_outbox r
                          WHERE r.producer = m.producer AND r.sent_at IS NULL
                          ORDER BY r.id LIMIT $1) AS chain
     ORDER BY chain.id
     LIMIT $1
)
SELECT o.id, o.producer, o.channel, o.message_id, o.body, o.headers::text AS headers,
       o.content_type, o.attempts, o.next_try_at <= now() AS due
  FROM dedupe_outbox o
 WHERE o.id IN (SELECT id FROM picked) AND o.sent_at IS NULL
 ORDER BY o.id
   FOR UPDATE OF o;

-- name: sent
UPDATE dedupe_outbox SET sent_at = now(), last_error = NULL
 WHERE id = ANY($1::bigint[]);

-- name: refused
-- A publish the broker refused: tried again after a backoff; counted, never dropped. The
-- producer's later unsent rows wait as long (they go after it, and the due rows a round looks
-- at are then rows that can go). The backoff counts from now, not from the round's start
-- (now() is the transaction's): a round as long as a publish timeout must not use it up.
WITH refused AS (
    UPDATE dedupe_outbox
       SET attempts = attempts + 1, last_error = $2,
           next_try_at = clock_timestamp()
                         + make_interval(secs => least(60, 0.5 * 2 ^ least(attempts, 7)))
     WHERE id = $1
 RETURNING producer, next_try_at
)
UPDATE dedupe_outbox later SET next_try_at = greatest(later.next_try_at, refused.next_try_at)
  FROM refused
 WHERE later.producer = refused.producer AND later.sent_at IS NULL AND later.id > $1;

-- name: backlog
-- Operators' view (metrics, status): unsent rows, the oldest one's age (the relay's lag) and
-- those the broker refused at least once, over the partial index of unsent rows; and how long
-- the oldest sent row past its retention has waited for clean-up (a min over the partial
-- index of sent rows: growing without end means no clean-up runs, e.g. every worker has
-- --gc-interval-s 0 and no scheduler runs `dedupe-worker gc`).
SELECT count(*)::bigint AS unsent,
       coalesce(extract(epoch FROM now() - min(created_at)), 0)::float8 AS oldest_unsent_s,
       count(*) FILTER (WHERE attempts > 0)::bigint AS refused,
       coalesce((SELECT extract(epoch FROM now() - min(expires_at))
                   FROM dedupe_outbox WHERE sent_at IS NOT NULL AND expires_at < now()),
                0)::float8 AS cleanup_lag_s
  FROM dedupe_outbox WHERE sent_at IS NULL;

-- name: backlog_by_channel
-- The same per destination, the most lagging first, with the latest refusal's error.
SELECT channel, count(*)::bigint AS unsent,
       extract(epoch FROM now() - min(created_at))::float8 AS oldest_unsent_s,
       count(*) FILTER (WHERE attempts > 0)::bigint AS refused,
       (array_agg(last_error ORDER BY id DESC) FILTER (WHERE last_error IS NOT NULL))[1]
           AS last_error
  FROM dedupe_outbox WHERE sent_at IS NULL
 GROUP BY channel
 ORDER BY min(created_at)
 LIMIT $1;

-- name: gc
-- Sent rows past their retention, one batch; run by the clean-up leader only (ClaimStore.gc,
-- under the clean-up lock), never a row still to relay.
DELETE FROM dedupe_outbox
 WHERE id IN (SELECT id FROM dedupe_outbox
               WHERE sent_at IS NOT NULL AND expires_at < now()
               ORDER BY expires_at LIMIT $1);

-- name: step_result
-- A step's recorded result, and whether the run ($4: its token) still holds the key: a zombie
-- learns it was taken over before it calls the step's function.
SELECT (SELECT result::text FROM dedupe_steps
         WHERE scope = $1 AND key = $2 AND name = $3) AS result,
       EXISTS (SELECT 1 FROM dedupe_claims
                WHERE scope = $1 AND key = $2 AND token = $4 AND status = 'in_progress') AS ours;

-- name: record_step
-- Fenced by the run's token: a zombie's step is refused once another worker took the key.
WITH ours AS (
    SELECT 1 FROM dedupe_claims
     WHERE scope = $1 AND key = $2 AND token = $4 AND status = 'in_progress'
)
INSERT INTO dedupe_steps (scope, key, name, result, token)
SELECT $1, $2, $3, $5::text::jsonb, $4 FROM ours
    ON CONFLICT (scope, key, name) DO NOTHING
RETURNING result::text AS result;
