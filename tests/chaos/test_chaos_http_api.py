"""Chaos at the HTTP API: the orders API of handlers/orders_api.py behind IdempotencyMiddleware,
served by a real uvicorn process (tests/integration/http_server.py's `ApiProcesses`), killed
with kill -9 at random moments while concurrent clients POST /orders and retry each request
with the same Idempotency-Key and body until they get an answer below 500. Each kill is
followed by a new process on the same port. Two rows: two commits (the default) and
one_transaction=True.

The workload (`plan`): SIZE logical requests, each one order under its caller's key (two
callers, so keys are scoped by principal). About 20 % are sent twice at once (a concurrent
duplicate), 5 % once more after their answer (a replay), 1 % then again with another body under
the same key (must be a 422 `key-conflict` that creates nothing), some keys are reused by the
other caller (another scope: another order), and some keys are hostile but valid: 255
characters (tests/chaos/workload.py's `hostile_key`, cut to the limit), SQL and LIKE
metacharacters, quotes and backslashes, commas, dots and slashes, each sent in turn bare and as
a structured-field string (`"..."`, the same key). A few keys of 600 characters (`hostile_key`
as is) must be refused with 400 `invalid-key` and claim and create nothing.

The invariants, against PostgreSQL's orders and dedupe_claims once every client is done:
every logical request got a final 201, all the 201s of one key carry the same status, body,
Content-Type and Location (a replay is byte-identical, as the middleware promises), at most one
of them was not a replay, and the later replay says `Idempotent-Replayed: true`; each logical
request has exactly one order row, with its key, sku and quantity, and no other order exists;
every claim is completed (none left in progress after the drain), one per logical request, none
for the refused keys; every conflict got its 422 and was recorded in dedupe_conflicts; no 5xx
but a 503 while a server was killed or starting (connection errors, 409s and 503s are counted
in the row's name). The row's "external keys differing" column counts the keys whose answers
differed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import signal
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from dedupe.asgi.keys import MAX_KEY_CHARS
from dedupe.asgi.run import STORE_TIMEOUT_S
from tests.chaos.conftest import FAULTS, LEASE_S, SIZE, record
from tests.chaos.harness import Probe, Report
from tests.chaos.workload import hostile_key
from tests.integration.http_server import ApiProcesses

CALLERS = ("Bearer chaos-alice-token", "Bearer chaos-bob-token")
# Valid keys that a careless store or log would trip on; each is sent bare and quoted in turn.
HOSTILE_KINDS = ("longest", "sql", "like", "quotes", "comma", "path")
PROBLEM = "urn:dedupe-worker:problem:"
# One request's retries stop after this long or this many tries (the API restarts in seconds;
# a two-commit key killed mid-endpoint is free again after LEASE_S).
REQUEST_DEADLINE_S = 120.0
MAX_TRIES = 1000
CONCURRENCY = 24
# A 503 is what a server killed or starting may cause: tolerated for a request sent from a kill
# until this long after its successor answered (a claim or a pool that waits its whole
# STORE_TIMEOUT_S in the restart's rush, behind a killed run's lease, then answers 503).
RESTART_GRACE_S = STORE_TIMEOUT_S + LEASE_S + 3.0


def valid_hostile_key(kind: str, base: str) -> str:
    """A key the middleware must take as it is (1-255 visible ASCII characters)."""
    if kind == "longest":
        return hostile_key("long", base)[:MAX_KEY_CHARS]
    if kind == "sql":
        return f"{base}');DROP/**/TABLE/**/orders;--"
    if kind == "like":
        return f"{base}%_\\%*"
    if kind == "quotes":
        return f'{base}"\'\\"`'
    if kind == "comma":
        return f"{base},{base};q=1"
    return f"../{base}/%2e%2e/?#&"


def sf_string(key: str) -> str:
    """The key as an RFC 8941 string, as the IETF draft writes it: the same key."""
    return '"' + key.replace("\\", "\\\\").replace('"', '\\"') + '"'


@dataclass(frozen=True)
class Answer:
    status: int
    body: bytes
    content_type: str
    location: str | None
    replayed: bool

    @classmethod
    def of(cls, response: httpx.Response) -> Answer:
        return cls(
            status=response.status_code,
            body=response.content,
            content_type=response.headers.get("content-type", ""),
            location=response.headers.get("location"),
            replayed=response.headers.get("idempotent-replayed") == "true",
        )

    @property
    def problem(self) -> str:
        return problem_type(self.body)

    def same(self) -> tuple[int, bytes, str, str | None]:
        """What a replay repeats byte for byte."""
        return self.status, self.body, self.content_type, self.location


def problem_type(body: bytes) -> str:
    try:
        document = json.loads(body)
    except ValueError:
        return ""
    return str(document.get("type", "")) if isinstance(document, dict) else ""


@dataclass
class Logical:
    """One order a client wants: sent `copies` times at once, retried until answered."""

    n: int
    caller: str
    key: str  # as the middleware stores it
    sku: str
    quantity: int
    kind: str = "plain"
    copies: int = 1
    replay_later: bool = False
    conflict: bool = False  # then sent with another quantity: a 422
    answers: list[Answer | None] = field(default_factory=list)
    conflict_answer: Answer | None = None

    @property
    def wires(self) -> tuple[str, ...]:
        """The Idempotency-Key header values sent for it, in turn."""
        return (self.key,) if self.kind == "plain" else (self.key, sf_string(self.key))

    def body(self, quantity: int | None = None) -> bytes:
        return json.dumps({"sku": self.sku, "quantity": quantity or self.quantity}).encode()

    @property
    def sends(self) -> int:
        return self.copies + self.replay_later + self.conflict


@dataclass
class Refused:
    """A request under a key too long to be one: 400, nothing claimed or created."""

    caller: str
    key: str
    sku: str
    answer: Answer | None = None

    def body(self) -> bytes:
        return json.dumps({"sku": self.sku, "quantity": 1}).encode()


@dataclass
class Plan:
    logical: list[Logical]
    refused: list[Refused]

    @property
    def sends(self) -> int:
        return sum(r.sends for r in self.logical) + len(self.refused)


def plan(n: int, seed: int) -> Plan:
    """n logical requests (hostile keys first, then keys shared by both callers, then plain
    ones; their sending order is shuffled) and the refused ones."""
    rng = random.Random(seed)
    n_hostile = max(2, n // 500)  # of each kind
    n_shared = max(2, n // 200)
    logical: list[Logical] = []
    for i in range(n):
        logical.append(
            Logical(
                n=i,
                caller=CALLERS[i % len(CALLERS)],
                key=f"o{i:07d}-{rng.getrandbits(40):010x}",
                sku=f"sku-{i:07d}",
                quantity=rng.randint(1, 999),
            )
        )
    at = 0
    for kind in HOSTILE_KINDS:
        for request in logical[at : at + n_hostile]:
            request.kind = kind
            request.key = valid_hostile_key(kind, request.key)
        at += n_hostile
    # Keys the other caller uses too: another scope, so another order.
    for request in logical[at : at + n_shared]:
        j = at + n_shared + 2 * (request.n - at)
        other = logical[j + (j % 2 == request.n % 2)]  # a plain key of the other caller
        assert other.caller != request.caller and other.kind == "plain"
        request.key = other.key
    for request in logical:
        roll = rng.random()
        request.copies = 2 if roll < 0.20 else 1
        request.replay_later = 0.20 <= roll < 0.25
    singles = [r for r in logical if r.copies == 1 and not r.replay_later]
    for request in rng.sample(singles, max(3, n // 100)):
        request.conflict = True
    refused = [
        Refused(CALLERS[i % len(CALLERS)], hostile_key("long", f"bad{i:05d}"), f"refused-{i:05d}")
        for i in range(max(2, n // 1000))
    ]
    return Plan(logical, refused)


class Clients:
    """Concurrent clients that retry each request with the same key and body until it gets an
    answer below 500: connection errors, 409 and 5xx are retried after a short pause."""

    def __init__(self, base: str, api: Api) -> None:
        self.url = f"{base}/orders"
        self.api = api
        self.slots = asyncio.Semaphore(CONCURRENCY)
        self.finished = 0  # logical requests with all their answers
        self.connection_errors = 0
        self.cut = 0  # of which after the request was sent: cut by a kill mid-request
        self.in_flight: Counter[str] = Counter()  # 409s by problem type
        self.server_errors: list[tuple[int, str, bool]] = []  # (status, type, while restarting)
        self.unanswered: list[str] = []
        self.jitter = random.Random()

    async def run(self, work: Plan) -> None:
        limits = httpx.Limits(max_connections=CONCURRENCY * 3, max_keepalive_connections=64)
        async with httpx.AsyncClient(timeout=10, limits=limits) as client:
            order = list(work.logical)
            random.Random(len(order)).shuffle(order)
            jobs = [self._logical(client, request) for request in order]
            # The refused keys spread over the run (the slots take the jobs in this order).
            for i, refused in reversed(list(enumerate(work.refused))):
                at = len(order) * (i + 1) // (len(work.refused) + 1)
                jobs.insert(at, self._refused(client, refused))
            await asyncio.gather(*jobs)

    async def _logical(self, client: httpx.AsyncClient, request: Logical) -> None:
        async with self.slots:
            body = request.body()
            request.answers = list(
                await asyncio.gather(
                    *(
                        self.send(client, request.caller, request.wires, body, first=copy)
                        for copy in range(request.copies)
                    )
                )
            )
            if all(a is not None and a.status == 201 for a in request.answers):
                if request.replay_later:
                    request.answers.append(
                        await self.send(client, request.caller, request.wires, body, first=1)
                    )
                if request.conflict:
                    other = request.body(request.quantity % 999 + 1)
                    request.conflict_answer = await self.send(
                        client, request.caller, request.wires, other, first=1
                    )
            self.finished += 1

    async def _refused(self, client: httpx.AsyncClient, request: Refused) -> None:
        async with self.slots:
            request.answer = await self.send(client, request.caller, (request.key,), request.body())

    async def send(
        self,
        client: httpx.AsyncClient,
        caller: str,
        wires: tuple[str, ...],
        body: bytes,
        *,
        first: int = 0,
    ) -> Answer | None:
        """The request's final answer (below 500, not a 409), or None past the bounds."""
        deadline = time.monotonic() + REQUEST_DEADLINE_S
        for attempt in range(MAX_TRIES):
            if time.monotonic() > deadline:
                break
            headers = {
                "Authorization": caller,
                "Idempotency-Key": wires[(first + attempt) % len(wires)],
                "Content-Type": "application/json",
            }
            sent_restarting = self.api.restarting()
            try:
                response = await client.post(self.url, content=body, headers=headers)
            except httpx.TransportError as exc:
                self.connection_errors += 1  # the server is down or was killed mid-request
                # Cut by a kill after it was sent: the connection broke, not a slow answer.
                self.cut += isinstance(exc, httpx.RemoteProtocolError | httpx.ReadError)
                await asyncio.sleep(self.jitter.uniform(0.05, 0.15))
                continue
            if response.status_code == 409:
                self.in_flight[problem_type(response.content)] += 1
                await asyncio.sleep(self.jitter.uniform(0.1, 0.3))
                continue
            if response.status_code >= 500:
                self.server_errors.append(
                    (
                        response.status_code,
                        problem_type(response.content),
                        sent_restarting or self.api.restarting(),
                    )
                )
                await asyncio.sleep(self.jitter.uniform(0.1, 0.3))
                continue
            return Answer.of(response)
        self.unanswered.append(wires[0])
        return None


