"""The middleware's 422s recorded before they are answered, as a worker's conflicts are before
their dead letter: `dedupe-worker conflicts list` shows them, `conflicts settle --discard`
marks them settled (an HTTP request cannot be run again from there: its client sends it again
under a new key)."""

from __future__ import annotations

import asyncio
import logging

from dedupe.asgi.run import STORE_TIMEOUT_S, Scope
from dedupe.claims import conflict_records
from dedupe.claims.conflicts import http_report
from dedupe.claims.records import ClaimRequest
from dedupe.claims.store import ClaimStore
from dedupe.claims.verdicts import Conflict, Unavailable, Verdict
from dedupe.errors import StoreError

logger = logging.getLogger("dedupe.asgi")


async def recorded(
    store: ClaimStore, scope: Scope, request: ClaimRequest, verdict: Verdict
) -> Verdict:
    """The verdict to answer: a Conflict once its record has committed (any other verdict as
    it is), Unavailable (a 503, the client's retry records it) when it could not be."""
    if not isinstance(verdict, Conflict):
        return verdict
    report = http_report(
        request,
        method=str(scope.get("method", "")),
        path=str(scope.get("root_path", "")) + str(scope.get("path", "")),
        claimed_fingerprint=verdict.fingerprint,
        claimed_hash=verdict.payload_hash,
    )
    try:
        async with asyncio.timeout(STORE_TIMEOUT_S):
            await conflict_records.record(store.pool, [report])
    except (StoreError, TimeoutError) as exc:
        logger.warning(
            "key %s: recording its conflict failed (%s)",
            request.key,
            exc,
            extra={"scope": request.scope, "key": request.key, "outcome": "unavailable"},
        )
        return Unavailable(f"recording the conflict failed: {exc}")
    return verdict


__all__ = ["recorded"]
