"""The webhook receiver (Starlette, served by uvicorn): verify, claim, publish with confirms, store
and replay the reply; and the status page. Both are the CLI's `dedupe.servers` plug-ins."""

from __future__ import annotations

# Every module of the package imports starlette (the servers uvicorn too, see servers.py);
# without it, say which extra to install.
try:
    import starlette  # noqa: F401
except ImportError as exc:  # pragma: no cover - depends on the install
    raise ImportError(
        "the webhook receiver needs starlette and uvicorn: pip install 'dedupe-worker[receiver]'"
    ) from exc

from dedupe_receiver.application import Receiver, create_receiver
from dedupe_receiver.status_page import StatusPage

__all__ = ["Receiver", "StatusPage", "create_receiver"]
