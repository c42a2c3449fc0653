"""The dedupe-worker app the benchmarks run: one handler, a no-op or a one-row insert."""

from __future__ import annotations

from typing import Any

from dedupe import App, Context


def make_app(channel: str, handler: str, tally: Any = None) -> App:
    """An app with one handler on `channel`; `tally.settled(body)` hears each completion."""
    app = App("bench")

    if handler in ("insert", "insert-group"):

        @app.handler(channel, name="insert", group_commit=handler == "insert-group")
        async def insert(body: bytes, ctx: Context) -> None:
            await ctx.db.execute("INSERT INTO bench_rows (id) VALUES ($1)", ctx.key)

    else:

        @app.handler(channel, name="noop")
        async def noop(body: bytes) -> None:
            return None

    if tally is not None:

        @app.hook("completed")
        async def completed(stage: str, message: Any, scope: str, key: str) -> None:
            if message.body[:1] == b"t":
                tally.settled(message.body)

    return app