class Api(ApiProcesses):
    """The test API's uvicorn processes on one port, one after the other, killed with -9."""

    def __init__(self, db_url: str, logs: Path, *, one_transaction: bool) -> None:
        env = {"HTTP_API_ONE_TRANSACTION": "1"} if one_transaction else {}
        super().__init__(db_url, logs, lease_s=LEASE_S, env=env)
        self.down_since: float | None = None
        self.up_since = 0.0

    def restarting(self) -> bool:
        """Whether a server is killed, starting, or just started (RESTART_GRACE_S)."""
        now = time.monotonic()
        return self.down_since is not None or now - self.up_since < RESTART_GRACE_S

    async def begin(self) -> None:
        await asyncio.to_thread(self.start)
        self.down_since, self.up_since = None, time.monotonic()

    async def kill(self) -> None:
        proc = self.procs[-1]
        self.down_since = time.monotonic()
        proc.send_signal(signal.SIGKILL)
        await asyncio.to_thread(proc.wait, 10)


@contextlib.contextmanager
def served(db_url: str, logs: Path, *, one_transaction: bool) -> Iterator[Api]:
    api = Api(db_url, logs, one_transaction=one_transaction)
    try:
        yield api
    finally:
        api.close()


async def check(probe: Probe, work: Plan) -> tuple[list[str], dict[str, int]]:
    """The invariants against the answers and the database. Returns (problems, figures)."""
    problems: list[str] = []
    unanswered = [r.sku for r in work.logical if not r.answers or None in r.answers]
    not_created = [
        r.sku for r in work.logical if any(a is not None and a.status != 201 for a in r.answers)
    ]
    if unanswered:
        problems.append(f"requests without a final answer: {unanswered[:10]}")
    if not_created:
        examples = [
            (r.sku, [(a.status, a.body[:200]) for a in r.answers if a is not None])
            for r in work.logical
            if r.sku in set(not_created[:5])
        ]
        problems.append(f"{len(not_created)} requests not answered 201: {examples}")
    answered = [r for r in work.logical if r.answers and None not in r.answers]
    differing = [r.sku for r in answered if len({a.same() for a in r.answers if a is not None}) > 1]
    if differing:
        problems.append(f"the answers of one key differ: {differing[:10]}")
    fresh_twice = [r.sku for r in answered if sum(not a.replayed for a in r.answers if a) > 1]
    if fresh_twice:
        problems.append(f"more than one answer that is not a replay: {fresh_twice[:10]}")
    late = [r.sku for r in answered if r.replay_later and (a := r.answers[-1]) and not a.replayed]
    if late:
        problems.append(f"a later retry not marked Idempotent-Replayed: {late[:10]}")

    rows = await probe.fetch("SELECT id, sku, quantity, idempotency_key FROM orders")
    by_sku: dict[str, list[tuple[int, int, str | None]]] = {}
    for row in rows:
        by_sku.setdefault(row["sku"], []).append(
            (row["id"], row["quantity"], row["idempotency_key"])
        )
    planned = {r.sku for r in work.logical}
    twice = [r.sku for r in work.logical if len(by_sku.get(r.sku, ())) > 1]
    missing = [r.sku for r in work.logical if not by_sku.get(r.sku)]
    strays = sorted(by_sku.keys() - planned)
    if twice:
        problems.append(f"orders created twice: {twice[:10]}")
    if missing:
        problems.append(f"lost: no order for {len(missing)} requests, e.g. {missing[:10]}")
    if strays:
        problems.append(f"orders nobody asked for (or refused): {strays[:10]}")
    wrong: list[tuple[object, ...]] = []
    for request in work.logical:
        found = by_sku.get(request.sku, [])
        if len(found) != 1:
            continue
        order_id, quantity, key = found[0]
        if (quantity, key) != (request.quantity, request.key):
            wrong.append((request.sku, "row", quantity, key))
        expected = {"order_id": order_id, "sku": request.sku, "quantity": request.quantity}
        for answer in request.answers:
            if answer is None or answer.status != 201:
                continue
            if json.loads(answer.body) != expected or answer.location != f"/orders/{order_id}":
                wrong.append((request.sku, "answer", answer.body[:200], answer.location))
    if wrong:
        problems.append(f"orders or answers that are not the request's: {wrong[:5]}")

    conflicts = [r for r in work.logical if r.conflict]
    not_refused = [
        (r.sku, r.conflict_answer and (r.conflict_answer.status, r.conflict_answer.problem))
        for r in conflicts
        if r.conflict_answer is None
        or (r.conflict_answer.status, r.conflict_answer.problem) != (422, PROBLEM + "key-conflict")
    ]
    if not_refused:
        problems.append(f"another body under a used key not refused with 422: {not_refused[:10]}")
    recorded = {
        row["key"]
        for row in await probe.fetch(
            "SELECT key FROM dedupe_conflicts WHERE starts_with(scope, 'shop.http')"
        )
    }
    if recorded != {r.key for r in conflicts}:
        problems.append(
            f"dedupe_conflicts holds {sorted(recorded)[:5]}...({len(recorded)}), "
            f"expected the {len(conflicts)} conflicting keys"
        )

    bad = [
        (r.sku, r.answer and r.answer.status, r.answer and r.answer.problem)
        for r in work.refused
        if r.answer is None or (r.answer.status, r.answer.problem) != (400, PROBLEM + "invalid-key")
    ]
    if bad:
        problems.append(f"keys of 600 characters not refused with 400 invalid-key: {bad[:5]}")
    statuses = {
        row["status"]: row["n"]
        for row in await probe.fetch(
            "SELECT status, count(*) AS n FROM dedupe_claims GROUP BY status"
        )
    }
    if statuses != {"completed": len(work.logical)}:
        problems.append(
            f"claims by status {statuses}, expected {len(work.logical)} completed and no other"
        )
    refused_claims = await probe.value(
        "SELECT count(*) FROM dedupe_claims WHERE key = ANY($1::text[])",
        [r.key for r in work.refused],
    )
    if refused_claims:
        problems.append(f"{refused_claims} claims for keys refused with 400")
    run_again = await probe.value("SELECT count(*) FROM dedupe_claims WHERE attempts > 1")
    figures = {
        "run_again": int(run_again),
        "lost": len(set(missing) | set(unanswered)),
        "duplicated_effects": len(twice) + len(strays),
        "answers_differing": len(differing),
    }
    return problems, figures


