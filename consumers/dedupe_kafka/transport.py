"""Kafka transport on aiokafka: offsets are committed only past messages whose outcome is recorded.

A channel `C` is a topic; its dead letters go to the topic `C.dlq`, its deferrals of 5 s or more
to the retry topics `C.retry.5s`, `C.retry.30s`, `C.retry.2m`, `C.retry.10m` and `C.retry.1h`
(all are created if missing; the worker consumes the retry topics too).

- One consumer group per app (`dedupe-<app name>`, or `?group_id=` in the URL), auto-commit off;
  a new group starts from the earliest offset.
- A fetch returns at most `batch_max` records; each partition's share goes to the core in one
  `process()` call (one claim statement) per wave (see dedupe_kafka.partition); up to
  `batches_in_flight` fetched batches of a partition run at once. At that many the partition
  is left out of the next polls (its records fetched ahead stay in aiokafka's buffer; a pause
  would drop them and fetch them again); one full for FULL_PAUSE_S or more, or whose last full
  spell lasted that long, is paused (its buffered records, which hold back the broker's next
  fetch for the other partitions, are dropped), and so is one holding too many messages, so
  that the consumer keeps polling and a long handler never gets the worker evicted from the
  group. Partitions run in parallel.
- Kafka cannot redeliver one message. A message the core defers for 5 s or more (its key is in
  progress elsewhere, a retry's backoff) is copied to the retry topic of its delay's bucket
  and its offset is done once the broker has the copy (dedupe_kafka.retries); the copy runs as
  a message of its channel once due, and the later messages of its record key do not wait for
  it. A shorter deferral, a requeue, or a deferral whose copy the broker refused waits in
  memory and runs again after its delay, beside the stream; only later messages with its
  record key wait for it.
- Per partition, the committed offset is the first message without a final outcome (acked, or
  dead-lettered and acknowledged by the broker): never past an unfinished one. Commits go out
  every `commit_interval_s` for all partitions in one request, and on revocation and shutdown.
- On revocation no new work starts (not even the next wave of a batch, nor a claimed run whose
  handler has not started: its delivery is withdrawn, its claim given back and its offset left
  uncommitted); the runs under way get `revoke_timeout_s` to finish, then what is done is
  committed and the rest is left to the next owner (the claims make its re-run a duplicate or a
  deferral, never a second effect; a given-back key it claims at once).
- A record with a `reply-to` header (and a `correlation-id`) gets its stored outcome written to
  that topic before its offset counts as done; a reply the broker did not take holds the
  record to be answered again later (dedupe_kafka.replies).
- A dead letter the broker can never take (too large once our headers are added) goes out
  without its body, with `x-dedupe-body-dropped` saying why; if even that fails, the message
  is held and tried again with backoff, and its partition commits no further
  (dedupe_kafka.dead_letters).

The options (dedupe_kafka.options), the producer side (dedupe_kafka.publisher) and the
operators' clients (dedupe_kafka.admin) live beside it; the package exports their public names.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Sequence
from typing import Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, ConsumerRebalanceListener
from aiokafka.errors import CommitFailedError, IllegalStateError, KafkaError
from aiokafka.structs import ConsumerRecord, TopicPartition

from dedupe.settings import Settings
from dedupe.transport import Process, Transport, dlq_name
from dedupe_kafka.dead_letters import DeadLetters
from dedupe_kafka.options import KafkaOptions, group_id_for
from dedupe_kafka.partition import PartitionWork
from dedupe_kafka.publisher import ensure_topics, idempotent_producer
from dedupe_kafka.replies import Replies
from dedupe_kafka.retries import Retries, retry_bucket, topics_of

# The longest aiokafka's background fetch routine sleeps before it looks again for partitions
# to fetch (its consumer_timeout_ms; aiokafka's default is 200).
FETCHER_WAKE_MS = 20

logger = logging.getLogger(__name__)

# The longest wait between two commit attempts while they keep failing unexpectedly.
COMMIT_BACKOFF_MAX_S = 10.0

# How long a partition may run as many fetched batches as it may (full) before it is paused.
# Until then it is only left out of the polls, and what aiokafka fetched ahead for it stays
# buffered (a pause drops it, to be fetched again on resume: a backlog then ran at the pace of
# those fetches). Past it the buffered result goes: aiokafka sends its broker no fetch for the
# other partitions while a buffered result is younger than its prefetch backoff (100 ms), so a
# partition kept full by slow handlers would slow the fetches of all the others. A partition
# whose last full spell lasted this long is paused as soon as it is full again. (0.05 s cost a
# backlog of new keys about a tenth of its rate: fast batches stay full that long at times.)
FULL_PAUSE_S = 0.1


# -- the transport --------------------------------------------------------------------------


class _Rebalance(ConsumerRebalanceListener):  # type: ignore[misc]
    def __init__(self, transport: KafkaTransport) -> None:
        self.transport = transport

    async def on_partitions_revoked(self, revoked: set[TopicPartition]) -> None:
        await self.transport.revoke(revoked)

    async def on_partitions_assigned(self, assigned: set[TopicPartition]) -> None:
        self.transport.assign(assigned)


class KafkaTransport(Transport):
    """Consume channels (topics) as one consumer group and settle records as the core decides.

    Args:
        url: `kafka://host:port[,host:port]` with optional `?option=value` (see KafkaOptions).
        settings: The worker's settings; its prefetch sizes the batches.
        app_name: Names the default consumer group (`dedupe-<app name>`).
        options: KafkaOptions fields; the URL's options win.
    """

    def __init__(
        self,
        url: str,
        *,
        settings: Settings | None = None,
        app_name: str | None = None,
        **options: Any,
    ) -> None:
        defaults: dict[str, Any] = {}
        if settings is not None:
            defaults["batch_max"] = settings.effective_prefetch
            defaults["client_id"] = settings.worker_name
            defaults["revoke_timeout_s"] = min(settings.shutdown_timeout_s, 10.0)
        if app_name is not None:
            defaults["group_id"] = group_id_for(app_name)
        self.options = KafkaOptions.from_url(url, **{**defaults, **options})
        self._shutdown_timeout_s = (settings.shutdown_timeout_s if settings else 30.0) + 15.0
        self._producer: AIOKafkaProducer | None = None
        self._consumer: AIOKafkaConsumer | None = None
        self._partitions: dict[TopicPartition, PartitionWork] = {}
        self._process: Process | None = None
        self._stopping = False
        self.dead_letters = DeadLetters(lambda: self._producer, lambda: self._stopping)
        self.replies = Replies(lambda: self._producer)
        self.retries = Retries(lambda: self._producer)
        self._channels: frozenset[str] = frozenset()
        self.rebalances = 0
        # A revoke and the shutdown each take partitions away and commit them: one at a time,
        # so that neither stops the consumer under the other's commit.
        self._handing_over = asyncio.Lock()
        # Set when a partition may take a fetched batch again.
        self._slot = asyncio.Event()

    @property
    def assignment(self) -> frozenset[TopicPartition]:
        return frozenset(self._partitions)

    async def connect(self) -> None:
        """Start the idempotent producer that writes dead letters (checks the broker too)."""
        if self._producer is None:
            self._producer = await idempotent_producer(self.options)

    async def close(self) -> None:
        consumer, self._consumer = self._consumer, None
        producer, self._producer = self._producer, None
        for client in (consumer, producer):
            if client is not None:
                with contextlib.suppress(Exception):
                    await client.stop()

    async def serve(self, channels: Sequence[str], process: Process, stop: asyncio.Event) -> None:
        await self.connect()
        retry_topics = topics_of(channels)
        await ensure_topics(self.options, [*channels, *map(dlq_name, channels), *retry_topics])
        self._process = process
        self._channels = frozenset(channels)
        options = self.options
        consumer = AIOKafkaConsumer(
            bootstrap_servers=options.bootstrap_servers,
            client_id=options.client_id,
            group_id=options.group_id,
            enable_auto_commit=False,
            auto_offset_reset="earliest",
            isolation_level="read_committed",
            session_timeout_ms=options.session_timeout_ms,
            heartbeat_interval_ms=options.heartbeat_interval_ms,
            max_poll_interval_ms=options.max_poll_interval_ms,
            rebalance_timeout_ms=int((options.revoke_timeout_s + 20) * 1000),
            fetch_max_wait_ms=options.fetch_max_wait_ms,
            # aiokafka's fetch routine otherwise sleeps up to 200 ms at a time when it finds
            # nothing to request at that moment; a fetch then waited out that sleep while records
            # came in (one or two fetch gaps of 202-203 ms in each 10 s run at 1,000 msg/s).
            consumer_timeout_ms=FETCHER_WAKE_MS,
        )
        consumer.subscribe([*channels, *retry_topics], listener=_Rebalance(self))
        try:
            await consumer.start()
        except BaseException:
            await consumer.stop()
            raise
        self._consumer = consumer
        logger.info("consuming %s as group %s", ", ".join(channels), options.group_id)
        committer = asyncio.create_task(self._commit_loop(), name="kafka-commit")
        try:
            while not stop.is_set():
                open_ = await self._open_partitions()
                if open_ is None:
                    continue
                try:
                    # A partition that may take a batch again while getmany waits is not
                    # asked for until the wait ends: while any batch runs (one may end),
                    # wait briefly and ask again.
                    busy = any(p.busy for p in self._partitions.values())
                    batches = await consumer.getmany(
                        *open_, timeout_ms=5 if busy else 100, max_records=options.batch_max
                    )
                except KafkaError as exc:
                    if not getattr(exc, "retriable", False):
                        raise
                    logger.warning("Kafka fetch failed (%s); retrying", exc)
                    await asyncio.sleep(1.0)
                    continue
                for tp, records in batches.items():
                    if records:
                        self._dispatch(consumer, tp, records)
        finally:
            self._stopping = True
            committer.cancel()
            await asyncio.gather(committer, return_exceptions=True)
            work = list(self._partitions.values())
            for partition in work:
                partition.close()
            if await _wait_idle(work, self._shutdown_timeout_s):
                logger.warning("partitions still busy at shutdown; their offsets stay behind")
            # A revoke under way (the group rebalancing as we stop) commits its partitions
            # first, the consumer still ours; the lock is held for a commit only, so a revoke
            # that comes now waits for no more than that.
            async with self._handing_over:
                await self._commit([p for p in work if self._partitions.get(p.tp) is p])
                self._partitions.clear()
            with contextlib.suppress(Exception):
                await consumer.stop()  # leaves the group: the others take over at once
            self._consumer = None

    async def _open_partitions(self) -> list[TopicPartition] | None:
        """The partitions to poll (an empty list: every assigned one, none assigned yet), or
        None to look again.

        A full partition (as many fetched batches running as it may) is left out: its records
        fetched ahead stay in aiokafka's buffer for the next poll. One full for FULL_PAUSE_S or
        more (or whose last full spell lasted that long: its handlers are slow) is paused and
        polled: a paused partition returns nothing, and polling it drops its buffered result,
        which would hold back the broker's next fetch for the others for up to 100 ms.
        With every partition full for less than that, wait up to FULL_PAUSE_S for a slot and
        look again.
        """
        self._slot.clear()
        work = self._partitions
        if not work:
            return []
        paused = self._consumer.paused() if self._consumer is not None else set()
        now = time.monotonic()
        open_: list[TopicPartition] = []
        for tp, partition in work.items():
            if partition.closing:
                continue
            if partition.full and tp not in paused:
                if (
                    now - partition.full_since < FULL_PAUSE_S
                    and partition.last_full_s < FULL_PAUSE_S
                ):
                    continue  # left out: what aiokafka fetched ahead for it stays buffered
                # Full for long, or slow last time too (its handlers outlast the wait): paused
                # at once from then on, as a fast partition's refetch cost buys nothing there.
                self._pause(tp)
            open_.append(tp)
        if open_:
            return open_
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._slot.wait(), FULL_PAUSE_S)
        return None

    def _dispatch(
        self, consumer: AIOKafkaConsumer, tp: TopicPartition, records: list[ConsumerRecord]
    ) -> None:
        partition = self._partitions.get(tp)
        if partition is None or partition.closing or partition.full:
            # Not ours to run (a rebalance is under way): fetch them again, skip nothing.
            with contextlib.suppress(IllegalStateError, KafkaError):
                consumer.seek(tp, records[0].offset)
            return
        partition.feed(records)

    # -- rebalances -----------------------------------------------------------------------

    def assign(self, assigned: set[TopicPartition]) -> None:
        assert self._process is not None
        self.rebalances += 1
        for tp in assigned:
            retry = retry_bucket(tp.topic)
            self._partitions[tp] = PartitionWork(
                tp,
                self._process,
                batch_max=self.options.batch_max,
                max_held=self.options.max_held,
                dead_letter=self.dead_letters.send,
                pause=self._pause,
                resume=self._resume,
                reply=self.replies.send,
                batches_in_flight=self.options.depth,
                defer=self.retries.send,
                carry_on=self.retries.carry_on,
                retry=retry if retry is not None and retry[0] in self._channels else None,
            )
        logger.info(
            "assigned %s", ", ".join(f"{tp.topic}[{tp.partition}]" for tp in sorted(assigned))
        )

    async def revoke(self, revoked: set[TopicPartition]) -> None:
        """Stop starting work on revoked partitions (their claimed deliveries not yet running
        are withdrawn: given back), let the runs under way finish (bounded), commit."""
        async with self._handing_over:
            await self._hand_over(revoked)

    async def _hand_over(self, revoked: set[TopicPartition]) -> None:
        work = [self._partitions.pop(tp) for tp in revoked if tp in self._partitions]
        if not work:
            return
        for partition in work:
            partition.close()
        began = time.monotonic()
        late = await _wait_idle(work, self.options.revoke_timeout_s)
        if late:
            logger.warning(
                "revoked partitions still busy after %.0fs: their unfinished messages go to the "
                "next owner uncommitted (claims turn a re-run into a duplicate or a deferral)",
                self.options.revoke_timeout_s,
            )
        await self._commit(work)
        logger.info(
            "revoked %s after %.2fs",
            ", ".join(f"{p.tp.topic}[{p.tp.partition}]" for p in work),
            time.monotonic() - began,
        )

    def _pause(self, tp: TopicPartition) -> None:
        if self._consumer is not None:
            with contextlib.suppress(IllegalStateError, KafkaError):
                self._consumer.pause(tp)

    def _resume(self, tp: TopicPartition) -> None:
        partition = self._partitions.get(tp)
        if self._consumer is not None and partition is not None and not partition.full:
            self._slot.set()
            with contextlib.suppress(IllegalStateError, KafkaError):
                self._consumer.resume(tp)

    # -- offsets --------------------------------------------------------------------------

    async def _commit_loop(self) -> None:
        """Commit every commit_interval_s; an unexpected error is logged and the loop goes on
        (backing off while it repeats), so periodic commits never stop silently."""
        failures = 0
        while True:
            interval = self.options.commit_interval_s
            await asyncio.sleep(min(interval * 2**failures, max(interval, COMMIT_BACKOFF_MAX_S)))
            try:
                await self._commit(list(self._partitions.values()))
            except Exception:
                failures = min(failures + 1, 16)
                logger.exception("committing offsets failed unexpectedly; trying again")
            else:
                failures = 0

    async def _commit(self, work: Sequence[PartitionWork]) -> None:
        """Commit, in one request, every partition whose position moved."""
        consumer = self._consumer
        offsets: dict[TopicPartition, int] = {}
        for partition in work:
            position = partition.position()
            if position is not None and (
                partition.committed is None or position > partition.committed
            ):
                offsets[partition.tp] = position
        if consumer is None or not offsets:
            return
        try:
            await consumer.commit(offsets)
        except (CommitFailedError, IllegalStateError) as exc:
            # The group moved on; the new owners start from the last commit that went through.
            logger.warning("offset commit refused by the group (%s); rebalancing", exc)
            return
        except KafkaError as exc:
            logger.warning("offset commit failed (%s); will try again", exc)
            return
        by_tp = {p.tp: p for p in work}
        for tp, offset in offsets.items():
            partition = by_tp[tp]
            partition.committed = max(partition.committed or 0, offset)


async def _wait_idle(work: Sequence[PartitionWork], timeout_s: float) -> int:
    """Wait up to timeout_s for the partitions' in-flight work; return how many are still busy."""
    waiters = [asyncio.create_task(p.wait_idle()) for p in work]
    if not waiters:
        return 0
    try:
        _, late = await asyncio.wait(waiters, timeout=timeout_s)
    finally:
        for waiter in waiters:
            waiter.cancel()
    return len(late)


__all__ = ["KafkaTransport"]
