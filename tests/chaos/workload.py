"""The chaos suite's workload: what is published, and what each message must end as."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from typing import Any

from tests.apps.chaos import HOSTILE_RESULTS

Messages = list[tuple[bytes, dict[str, Any], str | None]]

# Hostile keys: the body id where the handler's key= looks, which the claims table cannot
# store (NUL, a lone surrogate: JSON "\ud800" decodes to one) or over 512 characters.
HOSTILE_KEYS = ("nul", "surrogate", "long")
HOSTILE_KEY_LENGTH = 600
# A tenant header of 4 KB: scope and key over the 2,400 bytes the primary key can index.
HOSTILE_TENANT_BYTES = 4096
TENANTS = ("t-a", "t-b")


def hostile_key(kind: str, message_id: str) -> str:
    """The body id of a hostile-key message: its message id made unstorable."""
    if kind == "nul":
        return f"{message_id}\x00"
    if kind == "surrogate":
        return f"{message_id}\ud800"
    return f"{message_id}-".ljust(HOSTILE_KEY_LENGTH, "k")


@dataclass
class Workload:
    """N logical messages: 30 % published twice, 5 % three to five times, 1 % also under the
    same key with another payload, 0.5 % poison (always fail), and 0.1 % of each hostile kind
    (at least one each): keys the claims table cannot store (NUL, a lone surrogate, 600
    characters), a 4 KB tenant, results jsonb cannot hold (NUL, a lone surrogate, NaN).

    Each message is (body, headers, message id); every one carries a tenant (X-Tenant). A
    hostile key's message id is its kind and number (`nul-0000012`): its dead letter carries no
    key, only that id. Hostile results are ordinary keys whose body asks the handler to return
    such a value (`"result": "nan"`); they are in `normal`.
    """

    n: int
    seed: int = 1
    messages: Messages = field(default_factory=list)
    normal: set[str] = field(default_factory=set)
    conflicts: set[str] = field(default_factory=set)
    poison: set[str] = field(default_factory=set)
    invalid_keys: dict[str, str] = field(default_factory=dict)  # message id -> kind
    invalid_tenants: set[str] = field(default_factory=set)  # message ids (= body ids)
    hostile_results: dict[str, str] = field(default_factory=dict)  # key -> kind
    copies: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        rng = random.Random(self.seed)
        n_poison = max(1, self.n // 200)
        n_conflict = max(1, self.n // 100)
        n_hostile = max(1, self.n // 1000)  # of each kind
        keys = [f"m{i:07d}" for i in range(self.n)]
        self.poison = set(keys[:n_poison])
        kinds = [(k, "key") for k in HOSTILE_KEYS]
        kinds += [("tenant", "tenant")] + [(f"r-{k}", "result") for k in HOSTILE_RESULTS]
        at = n_poison
        for kind, what in kinds:
            for i in range(at, at + n_hostile):
                keys[i] = f"{kind}-{i:07d}"
                if what == "key":
                    self.invalid_keys[keys[i]] = kind
                elif what == "tenant":
                    self.invalid_tenants.add(keys[i])
                else:
                    self.hostile_results[keys[i]] = kind.removeprefix("r-")
            at += n_hostile
        unclaimable = self.invalid_keys.keys() | self.invalid_tenants
        self.normal = set(keys) - self.poison - unclaimable
        for key in keys[n_poison:]:
            roll = rng.random()
            self.copies[key] = 2 if roll < 0.30 else rng.randint(3, 5) if roll < 0.35 else 1
        # Conflicts among plain keys published once, so each yields one completion and one
        # dead letter.
        singles = [
            key
            for key, count in self.copies.items()
            if count == 1 and key in self.normal and key not in self.hostile_results
        ]
        self.conflicts = set(rng.sample(singles, min(n_conflict, len(singles))))
        for i, key in enumerate(keys):
            body: dict[str, Any] = {"id": key, "v": i, "poison": key in self.poison}
            headers = {"X-Tenant": TENANTS[i % len(TENANTS)]}
            if key in self.invalid_keys:
                body["id"] = hostile_key(self.invalid_keys[key], key)
            elif key in self.invalid_tenants:
                headers["X-Tenant"] = f"{key}-".ljust(HOSTILE_TENANT_BYTES, "t")
            elif key in self.hostile_results:
                body["result"] = self.hostile_results[key]
            for _ in range(self.copies.get(key, 1)):
                self.messages.append((json.dumps(body).encode(), headers, key))
        rng.shuffle(self.messages)
        for key in sorted(self.conflicts):  # the other payload arrives later, same tenant
            i = int(key[1:])
            other = {"id": key, "v": 1_000_000 + i}
            headers = {"X-Tenant": TENANTS[i % len(TENANTS)]}
            self.messages.append((json.dumps(other).encode(), headers, key))

    @property
    def duplicates(self) -> int:
        return len(self.messages) - self.n

    @property
    def claimed(self) -> int:
        """Keys that get a claim: all but the hostile keys and tenants."""
        return len(self.normal) + len(self.poison)

    @property
    def letters_at_most(self) -> int:
        """A bound on the dead letters read back (poison, conflicts, every copy of a hostile
        key or tenant), with room for the ones kills repeat: dead letters are at least once,
        and a kill after a dead letter's publish and before its ack or offset commit sends it
        again. On Kafka one kill repeats every dead letter of the batches in flight beyond the
        committed offset (up to `batches_in_flight` per partition): at 50 kills of the large
        run that was 111 to 189 repeats, past the fixed room of 100 this bound once had, so the
        read stopped short and the last letters looked missing. The room is now as large as
        the letters themselves."""
        unclaimable = [*self.invalid_keys, *self.invalid_tenants]
        copies = sum(self.copies.get(key, 1) for key in unclaimable)
        return 2 * (len(self.poison) + len(self.conflicts) + copies) + 100
