"""The dedupe-worker app the benchmarks run: one handler, a no-op or a one-row insert, or one
that publishes one message to `<channel>-out`: through the outbox (`outbox`) or directly with
a confirming publisher before it returns (`direct`); and the webhook receivers a user writes
without dedupe-worker, bench.receiver's baselines (`hand_written_receiver`, with the naive
check `naive_receiver`)."""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import os
from collections.abc import AsyncIterator
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


# -- the webhook receiver a user writes without dedupe-worker (bench.receiver's baseline) -----


def hand_written_receiver(*, publish: bool = True, naive: bool = False) -> Any:
    """`POST /webhooks/github` as a user would write it on the receiver's stack (Starlette on
    uvicorn): verify X-Hub-Signature-256 (HMAC-SHA256, constant-time compare), publish the event
    to a durable RabbitMQ queue with publisher confirms on one connection and one channel opened
    at startup, answer 202. No key is claimed, no reply stored: a replay is one more publish.
    `publish=False` (verify_only_receiver): the same without the publish, the least any
    receiver on this stack does for a request (what a replay cannot go below). `naive=True`
    (naive_receiver): with the check users write by hand around the publish.

    Run as `uvicorn --factory bench.apps:hand_written_receiver`; reads GITHUB_WEBHOOK_SECRET,
    BENCH_AMQP_URL and BENCH_QUEUE from the environment (only the secret without the publish;
    BENCH_DATABASE_URL besides for the naive check).
    """
    import aio_pika
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    if naive:
        import asyncpg

        from bench.baselines import NAIVE_INSERT, NAIVE_SELECT
        from dedupe.claims.database import connect_options

    secret = os.environ["GITHUB_WEBHOOK_SECRET"].encode()

    @contextlib.asynccontextmanager
    async def lifespan(api: Starlette) -> AsyncIterator[None]:
        url, queue = os.environ["BENCH_AMQP_URL"], os.environ["BENCH_QUEUE"]
        connection = await aio_pika.connect(url)
        async with contextlib.AsyncExitStack() as stack:
            await stack.enter_async_context(connection)
            if naive:
                # As many connections as `dedupe-worker receive` opens (--pool-size 20), and
                # its TLS choice (none to this machine unless the URL asks for it).
                dsn = os.environ["BENCH_DATABASE_URL"]
                api.state.pool = await stack.enter_async_context(
                    asyncpg.create_pool(dsn, min_size=1, max_size=20, **connect_options(dsn))
                )
            channel = await connection.channel(publisher_confirms=True)
            await channel.declare_queue(queue, durable=True)
            api.state.channel = channel
            api.state.queue = queue
            yield

    async def publish_event(request: Request, body: bytes, delivery: str) -> None:
        message = aio_pika.Message(
            body,
            message_id=delivery,
            content_type="application/json",
            headers={"x-github-event": request.headers.get("x-github-event", "")},
            delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
        )
        # Returns once RabbitMQ has confirmed it (the channel has publisher confirms on).
        await request.app.state.channel.default_exchange.publish(
            message, routing_key=request.app.state.queue
        )

    async def github(request: Request) -> JSONResponse:
        body = await request.body()
        signature = request.headers.get("x-hub-signature-256", "").removeprefix("sha256=")
        expected = hmac.new(secret, body, hashlib.sha256).hexdigest()
        if not hmac.compare_digest(expected.encode(), signature.encode()):
            return JSONResponse({"error": "bad signature"}, status_code=401)
        delivery = request.headers.get("x-github-delivery")
        if not delivery:
            return JSONResponse({"error": "no X-GitHub-Delivery"}, status_code=400)
        if naive:
            # The workers' naive consumer's check (bench.baselines.naive_check): in one
            # transaction, look the delivery up; publish and remember a new one, answer 202 for
            # one seen before. No lease, no fence, no comparison of bodies, no stored reply; two
            # copies of a delivery at once both publish (the second's INSERT fails: a 500).
            async with request.app.state.pool.acquire() as conn, conn.transaction():
                if await conn.fetchval(NAIVE_SELECT, delivery) is None:
                    await publish_event(request, body, delivery)
                    await conn.execute(NAIVE_INSERT, delivery)
        elif publish:
            await publish_event(request, body, delivery)
        return JSONResponse({"status": "accepted", "delivery": delivery}, status_code=202)

    routes = [Route("/webhooks/github", github, methods=["POST"])]
    return Starlette(routes=routes, lifespan=lifespan if publish else None)


def naive_receiver() -> Any:
    """hand_written_receiver with the naive check (`uvicorn --factory bench.apps:naive_receiver`;
    BENCH_DATABASE_URL holds bench_processed)."""
    return hand_written_receiver(naive=True)


def verify_only_receiver() -> Any:
    """hand_written_receiver without the publish: verify, 202 (`uvicorn --factory
    bench.apps:verify_only_receiver`, GITHUB_WEBHOOK_SECRET from the environment)."""
    return hand_written_receiver(publish=False)
