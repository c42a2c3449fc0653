-- Named queries for operators and observers (the status page, `claims`, metrics, tracing).
-- None of them runs per message: they run on an operator's request or every few seconds.

-- name: history
SELECT at, event, token, owner, attempts, reason, detail
  FROM dedupe_claim_events
 WHERE scope = $1 AND key = $2
 ORDER BY at, id;

-- name: purge_batch
-- Delete one batch of finished claims last touched before the cut-off; never in-progress ones.
-- By primary key, not ctid: see gc_batch.
DELETE FROM dedupe_claims AS c
 USING (SELECT scope, key FROM dedupe_claims
         WHERE status = ANY($1::text[]) AND status <> 'in_progress'
           AND updated_at < now() - make_interval(secs => $2)
           -- A scope and its tenants; not LIKE, in which a scope's _ and % would be wildcards.
           AND ($3::text IS NULL OR scope = $3 OR starts_with(scope, $3 || '/'))
         LIMIT $4
           FOR UPDATE SKIP LOCKED) AS old
 WHERE c.scope = old.scope AND c.key = old.key
   AND c.status = ANY($1::text[]) AND c.status <> 'in_progress'
   AND c.updated_at < now() - make_interval(secs => $2);

-- name: overview
-- Claims by handler (the scope without its tenant) and status, with what the table cannot
-- say by itself: duplicates suppressed and conflicts seen. A full scan: operators ask for it,
-- nothing polls it.
WITH claims AS (
    SELECT split_part(scope, '/', 1) AS handler,
           count(*) FILTER (WHERE status = 'in_progress') AS in_progress,
           count(*) FILTER (WHERE status = 'completed') AS completed,
           count(*) FILTER (WHERE status = 'failed') AS failed
      FROM dedupe_claims GROUP BY 1
), counted AS (
    SELECT split_part(scope, '/', 1) AS handler, sum(duplicates)::bigint AS duplicates,
           sum(conflicts)::bigint AS conflicts
      FROM dedupe_scope_counts GROUP BY 1
)
SELECT coalesce(c.handler, n.handler) AS handler,
       coalesce(c.in_progress, 0) AS in_progress, coalesce(c.completed, 0) AS completed,
       coalesce(c.failed, 0) AS failed, coalesce(n.duplicates, 0) AS duplicates,
       coalesce(n.conflicts, 0) AS conflicts
  FROM claims c FULL JOIN counted n ON n.handler = c.handler
 ORDER BY 1;

-- name: stuck
-- Claims in progress for longer than $1 seconds, oldest first (the partial index on
-- in-progress claims keeps this cheap on a large table).
SELECT scope, key, owner, token, attempts, lease_until, created_at, claimed_at,
       extract(epoch FROM now() - claimed_at)::float8 AS age_s,
       coalesce(lease_until < now(), true) AS lease_lapsed
  FROM dedupe_claims
 WHERE status = 'in_progress' AND claimed_at < now() - make_interval(secs => $1)
 ORDER BY claimed_at
 LIMIT $2;

-- name: recent_events
SELECT at, scope, key, event, owner, attempts, reason, detail
  FROM dedupe_claim_events
 WHERE event = ANY($1::text[])
 ORDER BY at DESC
 LIMIT $2;

-- name: add_counts
INSERT INTO dedupe_scope_counts AS s (scope, duplicates, conflicts)
SELECT * FROM unnest($1::text[], $2::bigint[], $3::bigint[])
    ON CONFLICT (scope) DO UPDATE
   SET duplicates = s.duplicates + EXCLUDED.duplicates,
       conflicts = s.conflicts + EXCLUDED.conflicts, updated_at = now();

-- name: add_events
INSERT INTO dedupe_claim_events (scope, key, event, detail)
SELECT * FROM unnest($1::text[], $2::text[], $3::text[], $4::text[]);

-- name: set_trace_ids
-- The trace of the run that completed each key.
UPDATE dedupe_claims AS c
   SET trace_id = i.trace_id
  FROM unnest($1::text[], $2::text[], $3::text[]) AS i(scope, key, trace_id)
 WHERE c.scope = i.scope AND c.key = i.key AND c.status = 'completed';

-- name: trace_ids
SELECT c.scope, c.key, c.trace_id
  FROM dedupe_claims c
  JOIN unnest($1::text[], $2::text[]) AS i(scope, key) ON c.scope = i.scope AND c.key = i.key
 WHERE c.trace_id IS NOT NULL;

