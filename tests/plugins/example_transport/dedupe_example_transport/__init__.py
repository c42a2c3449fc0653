"""An example third-party transport: `example:///some/dir` reads and writes JSON-lines files.

- `<dir>/<channel>.jsonl` holds the channel's messages, one JSON object a line:
  `{"body": "...", "message_id": "...", "headers": {...}}`; the transport reads it from the
  start and follows it as lines are appended (a file has no acks: a restart reads it all
  again, and the claims make every message already handled a duplicate).
- `<dir>/settlements.jsonl` gets one line per settlement the core tells the transport:
  `{"channel", "message_id", "action", "duplicate", "reason", "scope", "key", "result"}`.
- `<dir>/<channel>.dlq.jsonl` holds dead letters, with the reason in dedupe's headers.

It shows the two protocols a transport implements (dedupe.transport.Transport and
dedupe.plugins.TransportPlugin) and the entry point in its pyproject.toml; nothing more.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

from dedupe.errors import ConfigurationError
from dedupe.message import Headers, Message
from dedupe.operations.replay import Release, ReplayPolicy, describe
from dedupe.plugins import BrokerAdmin, Messages, UrlOption
from dedupe.settings import Settings
from dedupe.transport import (
    Action,
    Delivery,
    Process,
    Publisher,
    Settlement,
    Transport,
    dead_letter_headers,
    dlq_name,
)

logger = logging.getLogger(__name__)

POLL_S = 0.05  # how often a channel's file is looked at for new lines
SETTLEMENTS = "settlements.jsonl"


def directory_of(url: str) -> Path:
    """`example:///abs/dir` -> /abs/dir."""
    parts = urlsplit(url)
    if parts.scheme != "example" or not parts.path:
        raise ConfigurationError(f"expected example:///path/to/a/directory, got {url!r}")
    return Path(unquote(parts.path))


def append(path: Path, record: Mapping[str, Any]) -> None:
    with path.open("a", encoding="utf-8") as file:
        file.write(json.dumps(record) + "\n")


def read_lines(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line]


class FileDelivery:
    """One line of a channel's file; its settlement is appended to settlements.jsonl."""

    def __init__(self, transport: FileTransport, message: Message) -> None:
        self._transport = transport
        self.message = message

    async def settle(self, settlement: Settlement) -> bool:
        return self._transport.settle(self, settlement)


class FileTransport(Transport):
    """Follows `<dir>/<channel>.jsonl` and hands what arrives to the core in batches."""

    def __init__(self, directory: Path, *, batch_max: int = 64) -> None:
        self.directory = directory
        self.batch_max = batch_max
        self._inbox: asyncio.Queue[FileDelivery] | None = None  # while serving
        self._later: set[asyncio.TimerHandle] = set()  # deferred messages coming back

    async def connect(self) -> None:
        """The broker is the directory: it must exist (`dedupe-worker run` calls this)."""
        if not self.directory.is_dir():
            raise FileNotFoundError(f"no directory {self.directory}")

    async def serve(self, channels: Sequence[str], process: Process, stop: asyncio.Event) -> None:
        await self.connect()
        inbox: asyncio.Queue[FileDelivery] = asyncio.Queue()
        self._inbox = inbox
        readers = [
            asyncio.create_task(self._follow(name, inbox), name=f"example-{name}")
            for name in channels
        ]
        processing: set[asyncio.Task[None]] = set()
        logger.info("following %s in %s", ", ".join(channels), self.directory)
        try:
            while not stop.is_set():
                try:
                    first = await asyncio.wait_for(inbox.get(), timeout=POLL_S)
                except TimeoutError:
                    continue
                batch = [first]
                while len(batch) < self.batch_max and not inbox.empty():
                    batch.append(inbox.get_nowait())
                for name in {d.message.channel for d in batch}:
                    deliveries: list[Delivery] = [d for d in batch if d.message.channel == name]
                    task = asyncio.create_task(process(name, deliveries))
                    processing.add(task)
                    task.add_done_callback(processing.discard)
        finally:
            self._inbox = None
            for reader in readers:
                reader.cancel()
            await asyncio.gather(*readers, *processing, return_exceptions=True)
            for handle in self._later:
                handle.cancel()

    async def _follow(self, channel: str, inbox: asyncio.Queue[FileDelivery]) -> None:
        """Put every complete line of the channel's file in the inbox, old and new."""
        path, done, rest = self.directory / f"{channel}.jsonl", 0, b""
        while True:
            if path.exists():
                with path.open("rb") as file:
                    file.seek(done)
                    chunk = file.read()
                done += len(chunk)
                *lines, rest = (rest + chunk).split(b"\n")
                for line in filter(None, lines):
                    inbox.put_nowait(FileDelivery(self, self._message(channel, json.loads(line))))
            await asyncio.sleep(POLL_S)

    @staticmethod
    def _message(channel: str, record: Mapping[str, Any]) -> Message:
        return Message(
            channel=channel,
            body=str(record.get("body", "")).encode(),
            headers=Headers(record.get("headers") or {}),
            message_id=record.get("message_id"),
            content_type="application/json",
        )

    def settle(self, delivery: FileDelivery, settlement: Settlement) -> bool:
        message = delivery.message
        append(
            self.directory / SETTLEMENTS,
            {
                "channel": message.channel,
                "message_id": message.message_id,
                "action": str(settlement.action),
                "duplicate": settlement.duplicate,
                "reason": str(settlement.reason) if settlement.reason else None,
                "scope": settlement.scope,
                "key": settlement.key,
                "result": settlement.result,
            },
        )
        if settlement.action is Action.DEAD_LETTER:
            headers = {**message.headers, **dead_letter_headers(settlement)}
            append(
                self.directory / f"{dlq_name(message.channel)}.jsonl",
                {
                    "body": message.body.decode(),
                    "message_id": message.message_id,
                    "headers": headers,
                },
            )
        elif settlement.action is Action.DEFER or settlement.delay_s > 0:
            if self._inbox is None:  # not serving any more: the next start reads it again
                return True
            # A file cannot redeliver one line: the message comes back after its delay from
            # memory (a stop in between loses nothing: the next start reads the file again).
            again = FileDelivery(self, self._message_again(message))
            handle = asyncio.get_running_loop().call_later(
                max(settlement.delay_s, 0.05), self._inbox.put_nowait, again
            )
            self._later.add(handle)
        return True  # REQUEUE: the line stays in the file; the next start reads it again

    def _message_again(self, message: Message) -> Message:
        record = {"body": message.body.decode(), "headers": dict(message.headers)}
        again = self._message(message.channel, {**record, "message_id": message.message_id})
        return replace(again, attempt=message.attempt + 1)

    async def close(self) -> None:
        for handle in self._later:
            handle.cancel()


