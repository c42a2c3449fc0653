"""Chaos at the HTTP edge: the webhook receiver is killed mid-burst while senders retry."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import asyncpg
import httpx

from tests.apps.chaos import API_KEY, SCHEMA
from tests.chaos.brokers import ChaosRabbit
from tests.chaos.conftest import FAULTS, LEASE_S, SIZE, record
from tests.chaos.harness import ROOT, Probe, Report, Workers, check, wait_drained
from tests.chaos.workload import TENANTS, Messages, Workload, hostile_key

# A sender gives up on one request after this long (the receiver restarts within seconds).
REQUEST_DEADLINE_S = 120.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Receiver:
    """A `dedupe-worker receive tests.apps.chaos:app` process on one port."""

    def __init__(self, env: dict[str, str], port: int, logs: Path) -> None:
        self.env, self.port, self.logs = env, port, logs
        self.proc: subprocess.Popen[bytes] | None = None
        self.started = 0

    def start(self) -> None:
        log = open(self.logs / f"receiver-{self.started}.log", "wb")  # noqa: SIM115
        self.started += 1
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "dedupe.cli",
                "receive",
                "tests.apps.chaos:app",
                "--port",
                str(self.port),
            ],
            cwd=ROOT,
            env={**os.environ, **self.env},
            stdout=log,
            stderr=subprocess.STDOUT,
        )

    async def wait_ready(self, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        async with httpx.AsyncClient() as client:
            while time.monotonic() < deadline:
                try:
                    if (await client.get(f"http://127.0.0.1:{self.port}/healthz")).is_success:
                        return
                except httpx.TransportError:
                    pass
                await asyncio.sleep(0.1)
        raise AssertionError("the receiver did not come up")

    async def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        await asyncio.to_thread(self.proc.wait, 10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()


class Sender:
    """Posts every message of the workload (its message id as the Idempotency-Key, its headers
    along), retrying as webhook senders do, until each has a final answer: 202 (accepted or
    replayed), 422 (the key was used with another body) or 400 (a key the receiver refuses)."""

    def __init__(self, url: str, concurrency: int = 16) -> None:
        self.url = url
        self.slots = asyncio.Semaphore(concurrency)
        self.answers: Counter[str] = Counter()
        self.accepted: dict[str, set[bytes]] = {}
        self.refused: dict[str, set[bytes]] = {}
        self.bad_requests: set[str] = set()
        self.unanswered: list[str] = []
        self.unexpected: list[tuple[str, int]] = []
        self.retries = 0

    @property
    def answered(self) -> int:
        return sum(self.answers.values())

    async def send_all(self, messages: Messages) -> None:
        async with httpx.AsyncClient(timeout=10) as client:
            await asyncio.gather(
                *(self._send(client, body, extra, str(key)) for body, extra, key in messages)
            )

    async def _send(
        self, client: httpx.AsyncClient, body: bytes, extra: Mapping[str, Any], key: str
    ) -> None:
        headers = {
            **{name: str(value) for name, value in extra.items()},
            "Authorization": f"Bearer {API_KEY}",
            "Idempotency-Key": key,
            "Content-Type": "application/json",
        }
        async with self.slots:
            deadline = time.monotonic() + REQUEST_DEADLINE_S
            while time.monotonic() < deadline:
                try:
                    response = await client.post(self.url, content=body, headers=headers)
                except httpx.TransportError:
                    self.retries += 1
                    await asyncio.sleep(0.2)  # the receiver is down: try again
                    continue
                if response.status_code in (409, 503):
                    self.retries += 1
                    await asyncio.sleep(min(float(response.headers.get("Retry-After", "1")), 1.0))
                    continue
                if response.status_code == 202:
                    self.accepted.setdefault(key, set()).add(body)
                elif response.status_code == 422:
                    self.refused.setdefault(key, set()).add(body)
                elif response.status_code == 400:
                    self.bad_requests.add(key)
                else:
                    self.unexpected.append((key, response.status_code))
                self.answers[str(response.status_code)] += 1
                return
            self.unanswered.append(key)


async def test_a_receiver_killed_mid_burst_while_senders_retry_loses_nothing(
    db_url: str, amqp_url: str, channel: str, tmp_path: Path
) -> None:
    """kill -9 of the receiver five times under a burst: every request ends accepted once or
    refused as a conflict, every accepted key's effect happens once, nothing is lost; hostile
    body ids and tenants are forwarded and dead-lettered by the workers, an Idempotency-Key
    the claims table cannot hold (600 characters) is refused with 400 and forwarded never."""
    conn = await asyncpg.connect(db_url)
    try:
        await conn.execute(SCHEMA)
    finally:
        await conn.close()
    workload = Workload(SIZE)
    broker = ChaosRabbit(amqp_url)
    env = {
        "DEDUPE_DATABASE_URL": db_url,
        "DEDUPE_BROKER_URL": amqp_url,
        "DEDUPE_GC_INTERVAL_S": "0",
        "CHAOS_CHANNEL": channel,
        "CHAOS_LEASE_S": str(LEASE_S),
    }
    port = free_port()
    receiver = Receiver(env, port, tmp_path)
    workers = Workers(env, tmp_path)
    sender = Sender(f"http://127.0.0.1:{port}/webhooks/chaos")
    probe = Probe(db_url)
    # HTTP cannot carry a NUL or a lone surrogate in a header; a 600-character key it can.
    long_keys = [
        hostile_key(kind, message_id)
        for message_id, kind in workload.invalid_keys.items()
        if kind == "long"
    ]
    requests = list(workload.messages)
    requests[len(requests) // 2 : len(requests) // 2] = [
        (json.dumps({"id": key, "v": 0}).encode(), {"X-Tenant": TENANTS[0]}, key)
        for key in long_keys
    ]
    kills = 0
    began = time.monotonic()
    try:
        receiver.start()
        await receiver.wait_ready()
        workers.start()
        workers.start()
        sending = asyncio.create_task(sender.send_all(requests))
        for i in range(FAULTS):
            target = len(requests) * (i + 1) // (FAULTS + 1)
            deadline = time.monotonic() + 300
            while sender.answered < target and not sending.done():
                assert time.monotonic() < deadline, "the senders made no progress"
                await asyncio.sleep(0.02)
            await receiver.kill()
            kills += 1
            receiver.start()
        await asyncio.wait_for(sending, REQUEST_DEADLINE_S * 2)
        drain_s = await wait_drained(
            probe, lambda: broker.backlog(channel), workload.claimed, within_s=LEASE_S + 30
        )
        assert all(proc.poll() is None for proc in workers.procs), "a worker died"
    finally:
        receiver.stop()
        workers.stop()
    letters = await broker.dead_letters(channel, limit=workload.letters_at_most)
    problems, figures = await check(probe, letters, workload, conflicts_dead_lettered=False)
    if sender.unanswered:
        problems.append(f"requests without a final answer: {sender.unanswered[:10]}")
    if sender.unexpected:
        problems.append(f"unexpected answers: {sender.unexpected[:10]}")
    twice = [key for key, bodies in sender.accepted.items() if len(bodies) > 1]
    if twice:
        problems.append(f"two bodies accepted under one key: {twice[:10]}")
    refused_keys = set(sender.refused)
    if not refused_keys <= workload.conflicts:
        problems.append(
            f"422 for keys without a conflict: {sorted(refused_keys - workload.conflicts)[:10]}"
        )
    if refused_keys != workload.conflicts:
        problems.append(f"conflicts not refused: {sorted(workload.conflicts - refused_keys)[:10]}")
    if sender.bad_requests != set(long_keys):
        problems.append(
            f"400 answers differ: for {len(sender.bad_requests)} keys, "
            f"expected for the {len(long_keys)} keys of 600 characters"
        )
    edge_claims = await probe.value(
        "SELECT count(*) FROM dedupe_claims WHERE key = ANY($1::text[])", long_keys
    )
    if edge_claims:
        problems.append(f"{edge_claims} claims for keys refused with 400")
    await record(
        Report(
            scenario=f"receiver: kill -9 mid-burst ({sender.retries} sender retries)",
            messages=len(workload.messages),
            duplicates=workload.duplicates,
            faults=kills,
            lost=figures["lost"] + len(sender.unanswered),
            duplicated_effects=figures["duplicated_effects"],
            external_keys_differing=figures["external_keys_differing"],
            drain_s=drain_s,
            total_s=time.monotonic() - began,
            problems=problems,
        )
    )
    assert kills == FAULTS
    assert not problems, problems
