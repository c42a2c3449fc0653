"""dedupe-worker: message consumers that are safe to retry.

Claim an idempotency key in PostgreSQL before the handler runs, record the outcome with the
handler's own writes, and acknowledge redeliveries without repeating their effects.
"""

from __future__ import annotations

from .app import App, Handler
from .context import Context, Database
from .errors import DedupeError, Reject, Retry
from .message import Headers, Message
from .worker import Worker

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
