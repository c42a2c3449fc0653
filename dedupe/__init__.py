"""dedupe-worker: message consumers that are safe to retry.

Claim an idempotency key in PostgreSQL before the handler runs, record the outcome with the
handler's own writes, and acknowledge redeliveries without repeating their effects.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dedupe.app import App, Handler
    from dedupe.context import Context, Database
    from dedupe.errors import DedupeError, Reject, Retry
    from dedupe.message import Headers, Message
    from dedupe.worker import Worker

# Loaded on first use, so that importing a submodule alone (the pytest plugin, which every
# pytest run of a project with dedupe-worker installed loads) costs nothing more.
_EXPORTS = {
    "App": ".app",
    "Handler": ".app",
    "Context": ".context",
    "Database": ".context",
    "DedupeError": ".errors",
    "Reject": ".errors",
    "Retry": ".errors",
    "Headers": ".message",
    "Message": ".message",
    "Worker": ".worker",
}


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'dedupe' has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])


__all__ = [
    "App",
    "Context",
    "Database",
    "DedupeError",
    "Handler",
    "Headers",
    "Message",
    "Reject",
    "Retry",
    "Worker",
]
__version__ = "0.1.0"