async def wait_no_claim_in_progress(probe: Probe, within_s: float) -> str | None:
    """The drain: no claim stays in progress once every client is done (else what is)."""
    deadline = time.monotonic() + within_s
    for _ in range(int(within_s / 0.2) + 1):
        if not await probe.value("SELECT count(*) FROM dedupe_claims WHERE status = 'in_progress'"):
            return None
        if time.monotonic() > deadline:
            break
        await asyncio.sleep(0.2)
    stuck = await probe.fetch(
        "SELECT scope, key, attempts, owner, lease_until FROM dedupe_claims"
        " WHERE status = 'in_progress' LIMIT 5"
    )
    return f"claims still in progress {within_s:.0f}s after the clients: {[dict(r) for r in stuck]}"


@pytest.mark.parametrize(
    "mode", ["two commits", "one transaction"], ids=["two_commits", "one_transaction"]
)
async def test_an_api_killed_mid_request_while_clients_retry_creates_each_order_once(
    orders_db: str, tmp_path: Path, mode: str
) -> None:
    """kill -9 of the API process FAULTS times at random moments under SIZE concurrent
    logical requests (duplicates, replays, conflicts, hostile keys): every request ends with
    one order and the same 201 for every copy, conflicts with a 422 and nothing created."""
    work = plan(SIZE, seed=7)
    probe = Probe(orders_db)
    rng = random.Random(mode)
    kills = 0
    last_fault = began = time.monotonic()
    with served(orders_db, tmp_path, one_transaction=mode == "one transaction") as api:
        await api.begin()
        clients = Clients(api.base, api)
        sending = asyncio.create_task(clients.run(work))
        try:
            for i in range(FAULTS):
                target = len(work.logical) * (i + 1) // (FAULTS + 1)
                deadline = time.monotonic() + REQUEST_DEADLINE_S
                while clients.finished < target and not sending.done():
                    assert time.monotonic() < deadline, "the clients made no progress"
                    await asyncio.sleep(0.02)
                if sending.done():
                    break
                await asyncio.sleep(rng.uniform(0, 0.3))  # a random moment, mid-request
                await api.kill()
                kills += 1
                await api.begin()
                last_fault = time.monotonic()
            await asyncio.wait_for(asyncio.shield(sending), max(300.0, SIZE / 20))
        finally:
            if not sending.done():
                sending.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await sending
        stuck = await wait_no_claim_in_progress(probe, LEASE_S + 10)
        drain_s = time.monotonic() - last_fault
        alive = api.procs[-1].poll() is None
    total_s = time.monotonic() - began
    problems, figures = await check(probe, work)
    if stuck:
        problems.append(stuck)
    if not alive:
        problems.append("the last API process died without being killed")
    if kills < 1:
        problems.append("no fault was injected")
    if not clients.cut:
        problems.append("no kill cut a request mid-way")
    unexplained = [
        (s, t) for s, t, restarting in clients.server_errors if not restarting or s != 503
    ]
    if unexplained:
        problems.append(
            f"5xx answers besides a 503 while a server was killed or starting: "
            f"{Counter(unexplained).most_common(5)}"
        )
    n409 = sum(clients.in_flight.values())
    n503 = sum(1 for status, _, _ in clients.server_errors if status == 503)
    report = Report(
        scenario=(
            f"http api: kill -9 mid-request while clients retry ({mode}; "
            f"{clients.connection_errors} connection errors, {clients.cut} of them mid-request, "
            f"{n409} 409s, {n503} 503s)"
        ),
        messages=work.sends,
        duplicates=work.sends - len(work.logical) - len(work.refused),
        faults=kills,
        lost=figures["lost"],
        duplicated_effects=figures["duplicated_effects"],
        external_keys_differing=figures["answers_differing"],
        drain_s=drain_s,
        total_s=total_s,
        problems=problems,
    )
    await record(report)
    print(f"keys taken over after a kill (a claim of more than one run): {figures['run_again']}")
    assert kills == FAULTS
    assert not problems, "\n".join(problems)
