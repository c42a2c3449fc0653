-- Named queries of the claim store. Each block starts with a line `-- name: <query_name>`.
-- Times come from the database's now(), never from a worker's clock.

-- name: claim_batch
-- Claim many keys in one statement. One row comes back per input key: a token when we own
-- the key (new, or taken over from an expired lease / a released failure), otherwise the
-- state of the row that stands in our way. Inputs are sorted so that two workers claiming
-- overlapping batches lock rows in the same order and never deadlock.
-- Tokens come from one sequence (never issued twice, even for a row deleted and claimed again).
-- A new key counts its first attempt here; a take-over does not: the worker counts it with
-- record_attempt just before the handler starts, so a message that was claimed but never
-- started when its worker died is not charged for the crash.
-- $7 identifies this statement: sent again after a lost reply, it finds the claims it made the
-- first time (in progress, ours, with its id) and answers with their tokens.
-- The same payload (dedupe/claims/fingerprints.py): $3 is each payload's hash under its handler's
-- scheme $8 (NULL: raw), $9 the hash of its bytes under any other scheme. A row stored under
-- the same scheme is compared by that hash; one stored raw (every claim before the handler
-- chose another scheme) by the bytes' hash, so a byte-identical copy is never a conflict; one
-- stored under another scheme that is not raw (a json with other excluded paths, a function)
-- cannot be compared here and counts as the same payload: the operator changed what "the same"
-- means, and honest retries must not be dead-lettered for it. A take-over stores the new
-- scheme. $10: the payloads kept with new claims (keep_payload), NULL for the others.
WITH input AS (
    SELECT * FROM unnest($1::text[], $2::text[], $3::bytea[], $8::text[], $9::bytea[],
                         $10::bytea[])
        AS i(scope, key, payload_hash, fingerprint, raw_hash, payload)
),
claimed AS (
    INSERT INTO dedupe_claims AS c
        (scope, key, payload_hash, fingerprint, raw_hash, payload, status, token, owner,
         attempts, lease_until, expires_at, claim_request_id)
    SELECT scope, key, payload_hash, fingerprint, raw_hash, payload, 'in_progress',
           nextval('dedupe_claim_tokens'), $4, 1,
           now() + make_interval(secs => $5), now() + make_interval(secs => $6), $7::bigint
    FROM input
    -- A key whose row no claim can take (completed, failed for good, or held under a live
    -- lease) is answered from the read below and never reaches the upsert: a batch of
    -- duplicates locks no row, takes no transaction id, writes no WAL and waits for no flush.
    -- The read sees the statement's snapshot; a row that changed since is met by ON CONFLICT
    -- and its WHERE exactly as before.
    WHERE NOT EXISTS (
        SELECT FROM dedupe_claims f
         WHERE f.scope = input.scope AND f.key = input.key
           AND (f.status = 'completed' OR (f.status = 'failed' AND NOT f.retryable)
                OR (f.status = 'in_progress' AND f.lease_until >= now())))
    ORDER BY scope, key
    ON CONFLICT (scope, key) DO UPDATE
        SET token = nextval('dedupe_claim_tokens'), owner = EXCLUDED.owner,
            status = 'in_progress', retryable = false, lease_until = EXCLUDED.lease_until,
            reason = NULL, error = NULL, updated_at = now(), claimed_at = now(),
            expires_at = EXCLUDED.expires_at, claim_request_id = EXCLUDED.claim_request_id,
            fingerprint = EXCLUDED.fingerprint, payload_hash = EXCLUDED.payload_hash,
            raw_hash = EXCLUDED.raw_hash, payload = EXCLUDED.payload
        WHERE CASE WHEN c.fingerprint IS NOT DISTINCT FROM EXCLUDED.fingerprint
                       THEN c.payload_hash = EXCLUDED.payload_hash
                   WHEN c.fingerprint IS NULL
                       THEN c.payload_hash = coalesce(EXCLUDED.raw_hash, EXCLUDED.payload_hash)
                   ELSE true END
          AND ((c.status = 'in_progress' AND c.lease_until < now())
               OR (c.status = 'failed' AND c.retryable))
    -- xmax is 0 on a row this statement inserted, our transaction's id on one it updated.
    RETURNING c.scope, c.key, c.token, c.attempts, c.xmax = 0 AS inserted
)
SELECT i.scope, i.key,
       coalesce(cl.token, CASE WHEN e.claim_request_id = $7::bigint AND e.owner = $4
                                    AND e.status = 'in_progress' THEN e.token END) AS token,
       cl.attempts, cl.inserted,
       e.status, s.same AS same_payload, e.token AS row_token,
       e.lease_until > now() AS lease_live, e.result::text AS result, e.reason, e.error,
       e.attempts AS existing_attempts, e.dead_lettered_at IS NOT NULL AS dead_lettered,
       -- A re-claim of a key its worker handed back at a graceful stop (give_back), not of
       -- a dead worker's lapsed lease. The main query reads the rows as they were before
       -- this statement; only re-claims (rare) look.
       CASE WHEN NOT cl.inserted THEN
           (SELECT b.status = 'in_progress' AND b.error IS NOT DISTINCT FROM 'handed back'
              FROM dedupe_claims b WHERE b.scope = i.scope AND b.key = i.key)
       END AS handed_back,
       -- A conflict's other side: the claim's scheme (NULL: raw), hash and kept payload.
       CASE WHEN NOT s.same THEN e.fingerprint END AS row_fingerprint,
       CASE WHEN NOT s.same THEN e.payload_hash END AS row_hash,
       CASE WHEN NOT s.same THEN e.payload END AS row_payload
