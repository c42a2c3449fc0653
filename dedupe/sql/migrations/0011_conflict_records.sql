-- Conflict records are written before their message is settled (the dead letter, the 422),
-- and the HTTP middleware's 422s are recorded too. An HTTP request has no channel to publish
-- a run-as copy to: its record names the request instead (method and path, never the query).
ALTER TABLE dedupe_conflicts ALTER COLUMN channel DROP NOT NULL;
ALTER TABLE dedupe_conflicts ADD COLUMN http_request text;
