"""The webhook receiver (Starlette, served by uvicorn): verify, claim, publish with confirms, store
and
replay the reply; and the status page. Both are the CLI's `dedupe.servers` plug-ins."""

from __future__ import annotations

from dedupe_receiver.application import Receiver, create_receiver
from dedupe_receiver.status_page import StatusPage

__all__ = ["Receiver", "StatusPage", "create_receiver"]