-- name: show_claim
SELECT scope, key, coalesce(fingerprint, 'raw') AS fingerprint,
       encode(payload_hash, 'hex') AS payload_hash, encode(raw_hash, 'hex') AS raw_hash,
       octet_length(payload) AS payload_bytes, status, retryable, token, owner,
       attempts, lease_until, result::text AS result, reason, error, created_at, claimed_at,
       updated_at, expires_at, lease_until > now() AS lease_live, dead_lettered_at, trace_id
  FROM dedupe_claims
 WHERE scope = $1 AND key = $2;

-- name: record_conflicts
-- Conflicts recorded before their messages are settled (dedupe/claims/conflict_records.py):
-- one row per (scope, key, second payload's hash), only while the claim exists (a record
-- without it would never be cleaned up). A payload refused again counts its deliveries on its
-- row; a row's first delivery writes the history's `conflict` event, in the same statement
-- (a flood of one payload is one row and one event). The inputs' (scope, key, payload_hash)
-- are distinct (ON CONFLICT cannot touch a row twice in one statement). A row is new when it
-- counts no more deliveries than its input: an update adds to at least one.
WITH i AS (
    SELECT *
      FROM unnest($1::text[], $2::text[], $3::bytea[], $4::text[], $5::text[], $6::text[],
                  $7::int[], $8::text[], $9::text[], $10::text[], $11::text[], $12::text[],
                  $13::bytea[], $14::text[], $15::int[], $16::text[], $17::text[])
           AS i(scope, key, payload_hash, fingerprint, claimed, diff, more, note, channel,
                message_id, headers, content_type, payload, source, deliveries, http_request,
                event_detail)
), recorded AS (
    INSERT INTO dedupe_conflicts AS x
        (scope, key, payload_hash, fingerprint, claimed_fingerprint, diff, diff_more, note,
         channel, message_id, headers, content_type, payload, source, deliveries, http_request)
    SELECT i.scope, i.key, i.payload_hash, i.fingerprint, i.claimed, i.diff::jsonb, i.more,
           i.note, i.channel, i.message_id, i.headers::jsonb, i.content_type, i.payload,
           i.source, i.deliveries, i.http_request
      FROM i
     WHERE EXISTS (SELECT 1 FROM dedupe_claims c WHERE c.scope = i.scope AND c.key = i.key)
        ON CONFLICT (scope, key, payload_hash) DO UPDATE
       SET deliveries = x.deliveries + EXCLUDED.deliveries, last_at = now()
    RETURNING x.scope, x.key, x.payload_hash, x.deliveries
)
INSERT INTO dedupe_claim_events (scope, key, event, detail)
SELECT r.scope, r.key, 'conflict', i.event_detail
  FROM recorded r
  JOIN i ON i.scope = r.scope AND i.key = r.key AND i.payload_hash = r.payload_hash
 WHERE r.deliveries <= i.deliveries;

-- name: conflicts_of
SELECT id, at, last_at, deliveries, fingerprint, claimed_fingerprint, diff::text AS diff,
       diff_more AS more, note, channel, message_id, source, http_request,
       octet_length(payload) AS payload_bytes, settled_at, settled
  FROM dedupe_conflicts
 WHERE scope = $1 AND key = $2
 ORDER BY at, id;

-- name: list_conflicts
-- Newest first; $3: settled ones too. The scope filter is a scope and its tenants.
SELECT id, at, last_at, scope, key, deliveries, fingerprint, claimed_fingerprint,
       diff::text AS diff, diff_more AS more, note, source, http_request,
       octet_length(payload) AS payload_bytes, settled_at,
       settled
  FROM dedupe_conflicts
 WHERE ($1::text IS NULL OR scope = $1 OR starts_with(scope, $1 || '/'))
   AND ($3 OR settled_at IS NULL)
 ORDER BY at DESC, id DESC
 LIMIT $2;

-- name: conflicts_to_settle
-- The unsettled conflicts of a key ($3: one of them), locked until the settling commits, so
-- two operators cannot settle one conflict twice.
SELECT id, fingerprint, channel, message_id, headers::text AS headers, content_type, payload,
       source, http_request
  FROM dedupe_conflicts
 WHERE scope = $1 AND key = $2 AND settled_at IS NULL AND ($3::bigint IS NULL OR id = $3)
 ORDER BY id
   FOR UPDATE;

-- name: settle_conflict
-- Settled: the second payload is dropped (discarded, or handed to the outbox to run).
UPDATE dedupe_conflicts SET settled_at = now(), settled = $2, payload = NULL WHERE id = $1;

-- name: claim_status
SELECT status FROM dedupe_claims WHERE scope = $1 AND key = $2;
