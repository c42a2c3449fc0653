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
