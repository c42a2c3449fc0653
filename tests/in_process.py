"""A keyed request to the test API called in-process as an ASGI app (bench.http_core's driver,
as uvicorn calls it): the tests that look inside the process (test_http_api_garbage.py,
test_http_api_round_trips.py)."""

from __future__ import annotations

import json
from typing import Any

from bench import http_core

BODY = json.dumps({"sku": "in-process", "quantity": 1}).encode()


async def post(app: Any, state: dict[str, Any], key: str, path: str) -> int:
    """One keyed POST of an order (`path` may carry a `?query`); its status."""
    headers = [
        (b"authorization", b"Bearer in-process"),
        (b"content-type", b"application/json"),
        (b"idempotency-key", key.encode()),
    ]
    return await http_core.post(app, state, path, headers, BODY)
