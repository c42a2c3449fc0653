"""The RabbitMQ consumer reads deliveries straight from aiormq's channel reader.

`dedupe_rabbitmq.transport._deliver_from_the_reader` replaces the channel's `_on_deliver_frame`
for one channel; it leans on three methods of aiormq's `Channel`. When an aiormq release
renames them, the consumer falls back to the callback with a task per delivery, slower but
correct; these tests make that fall-back visible instead of silent.
"""

from __future__ import annotations

import inspect

import pytest

aiormq_channel = pytest.importorskip("aiormq.channel")

from dedupe_rabbitmq.transport import _deliver_from_the_reader  # noqa: E402


def test_aiormqs_channel_has_the_methods_the_reader_hook_uses() -> None:
    channel = aiormq_channel.Channel
    for name in ("_get_frame", "_read_content", "_on_deliver_frame"):
        assert callable(getattr(channel, name, None)), name
    # The reader looks the handler up on the instance for every Deliver frame.
    assert "self._on_deliver_frame(frame)" in inspect.getsource(channel._reader)


def test_the_hook_replaces_the_handler_of_one_channel_only() -> None:
    class FakeChannel:
        async def _get_frame(self) -> None: ...

        async def _read_content(self, frame: object, header: object) -> None: ...

        async def _on_deliver_frame(self, frame: object) -> None: ...

    hooked, other = FakeChannel(), FakeChannel()
    _deliver_from_the_reader(hooked, lambda frame: None)  # type: ignore[arg-type]
    assert "_on_deliver_frame" in vars(hooked)
    assert "_on_deliver_frame" not in vars(other)


def test_without_the_methods_the_channel_is_left_as_it_is() -> None:
    class Bare:
        pass

    bare = Bare()
    _deliver_from_the_reader(bare, lambda frame: None)  # type: ignore[arg-type]
    assert vars(bare) == {}