class FilePublisher:
    """Appends to `<dir>/<channel>.jsonl` (dedupe.transport.Publisher, for the receiver)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    async def publish(
        self, channel: str, body: bytes, *, message_id: str, headers: Mapping[str, str]
    ) -> None:
        record = {"body": body.decode(), "message_id": message_id, "headers": dict(headers)}
        append(self.directory / f"{channel}.jsonl", record)

    async def close(self) -> None:
        return None


class FileAdmin:
    """`dlq list|replay` on the files (dedupe.plugins.BrokerAdmin); replay follows
    dedupe.operations.replay."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    async def peek_dead_letters(self, channel: str, *, limit: int) -> list[dict[str, Any]]:
        letters = read_lines(self.directory / f"{dlq_name(channel)}.jsonl")[:limit]
        return [describe(r.get("headers") or {}, message_id=r.get("message_id")) for r in letters]

    async def replay_dead_letters(
        self, channel: str, *, limit: int, release: Release | None = None
    ) -> list[dict[str, Any]]:
        path = self.directory / f"{dlq_name(channel)}.jsonl"
        letters, moved = read_lines(path), []
        for letter in letters[:limit]:
            step = ReplayPolicy().plan(
                letter.get("headers") or {}, message_id=letter.get("message_id")
            )

            async def republish(headers: dict[str, Any], letter: dict[str, Any] = letter) -> None:
                append(self.directory / f"{channel}.jsonl", {**letter, "headers": headers})

            await step.carry_out(release=release, republish=republish)
            moved.append(step.row)
        path.write_text("".join(json.dumps(r) + "\n" for r in letters[limit:]), encoding="utf-8")
        return moved

    async def publish(self, channel: str, messages: Messages) -> int:
        for body, headers, message_id in messages:
            record = {"body": body.decode(), "message_id": message_id, "headers": dict(headers)}
            append(self.directory / f"{channel}.jsonl", record)
        return len(messages)

    async def delete_channels(self, channels: Sequence[str]) -> int:
        doomed = [self.directory / f"{n}.jsonl" for c in channels for n in (c, dlq_name(c))]
        for path in doomed:
            path.unlink(missing_ok=True)
        return len(doomed)


class FilePlugin:
    """The entry point: dedupe.plugins.TransportPlugin for example:// URLs."""

    name = "Example (JSON-lines files)"
    unreachable: tuple[type[BaseException], ...] = (OSError,)
    dead_letters_kept = False

    def transport(self, settings: Settings, *, app_name: str | None = None) -> Transport:
        return FileTransport(
            directory_of(settings.broker_url), batch_max=settings.effective_prefetch
        )

    def publisher(self, settings: Settings) -> Publisher:
        return FilePublisher(directory_of(settings.broker_url))

    def admin(self, url: str) -> BrokerAdmin:
        return FileAdmin(directory_of(url))

    def url_options(self) -> Sequence[UrlOption]:
        return ()


plugin = FilePlugin()
