"""Conflicts through the real CLI: `claims show` prints both fingerprints and the diff,
`conflicts list` lists them, `conflicts settle` discards or runs the second payload."""

from __future__ import annotations

import json

import asyncpg
import pytest
from pydantic import BaseModel

from dedupe import App, Context
from dedupe.claims.store import ClaimStore
from dedupe.observability.activity import Activity
from dedupe.pipeline.processor import Processor
from dedupe.testing.deliveries import MemoryDelivery, make_message
from tests.acceptance.test_admin_commands import cli

FIRST = b'{"order": "o-1", "amount": 1000, "note": "card 4242", "sent_at": "10:00:00"}'
SECOND = b'{"order": "o-1", "amount": 1200, "coupon": "SECRET10", "sent_at": "10:00:07"}'
SECRETS = ("4242", "SECRET10", "1000", "1200")


class Order(BaseModel):
    order: str


@pytest.fixture
async def conflicts(store: ClaimStore, db: asyncpg.Connection) -> asyncpg.Connection:
    """shop.place/pay-1 and pay-2: each claimed with FIRST, then refused SECOND."""
    app = App("shop")

    @app.handler(
        "orders",
        key="header:Idempotency-Key",
        fingerprint="json",
        fingerprint_exclude=("sent_at",),
        keep_payload=True,
    )
    async def place(order: Order, ctx: Context) -> None:
        pass

    def d(key: str, body: bytes, message_id: str) -> MemoryDelivery:
        headers = {"Idempotency-Key": key}
        return MemoryDelivery(make_message("orders", body, message_id=message_id, headers=headers))

    async with (
        Activity(store) as activity,
        Processor(app, store, observers=[activity]) as processor,
    ):
        for key in ("pay-1", "pay-2"):
            await processor.process("orders", [d(key, FIRST, f"{key}-a")])
            await processor.process("orders", [d(key, SECOND, f"{key}-b")])
    return db


async def test_claims_show_prints_a_conflict_with_both_fingerprints_and_its_diff(
    db_url: str, conflicts: object
) -> None:
    """As a table for people and as JSON; no value of either payload in either."""
    text = await cli(db_url, "claims", "show", "shop.place", "pay-1", "--table")
    assert text.returncode == 0, text.stderr
    print(text.stdout)  # the closing note quotes this output
    out = text.stdout
    assert "fingerprint" in out and 'json exclude=["sent_at"]' in out
    assert "differs at     ~ amount (number)" in out
    assert "+ coupon (string)" in out and "- note (string)" in out
    assert "dedupe-worker conflicts settle shop.place pay-1 --discard | --run-as NEW_KEY" in out
    shown = await cli(db_url, "claims", "show", "shop.place", "pay-1")
    [conflict] = json.loads(shown.stdout)["conflicts"]
    assert conflict["diff"] == ["~ amount (number)", "+ coupon (string)", "- note (string)"]
    assert not any(secret in out + shown.stdout for secret in SECRETS)


async def test_conflicts_are_listed_and_settled_both_ways(
    db_url: str, conflicts: asyncpg.Connection
) -> None:
    """--run-as queues the second payload in the outbox under the new key; --discard drops it;
    settled conflicts leave the default list."""
    listed = await cli(db_url, "conflicts", "list", "--json")
    assert sorted(r["key"] for r in json.loads(listed.stdout)) == ["pay-1", "pay-2"]
    table = await cli(db_url, "conflicts", "list")
    assert "~ amount (number); + coupon (string)" in table.stdout

    run = await cli(
        db_url, "conflicts", "settle", "shop.place", "pay-1", "--run-as", "pay-1b", "--yes"
    )
    assert run.returncode == 0, run.stderr
    assert "goes to orders as key pay-1b, message id pay-1-b" in run.stdout
    row = await conflicts.fetchrow("SELECT channel, message_id, body, headers FROM dedupe_outbox")
    assert (row["channel"], row["message_id"], bytes(row["body"])) == ("orders", "pay-1-b", SECOND)
    headers = json.loads(row["headers"])
    assert (headers["x-dedupe-run-as-scope"], headers["x-dedupe-run-as"]) == (
        "shop.place",
        "pay-1b",
    )

    discard = await cli(db_url, "conflicts", "settle", "shop.place", "pay-2", "--discard", "--yes")
    assert discard.returncode == 0, discard.stderr
    assert "discarded the second payload of shop.place/pay-2" in discard.stdout
    assert await conflicts.fetchval("SELECT count(*) FROM dedupe_outbox") == 1

    left = await cli(db_url, "conflicts", "list")
    assert left.stdout.strip() == "no unsettled conflicts"
    settled = await cli(db_url, "conflicts", "list", "--all", "--json")
    assert sorted(r["settled"] for r in json.loads(settled.stdout)) == [
        "discarded",
        "run as pay-1b",
    ]
    again = await cli(db_url, "conflicts", "settle", "shop.place", "pay-2", "--discard", "--yes")
    assert again.returncode == 1
    assert "no unsettled conflict for shop.place/pay-2" in again.stderr


async def test_settling_asks_first_and_needs_one_way(db_url: str, conflicts: object) -> None:
    """Without --yes and a terminal nothing is done; --discard and --run-as exclude each
    other and one of them is required."""
    asked = await cli(db_url, "conflicts", "settle", "shop.place", "pay-1", "--discard")
    assert asked.returncode != 0 and "--yes" in asked.stderr
    both = await cli(
        db_url, "conflicts", "settle", "shop.place", "pay-1", "--discard", "--run-as", "x"
    )
    assert both.returncode == 2 and "not allowed with" in both.stderr
    neither = await cli(db_url, "conflicts", "settle", "shop.place", "pay-1", "--yes")
    assert neither.returncode == 2 and "one of the arguments" in neither.stderr
    listed = await cli(db_url, "conflicts", "list", "--json")
    assert len(json.loads(listed.stdout)) == 2
