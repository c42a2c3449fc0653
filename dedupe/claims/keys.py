"""Idempotency-key and scope derivation: specs are parsed once, at registration time."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from dedupe.errors import ConfigurationError, InvalidPayload, KeyMissing
from dedupe.message import Message

KeyFunc = Callable[[Message], "str | None"]
KeySpec = str | KeyFunc

# Where each transport puts the producer's message id when it is not a native property.
MESSAGE_ID_HEADER = "message-id"


def _body_json(message: Message) -> Any:
    try:
        return json.loads(message.body)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        # RecursionError: nesting deeper than the interpreter's stack, e.g. b"[" * 100_000.
        raise InvalidPayload(f"body is not valid JSON ({exc.__class__.__name__})") from exc


def _from_message_id(message: Message) -> str | None:
    if message.message_id:
        return message.message_id
    return message.headers.get(MESSAGE_ID_HEADER) or None


def _from_header(name: str) -> KeyFunc:
    def derive(message: Message) -> str | None:
        return message.headers.get(name) or None

    return derive


def _from_body(path: str) -> KeyFunc:
    parts = path.split(".")

    def derive(message: Message) -> str | None:
        node = _body_json(message)
        for part in parts:
            if isinstance(node, dict) and part in node:
                node = node[part]
            elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
                node = node[int(part)]
            else:
                return None
        if node is None or isinstance(node, dict | list):
            return None
        if isinstance(node, bool):
            return str(node).lower()
        return str(node)

    return derive


def _from_kafka_offset(message: Message) -> str | None:
    meta = message.meta
    if {"topic", "partition", "offset"} <= meta.keys():
        return f"{meta['topic']}/{meta['partition']}/{meta['offset']}"
    return None


def _parse_one(term: str) -> KeyFunc:
    term = term.strip()
    if term == "message_id":
        return _from_message_id
    if term == "kafka:offset":
        return _from_kafka_offset
    kind, sep, rest = term.partition(":")
    if sep and rest:
        if kind == "header":
            return _from_header(rest)
        if kind == "body":
            if any(not part for part in rest.split(".")):
                raise ConfigurationError(f"key spec {term!r}: empty segment in the body path")
            return _from_body(rest)
    raise ConfigurationError(
        f"unknown key spec {term!r}: use 'message_id', 'header:NAME', 'body:dotted.path', "
        "'kafka:offset', several joined by '|', or a callable (Message) -> str | None"
    )


def compile_key(spec: KeySpec) -> KeyFunc:
    """Turn a key spec into a function; raise ConfigurationError on a malformed spec."""
    if callable(spec):
        return spec
    if not isinstance(spec, str) or not spec.strip():
        raise ConfigurationError("key spec must be a non-empty string or a callable")
    chain = [_parse_one(term) for term in spec.split("|")]
    if len(chain) == 1:
        return chain[0]

    def derive(message: Message) -> str | None:
        for candidate in chain:
            try:
                value = candidate(message)
            except InvalidPayload:
                # A body path on a non-JSON body is just "not here"; try the next source.
                continue
            if value:
                return value
        return None

    return derive


def derive_key(func: KeyFunc, message: Message) -> str:
    """Apply a compiled key function; raise KeyMissing or InvalidPayload when it yields nothing.

    Whether the claims table can store the key is dedupe.claims.values.check_claimable's to say.
    """
    value = func(message)
    if value is None or value == "":
        raise KeyMissing("the message has no idempotency key where the handler looks for one")
    if not isinstance(value, str):
        value = str(value)
    return value