FROM input i
LEFT JOIN claimed cl ON cl.scope = i.scope AND cl.key = i.key
LEFT JOIN dedupe_claims e ON cl.token IS NULL AND e.scope = i.scope AND e.key = i.key
-- The comparison of the ON CONFLICT clause above, for the row in the way.
CROSS JOIN LATERAL (
    SELECT CASE WHEN e.fingerprint IS NOT DISTINCT FROM i.fingerprint
                    THEN e.payload_hash = i.payload_hash
                WHEN e.fingerprint IS NULL
                    THEN e.payload_hash = coalesce(i.raw_hash, i.payload_hash)
                ELSE true END AS same
) s;

-- name: claim_one_transaction
-- One-transaction mode of the workers (dedupe/pipeline/one_transaction.py; the HTTP
-- middleware's is an INSERT like it, prepared: prepare_http_one_transaction): a first delivery
-- claims its key inside the transaction that then runs the handler and records the
-- completion. Only a key without a row is claimed here: a row of any state (committed) is
-- not, and the message or request goes to the two-commit claim (claim_batch), which decides
-- as usual. A row another transaction inserted and has not committed makes this statement
-- wait for it (bounded by the transaction's lock_timeout): once it commits, nothing is
-- inserted; once it rolls back, the key is ours. Attempts start at 1, as in claim_batch; the
-- token comes from the same sequence. The lock_timeout bounds this claim alone: set_config
-- (evaluated once the row is in) lifts it for the rest of the transaction, whose statements
-- statement_timeout bounds instead. The NOT EXISTS read of the statement's snapshot leaves a
-- key with a committed row (a duplicate) out before a token is drawn, so a duplicate burns no
-- sequence value and writes nothing. The first column is the token (NULL: not claimed); for a
-- key with a committed row the others give that row's state, read in the statement's
-- snapshot (status, stored result, whether the request is the same: claim_batch's comparison;
-- a row committed while the statement waited is not seen: NULLs). The workers read the token
-- only: those columns served the HTTP middleware's replays before its claim moved to
-- prepare_http_one_transaction, and are left while the workers' statement is unchanged.
-- $1..$7 ClaimRequest.row (scope, key, payload hash, fingerprint scheme, raw hash, kept
-- payload, owner), $8 lease (s), $9 retention (s), $10 claim request id.
WITH claimed AS (
    INSERT INTO dedupe_claims AS c
        (scope, key, payload_hash, fingerprint, raw_hash, payload, status, token, owner,
         attempts, lease_until, expires_at, claim_request_id)
    SELECT $1::text, $2::text, $3::bytea, $4::text, $5::bytea, $6::bytea, 'in_progress',
           nextval('dedupe_claim_tokens'), $7::text, 1,
           now() + make_interval(secs => $8::float8), now() + make_interval(secs => $9::float8),
           $10::bigint
    WHERE NOT EXISTS (SELECT 1 FROM dedupe_claims f WHERE f.scope = $1::text AND f.key = $2::text)
    ON CONFLICT (scope, key) DO NOTHING
    RETURNING c.token
)
SELECT cl.token, set_config('lock_timeout', '0', true) AS lock_timeout,
       e.status, e.result::text AS result,
       CASE WHEN e.fingerprint IS NOT DISTINCT FROM $4::text THEN e.payload_hash = $3::bytea
            WHEN e.fingerprint IS NULL THEN e.payload_hash = coalesce($5::bytea, $3::bytea)
            ELSE true END AS same_payload
FROM (SELECT 1) AS one
LEFT JOIN claimed cl ON true
LEFT JOIN dedupe_claims e ON cl.token IS NULL AND e.scope = $1::text AND e.key = $2::text;

-- name: first_attempt_failed
-- One-transaction mode: the run of a first delivery failed and its transaction rolled back
-- whole (its claim with it). This commits the failed attempt on its own: a claim with
-- attempts = 1 whose lease has ended, marked handed back (claim_batch then re-claims it as
-- a key given back, not a dead worker's: counted at its start, not run alone), so that the
-- two-commit path that runs the message next counts it as attempt 2 and a poison message is
-- dead-lettered after max_attempts runs in all. A row that is there already (a competing
-- delivery claimed the key meanwhile) is left alone.
INSERT INTO dedupe_claims AS c
    (scope, key, payload_hash, fingerprint, raw_hash, payload, status, token, owner,
     attempts, lease_until, expires_at, error)
VALUES ($1, $2, $3, $4, $5, $6, 'in_progress', nextval('dedupe_claim_tokens'), $7, 1,
        now(), now() + make_interval(secs => $8), 'handed back')
ON CONFLICT (scope, key) DO NOTHING
RETURNING c.token;

-- name: heartbeat
-- Extend the leases we still hold; the rows that come back are the ones still ours. A key we
-- handed back (give_back: 'handed back', or 'handed back after a take-over' for a dead
-- worker's key) is not ours any more although its token is: a beat sent before the give-back
-- and run after it must not hold the key again for a whole lease.
UPDATE dedupe_claims AS c
   SET lease_until = now() + make_interval(secs => i.lease_s), updated_at = now()
  FROM unnest($1::text[], $2::text[], $3::bigint[], $4::float8[]) AS i(scope, key, token, lease_s)
 WHERE c.scope = i.scope AND c.key = i.key AND c.token = i.token AND c.status = 'in_progress'
   AND c.error IS DISTINCT FROM 'handed back'
   AND c.error IS DISTINCT FROM 'handed back after a take-over'
RETURNING c.scope, c.key;

-- name: complete
-- Record outcomes, fenced by the token: a key taken over by another worker is not ours to
-- complete. Run inside the handler's transaction when it wrote through ctx.db. Repeating it
-- (after a reply lost to a broken connection) finds our own outcome and answers the same.
UPDATE dedupe_claims AS c
   SET status = 'completed', result = i.result::jsonb, lease_until = NULL, error = NULL,
       updated_at = now(), expires_at = now() + make_interval(secs => i.retention_s)
  FROM unnest($1::text[], $2::text[], $3::bigint[], $4::text[], $5::float8[])
       AS i(scope, key, token, result, retention_s)
 WHERE c.scope = i.scope AND c.key = i.key AND c.token = i.token
   AND c.status IN ('in_progress', 'completed')
RETURNING c.scope, c.key;

-- name: complete_one
-- `complete` for one outcome, with scalars: what a handler's or a request's own transaction
-- completes (no arrays to build on the client nor to unnest on the server).
UPDATE dedupe_claims AS c
   SET status = 'completed', result = $4::jsonb, lease_until = NULL, error = NULL,
       updated_at = now(), expires_at = now() + make_interval(secs => $5::float8)
 WHERE c.scope = $1 AND c.key = $2 AND c.token = $3
   AND c.status IN ('in_progress', 'completed')
RETURNING c.scope, c.key;

-- name: prepare_http_one_transaction
-- The HTTP middleware's one-transaction claim and completion (dedupe.asgi.one_transaction),
-- prepared once per connection (SQL PREPARE: session state, kept across transactions, their
-- rollbacks and the pool's reset; named so as not to meet asyncpg's own). Each then goes as
-- an EXECUTE in a simple query with the statements around it, in one round trip: BEGIN with
-- its bounds and the claim, then the completion, the COMMIT and the pool's reset. That
-- protocol has no parameters, and asyncpg keeps only the last command's status of it: the
-- values are literals, quoted by dedupe.claims.database.sql_value, and the outcome is that
-- status or an error. The PREPAREs go after the BEGIN and its bounds (an INSERT's PREPARE
-- takes the table's lock, as the claim does).
--
-- dedupe_http_claim_v1: claim_one_transaction's INSERT, of the row as it will commit. Its status
-- says whether the key is ours: INSERT 0 1, or INSERT 0 0 (a row of any state is in the way,
-- committed, or committed while the statement waited on it; the caller reads it). Only a row
-- inserted lifts the lock_timeout for the rest of the transaction. The token is drawn from the
-- sequence in this session and not read back: the completion fences on currval. The row goes in
-- as it will commit: completed, no lease, expiring after the retention (no other transaction
-- sees it before the COMMIT; a duplicate waits on it, as on any uncommitted row). The completion
-- then writes the response into it without changing an indexed column's value (status,
-- lease_until, and expires_at: now() is the transaction's start), so a HOT update where the
-- row's page has room: no index entry for it; and the claim has none in the index of keys in
-- progress.
-- $1..$7 ClaimRequest.row (scope, key, payload hash, fingerprint scheme, raw hash, kept
-- payload, owner), $8 retention (s), $9 claim request id.
--
-- dedupe_http_complete_v1: complete_one in a statement that fails when the fence refuses: the
-- SELECT divides by the count of rows completed, so a refused completion raises
-- division_by_zero, which ends the query before its COMMIT with the transaction aborted, for the
-- caller to roll back. The fence is the token given ($3), or, when it is NULL, the one this
-- session drew last (currval): the claim's, in this transaction (nothing else draws one in a
-- one-transaction request: its steps are refused; should anything, the fence refuses). The row
-- is one the claim above inserted completed, or (a test's) one in progress under a lease.
-- $1 scope, $2 key, $3 token (NULL: currval), $4 result, $5 retention (s).
PREPARE dedupe_http_claim_v1 (text, text, bytea, text, bytea, bytea, text, float8, bigint) AS
INSERT INTO dedupe_claims AS c
    (scope, key, payload_hash, fingerprint, raw_hash, payload, status, token, owner,
     attempts, lease_until, expires_at, claim_request_id)
SELECT $1, $2, $3, $4, $5, $6, 'completed', nextval('dedupe_claim_tokens'), $7, 1,
       NULL, now() + make_interval(secs => $8), $9
WHERE NOT EXISTS (SELECT 1 FROM dedupe_claims f WHERE f.scope = $1 AND f.key = $2)
ON CONFLICT (scope, key) DO NOTHING
RETURNING set_config('lock_timeout', '0', true);
PREPARE dedupe_http_complete_v1 (text, text, bigint, jsonb, float8) AS
WITH done AS (
    UPDATE dedupe_claims AS c
       SET status = 'completed', result = $4, lease_until = NULL, error = NULL,
           updated_at = now(), expires_at = now() + make_interval(secs => $5)
     WHERE c.scope = $1 AND c.key = $2 AND c.token = coalesce($3, currval('dedupe_claim_tokens'))
       AND c.status IN ('in_progress', 'completed')
    RETURNING 1
)
SELECT 1 / count(*)::int FROM done;

-- name: hand_back_ended_one_transaction
-- The HTTP middleware's one-transaction run whose endpoint ended the transaction itself (a
-- COMMIT or ROLLBACK sent through request.state.idempotency.db) and then failed: a claim row it
-- committed (completed in place, no result: prepare_http_one_transaction) is handed back as a
-- first attempt that failed (first_attempt_failed's row: attempts 1, its lease over), so the
-- retry takes the key over on the two-commit path instead of meeting a key completed without
-- an answer. Fenced by the token this session drew (currval), in the claim's session; no row
-- (the endpoint rolled the claim back) is nothing to do.
UPDATE dedupe_claims AS c
   SET status = 'in_progress', lease_until = now(), error = 'handed back', updated_at = now()
 WHERE c.scope = $1 AND c.key = $2 AND c.token = currval('dedupe_claim_tokens')
   AND c.status = 'completed' AND c.result IS NULL;

-- name: complete_unlocked
-- `complete` for a statement shared by callers that must not wait for each other (the
-- receiver's replies): a row another transaction holds locked is skipped, not waited for, and
-- its caller completes it in a statement of its own. Returns each claim (key and token)
-- completed (true) and each skipped for its lock (false); one in neither was not ours to
-- complete (the token tells a lapsed claim's outcome from its new owner's in one statement).
WITH i AS (
    SELECT * FROM unnest($1::text[], $2::text[], $3::bigint[], $4::text[], $5::float8[])
        AS i(scope, key, token, result, retention_s)
), free AS MATERIALIZED (
    SELECT c.scope, c.key
      FROM dedupe_claims AS c JOIN i ON c.scope = i.scope AND c.key = i.key
       FOR UPDATE OF c SKIP LOCKED
), done AS (
    UPDATE dedupe_claims AS c
       SET status = 'completed', result = i.result::jsonb, lease_until = NULL, error = NULL,
           updated_at = now(), expires_at = now() + make_interval(secs => i.retention_s)
      FROM i JOIN free ON free.scope = i.scope AND free.key = i.key
     WHERE c.scope = i.scope AND c.key = i.key AND c.token = i.token
       AND c.status IN ('in_progress', 'completed')
    RETURNING c.scope, c.key, c.token
)
SELECT scope, key, token, true AS completed FROM done
UNION ALL
SELECT i.scope, i.key, i.token, false FROM i
 WHERE NOT EXISTS (SELECT 1 FROM free WHERE free.scope = i.scope AND free.key = i.key)
   AND EXISTS (SELECT 1 FROM dedupe_claims AS c WHERE c.scope = i.scope AND c.key = i.key);

-- name: record_attempt
-- Count the next attempt before running it (a retry, or the first run after a take-over), so
-- crash loops are counted. $4 is the last error, or NULL to keep the one recorded. $6 is the
-- count this attempt makes: sent again after a lost reply, the statement finds it reached
-- and counts nothing more.
UPDATE dedupe_claims
   SET attempts = CASE WHEN attempts >= $6 THEN attempts ELSE attempts + 1 END,
       error = coalesce($4, error),
       lease_until = now() + make_interval(secs => $5), updated_at = now()
 WHERE scope = $1 AND key = $2 AND token = $3 AND status = 'in_progress'
RETURNING attempts;

-- name: fail
-- A terminal failure (dead-lettered): duplicates of this key are acknowledged from now on.
-- Repeating it finds our own failure and answers the same. $4: its reason (a Reason value),
-- $5: the detail, each in its own column (the dead letter's x-dedupe-reason and -detail).
UPDATE dedupe_claims
   SET status = 'failed', retryable = false, reason = $4, error = $5, lease_until = NULL,
       updated_at = now(), expires_at = now() + make_interval(secs => $6),
       dead_lettered_at = NULL
 WHERE scope = $1 AND key = $2 AND token = $3 AND status IN ('in_progress', 'failed')
RETURNING 1;

-- name: mark_dead_lettered
-- The broker confirmed the dead letters of these failed keys, fenced by the token of the
-- failure they report (a key failed again under a newer claim keeps its own record).
UPDATE dedupe_claims AS c
   SET dead_lettered_at = now()
  FROM unnest($1::text[], $2::text[], $3::bigint[]) AS i(scope, key, token)
 WHERE c.scope = i.scope AND c.key = i.key AND c.token = i.token AND c.status = 'failed'
   AND c.dead_lettered_at IS NULL;

-- name: give_back
-- Graceful shutdown: hand the key back at once; $4: take back the interrupted attempt
-- (only if it was counted), $6 being the count that attempt made: sent again after a lost
-- reply, the statement finds it taken back already. $5: mark it with the error 'handed
-- back' (claim_batch reads it), so its next run need not wait alone as a dead worker's key
-- does; a dead worker's key whose run never finished is marked 'handed back after a
-- take-over' instead, which keeps its crash history (its next claim is a take-over again, and
-- the history says so). The heartbeat skips both marks. The next claim clears them.
UPDATE dedupe_claims
   SET lease_until = now(),
       attempts = CASE WHEN $4 AND attempts >= $6 THEN greatest($6 - 1, 0) ELSE attempts END,
       error = CASE WHEN $5 THEN 'handed back' ELSE 'handed back after a take-over' END,
       updated_at = now()
 WHERE scope = $1 AND key = $2 AND token = $3 AND status = 'in_progress'
RETURNING 1;

-- name: release
-- Operator: make a stuck or failed key processable again, with a fresh attempt count. The
-- next claim bumps the token, so a worker that still runs the key cannot complete it.
-- Completed keys are left alone: their effects happened.
UPDATE dedupe_claims
   SET lease_until = now(), retryable = true, attempts = 0, updated_at = now()
 WHERE scope = $1 AND key = $2 AND status IN ('in_progress', 'failed')
RETURNING status;

-- name: release_failed
-- Replaying a dead letter: release its key only while the claim is failed. A claim in
-- progress may be running right now; cutting its lease would let a second run start.
UPDATE dedupe_claims
   SET lease_until = now(), retryable = true, attempts = 0, updated_at = now()
 WHERE scope = $1 AND key = $2 AND status = 'failed'
RETURNING status;

-- name: gc_batch
-- Delete one batch of expired rows. SKIP LOCKED keeps clean-up out of the workers' way.
-- Rows are picked by their primary key, not by ctid (a ctid names a row only within one
-- partition: on a partitioned claims table it would match live rows of other partitions),
-- and the outer DELETE checks the expiry again.
DELETE FROM dedupe_claims AS c
 USING (SELECT scope, key FROM dedupe_claims
         WHERE expires_at < now() AND (status <> 'in_progress' OR lease_until < now())
         ORDER BY expires_at
         LIMIT $1
           FOR UPDATE SKIP LOCKED) AS expired
 WHERE c.scope = expired.scope AND c.key = expired.key
   AND c.expires_at < now() AND (c.status <> 'in_progress' OR c.lease_until < now());

-- name: list_claims
-- Ages count from the current run's claim (claimed_at), not the key's first one.
-- The scope filter is a scope and its tenants: starts_with, as LIKE would read _ and % as wildcards.
SELECT scope, key, status, retryable, token, owner, attempts, lease_until, reason, error,
       created_at, claimed_at, updated_at, expires_at,
       extract(epoch FROM now() - claimed_at)::float8 AS age_s
  FROM dedupe_claims
 WHERE ($1::text IS NULL OR scope = $1 OR starts_with(scope, $1 || '/'))
   AND ($2::text IS NULL OR status = $2)
   AND ($3::float8 IS NULL OR claimed_at < now() - make_interval(secs => $3))
 ORDER BY claimed_at DESC
 LIMIT $4;

-- name: show_claim
SELECT scope, key, encode(payload_hash, 'hex') AS payload_hash, status, retryable, token, owner,
       attempts, lease_until, result::text AS result, reason, error, created_at, updated_at,
       expires_at, lease_until > now() AS lease_live
  FROM dedupe_claims
 WHERE scope = $1 AND key = $2;

-- name: token_floor
-- Every new pooled connection, before its first statement: the fencing tokens of a timeline
-- start at its number shifted left 40 bits. A standby promoted after an asynchronous
-- failover is a new timeline whose sequence may stand behind tokens the old primary issued
-- in the commits it lost; a worker still running such a claim would find its token issued
-- again and pass the fence. With the sequence moved past (timeline << 40) before the new
-- primary's first claim, no token of an earlier timeline can come again. The advisory lock
-- makes the read and the setval one step (two connections setting it back and forth could
-- issue a token twice); once past the floor, nextval only climbs, and nothing is set. On a
-- standby (recovery), or before `migrate` made the sequence, it does nothing. It never fails
-- the connection: what went wrong (a role without UPDATE on the sequence, a read-only
-- session, a server without pg_walfile_name) is left in the session setting
-- dedupe.token_floor, which the pool's init reads and logs (dedupe.claims.database).
DO $$
DECLARE
    floor bigint;
BEGIN
    PERFORM set_config('dedupe.token_floor', 'skipped', false);
    IF pg_is_in_recovery() OR to_regclass('dedupe_claim_tokens') IS NULL THEN
        RETURN;
    END IF;
    floor := ('x' || substr(pg_walfile_name(pg_current_wal_lsn()), 1, 8))::bit(32)::bigint << 40;
    IF (SELECT last_value FROM dedupe_claim_tokens) < floor THEN
        PERFORM pg_advisory_xact_lock(7236510948421338418);
        IF (SELECT last_value FROM dedupe_claim_tokens) < floor THEN
            PERFORM setval('dedupe_claim_tokens', floor);
        END IF;
    END IF;
    PERFORM set_config('dedupe.token_floor', 'ok', false);
EXCEPTION WHEN OTHERS THEN
    PERFORM set_config('dedupe.token_floor', SQLSTATE || ' ' || SQLERRM, false);
END
$$;

-- name: look_up
-- The HTTP middleware, before a one-transaction claim (dedupe/asgi/one_transaction.py): the
-- rows of many keys in one read, shared by concurrent requests (no lock, no write, no
-- transaction id). A key without a row goes on to the claim (prepare_http_one_transaction);
-- a replay (completed, the same request) is answered from here, as the two-commit
-- claim_batch answers it from its own read; any other row goes to claim_batch. The claim
-- also reads with it, for one key, in its transaction, when its INSERT finds a row.
-- $1 scopes, $2 keys, $3 payload hashes, $4 fingerprint schemes, $5 raw hashes (one per key).
SELECT e.status, e.result::text AS result,
       CASE WHEN e.status IS NULL THEN NULL
            WHEN e.fingerprint IS NOT DISTINCT FROM i.fingerprint THEN e.payload_hash = i.payload_hash
            WHEN e.fingerprint IS NULL THEN e.payload_hash = coalesce(i.raw_hash, i.payload_hash)
            ELSE true END AS same_payload
FROM unnest($1::text[], $2::text[], $3::bytea[], $4::text[], $5::bytea[])
         WITH ORDINALITY AS i(scope, key, payload_hash, fingerprint, raw_hash, n)
LEFT JOIN dedupe_claims e ON e.scope = i.scope AND e.key = i.key
ORDER BY i.n;

-- name: young_table
-- Whether the claims table has outgrown the statistics its cached plans were made from: its
-- rows as last analyzed (-1: never) and as counted now. The store analyzes a table that holds
-- many more rows than its last ANALYZE saw (dedupe/claims/store.py, ClaimStore._analyze_if_young), if
-- its role may: PostgreSQL skips, with a mere warning, a table its role does not own.
SELECT c.reltuples::bigint AS analyzed_rows, coalesce(s.n_live_tup, 0) AS live_rows,
       pg_has_role(c.relowner, 'USAGE') AS may_analyze
  FROM pg_class c
  LEFT JOIN pg_stat_user_tables s ON s.relid = c.oid
 WHERE c.oid = to_regclass('dedupe_claims');
