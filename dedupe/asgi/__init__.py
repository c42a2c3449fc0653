"""dedupe.asgi: a user's own HTTP endpoints made idempotent on the claims table, as plain ASGI
middleware (no web framework imported)."""

from __future__ import annotations

from dedupe.asgi.middleware import MAX_RESPONSE_BYTES, IdempotencyMiddleware
from dedupe.asgi.replies import NOT_STORED
from dedupe.asgi.state import Idempotency

__all__ = ["MAX_RESPONSE_BYTES", "NOT_STORED", "Idempotency", "IdempotencyMiddleware"]
