"""The one-transaction mode's pure rules: which deliveries may take it, and its bounds."""

from __future__ import annotations

import pytest

from dedupe import App, Context
from dedupe.asgi import one_transaction
from dedupe.errors import InvalidOption
from dedupe.pipeline import one_transaction as onetx
from dedupe.testing.deliveries import make_message


def handler(**options: object) -> object:
    app = App("rules")

    @app.handler("ch", one_transaction=True, **options)  # type: ignore[arg-type]
    async def h(payload: bytes, ctx: Context) -> None: ...

    return app.handlers["h"]


@pytest.mark.parametrize(
    ("meta", "attempt", "first"),
    [
        ({"redelivered": False}, 1, True),
        ({"redelivered": True}, 1, False),
        ({}, 1, False),  # a transport that says nothing: the two-commit path
        ({"redelivered": 0}, 1, False),  # only False itself says "first"
        ({"topic": "t", "partition": 0, "offset": 1, "redelivered": False}, 1, True),
        ({"redelivered": False}, 2, False),  # a deferred copy back from the delay queue
    ],
)
def test_only_a_delivery_the_transport_calls_first_takes_the_path(
    meta: dict[str, object], attempt: int, first: bool
) -> None:
    message = make_message("ch", b"{}", message_id="m", attempt=attempt, meta=meta)
    assert onetx.first_delivery(message) is first


def _bounds(h: object) -> tuple[float, bool, float, float]:
    """The run's bound, whether reaching it counts, the claim's lock_timeout and the session
    timeouts, as the one transaction takes them."""
    bound, counted = onetx.run_bound(h)  # type: ignore[arg-type]
    limits = onetx.transaction_bounds(h)  # type: ignore[arg-type]
    return bound, counted, limits.lock_s, limits.session_s


def test_the_bounds_follow_the_lease_and_a_shorter_timeout() -> None:
    assert _bounds(handler(lease_s=30.0)) == (30.0, False, 2.0, 31.0)
    # timeout_s shorter than the lease is the bound, and reaching it is a failed attempt
    assert _bounds(handler(lease_s=30.0, timeout_s=5.0)) == (5.0, True, 2.0, 6.0)
    # a timeout longer than the lease: the lease bounds the transaction, uncounted
    assert _bounds(handler(lease_s=3.0, timeout_s=10.0)) == (3.0, False, 1.0, 4.0)


def test_the_begin_statement_carries_numbers_only() -> None:
    assert onetx.begin_statement(handler(lease_s=3.0)) == (  # type: ignore[arg-type]
        "BEGIN; SET LOCAL lock_timeout = 1000; "
        "SET LOCAL idle_in_transaction_session_timeout = 4000; "
        "SET LOCAL statement_timeout = 4000"
    )


def test_invalid_option_is_a_value_error_naming_the_option() -> None:
    assert issubclass(InvalidOption, ValueError)
    app = App("rules")
    with pytest.raises(InvalidOption, match="one_transaction"):

        @app.handler("ch", one_transaction=True)
        async def no_ctx(payload: bytes) -> None: ...


def test_read_first_stops_reading_on_new_keys_and_starts_again_on_a_wave_of_retries() -> None:
    read_first = one_transaction.ReadFirst()
    assert read_first  # a process just started reads first
    new_keys = 0
    while read_first:
        read_first.saw(False)
        new_keys += 1
        assert new_keys < 100
    assert 15 <= new_keys <= 30  # about a window and a half of new keys
    for _ in range(200):
        read_first.saw(False)
    retries = 0
    while not read_first:
        read_first.saw(True)
        retries += 1
    assert retries <= 6  # a few stored keys in a row turn the read back on
    for _ in range(20):
        read_first.saw(True)
    read_first.saw(False)
    assert read_first  # one new key among retries does not turn it off
