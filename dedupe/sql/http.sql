-- Named queries of the HTTP middleware's one-transaction mode (dedupe/asgi/one_transaction.py).

-- name: claim_in_transaction
-- A keyed request claims its key inside the transaction that then runs the endpoint and stores
-- its response. As the workers' claim_one_transaction (queries.sql), only a key without any
-- row is claimed (attempts = 1, a token from the claims' sequence); a row another transaction
-- inserted and has not committed is waited for (the transaction's lock_timeout): once it
-- commits nothing is inserted, once it rolls back the key is ours. The lock_timeout bounds
-- this claim alone: set_config lifts it for the rest of the transaction (statement_timeout
-- bounds the endpoint's statements instead).
-- Unlike the workers' statement, a key with a committed row answers with that row's state
-- (read in the statement's snapshot: a row committed while this one waited is not seen, and
-- the two-commit claim decides), so that a replay is answered from this one round trip: its
-- status, its stored response and whether the request is the same (the comparison of
-- claim_batch). The NOT EXISTS read leaves a key with a committed row out before a token is
-- drawn: a replay burns no sequence value and writes nothing.
-- $1 scope, $2 key, $3 payload hash, $4 fingerprint scheme, $5 raw hash, $6 kept payload,
-- $7 owner, $8 lease (s), $9 retention (s), $10 claim request id.
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

-- name: look_up
-- Before a one-transaction claim: the rows of many keys in one read, shared by concurrent
-- requests (no lock, no write, no transaction id). A key without a row goes on to
-- claim_in_transaction; a replay (completed, the same request) is answered from here, as the
-- two-commit claim_batch answers it from its own read; any other row goes to claim_batch.
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
