"""The dedupe-worker app the benchmarks run: one handler, a no-op or a one-row insert, or one
that publishes one message to `<channel>-out`: through the outbox (`outbox`) or directly with
a confirming publisher before it returns (`direct`)."""

from __future__ import annotations

from typing import Any

from dedupe import App, Context

PUBLISHING = ("outbox", "direct")


def out_channel(channel: str) -> str:
    """Where the publishing handlers publish."""
    return f"{channel}-out"


def make_app(channel: str, handler: str, tally: Any = None, publisher: Any = None) -> App:
    """An app with one handler on `channel`; `tally.settled(body)` hears each completion.
    `publisher` (dedupe.transport.Publisher) is the `direct` handler's."""
    app = App("bench")
    out = out_channel(channel)

    if handler == "outbox":

        @app.handler(channel, name="outbox")
        async def outbox(body: bytes, ctx: Context) -> None:
            await ctx.publish(out, body)

    elif handler == "direct":
        if publisher is None:
            raise ValueError("the direct handler needs a publisher")

        @app.handler(channel, name="direct")
        async def direct(body: bytes, ctx: Context) -> None:
            # What a handler without an outbox writes: publish, wait for the confirm, return.
            await publisher.publish(out, body, message_id=f"{ctx.key}/0", headers={})

    elif handler in ("insert", "insert-group"):

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
