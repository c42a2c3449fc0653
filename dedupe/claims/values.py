"""What PostgreSQL can store: keys and scopes checked before a claim, results made storable.

PostgreSQL's `text` holds no NUL and only valid UTF-8; `jsonb` refuses the escapes `\\u0000` and
lone surrogates, `NaN`, numbers beyond `numeric`'s range and nesting deeper than its stack; a
B-tree entry (the claims' primary key) holds at most 2,704 bytes. One message's value must never
fail a statement it shares with others, so these are settled here, per message, before any
statement is sent.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import pydantic
import pydantic_core

from dedupe.errors import InvalidKey

MAX_KEY_LENGTH = 512  # characters, for a key and for a scope
# Scope and key together, as UTF-8, under the B-tree's 2,704-byte limit for the primary key
# with room for the tuple's own header.
MAX_KEY_BYTES = 2_400
# Larger results are not kept (a marker stands in for them): a claim is a record of what
# happened, replayed to duplicates, not a blob store.
MAX_RESULT_BYTES = 1024 * 1024
# jsonb parses nesting recursively; far below PostgreSQL's default max_stack_depth (2 MB).
MAX_RESULT_DEPTH = 1_000
# numeric keeps up to 131,072 digits before the point and 16,383 after it.
MAX_NUMBER_DIGITS = 16_000

_UNSTORABLE_CHARS = re.compile("[\x00\ud800-\udfff]")
_NUL_ESCAPE = re.compile(r"(\\+)u0000")
_LONG_NUMBER = re.compile(rf"[0-9]{{{MAX_NUMBER_DIGITS},}}")


def _unstorable(value: str) -> str | None:
    """Why `value` cannot be stored as text, or None when it can."""
    found = _UNSTORABLE_CHARS.search(value)
    if found is None:
        return None
    at = found.start()
    if found.group() == "\x00":
        return f"contains a NUL character (at {at})"
    return f"is not valid Unicode (a lone surrogate at {at})"


def check_claimable(scope: str, key: str) -> None:
    """Raise InvalidKey when the claims table cannot store or index (scope, key)."""
    # The usual key: short ASCII without NUL (a few C-level scans, no regex).
    if (
        len(key) <= MAX_KEY_LENGTH
        and len(scope) <= MAX_KEY_LENGTH
        and key.isascii()
        and scope.isascii()
        and "\x00" not in key
        and "\x00" not in scope
    ):
        return
    for what, value in (("scope", scope), ("idempotency key", key)):
        if not isinstance(value, str):
            raise InvalidKey(f"the {what} is not text ({type(value).__name__})")
        if len(value) > MAX_KEY_LENGTH:
            raise InvalidKey(
                f"the {what} is {len(value)} characters long; at most {MAX_KEY_LENGTH} are stored"
            )
        problem = _unstorable(value)
        if problem is not None:
            raise InvalidKey(f"the {what} {problem}; PostgreSQL cannot store it")
    size = len(scope.encode()) + len(key.encode())
    if size > MAX_KEY_BYTES:
        raise InvalidKey(
            f"scope and key are {size} bytes as UTF-8; at most {MAX_KEY_BYTES} can be indexed"
        )


def storable_text(value: str, limit: int | None = None) -> str:
    """`value` with NUL and lone surrogates replaced by U+FFFD, cut to `limit` characters."""
    if limit is not None and len(value) > limit:
        value = value[:limit]
    if _UNSTORABLE_CHARS.search(value) is None:
        return value
    return _UNSTORABLE_CHARS.sub("\ufffd", value)


def storable_error(exc: BaseException, limit: int = 300) -> str:
    """An error as one storable line: its class and (the start of) its message."""
    try:
        text = storable_text(str(exc), limit)
    except Exception:  # an exception whose str() fails
        text = ""
    return f"{exc.__class__.__name__}: {text}" if text else exc.__class__.__name__


def _keep_escaped_backslashes(match: re.Match[str]) -> str:
    slashes = match.group(1)
    if len(slashes) % 2 == 0:  # "\\u0000": an escaped backslash, then the text "u0000"
        return match.group(0)
    return slashes[:-1] + "\\ufffd"


def _depth(text: str) -> int:
    """The deepest nesting of arrays and objects in a JSON text (strings skipped)."""
    depth = deepest = 0
    in_string = escaped = False
    for char in text:
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif char in "]}":
            depth -= 1
    return deepest


DROPPED = "dedupe_result_dropped"  # the key of the marker stored in place of a result


def dropped_result(why: str) -> str:
    """The JSON kept in place of a result the claims table cannot hold."""
    return pydantic_core.to_json({DROPPED: storable_text(why, 300)}).decode()


def storable_json(text: str) -> str:
    """A JSON text `jsonb` accepts: `\\u0000` escapes become U+FFFD; a result too large, too
    deep or with numbers beyond `numeric` is replaced by a marker saying why."""
    if len(text) > MAX_RESULT_BYTES // 4 and len(text.encode()) > MAX_RESULT_BYTES:
        return dropped_result(
            f"the result is {len(text.encode())} bytes; a claim stores at most {MAX_RESULT_BYTES}"
        )
    if "u0000" in text:
        text = _NUL_ESCAPE.sub(_keep_escaped_backslashes, text)
    if text.count("[") + text.count("{") > MAX_RESULT_DEPTH and _depth(text) > MAX_RESULT_DEPTH:
        return dropped_result(f"the result nests deeper than {MAX_RESULT_DEPTH} levels")
    if len(text) >= MAX_NUMBER_DIGITS and _LONG_NUMBER.search(text):
        return dropped_result(f"the result holds a number of over {MAX_NUMBER_DIGITS} digits")
    return text


def encode_result(value: Any) -> str:
    """The handler's return value as JSON `jsonb` can hold (pydantic models, dataclasses, ...).

    NaN and infinities become null; a value JSON cannot express is stored as its repr; text the
    database cannot hold (NUL, lone surrogates) is replaced character by character.
    """
    if value is None:
        return "null"
    try:
        text = pydantic_core.to_json(value, inf_nan_mode="null").decode()
    except (pydantic_core.PydanticSerializationError, RecursionError, ValueError):
        # Lone surrogates fail the encoder: mend the strings and try again; a value JSON
        # cannot express at all is kept as its repr.
        try:
            text = pydantic_core.to_json(_mend(value), inf_nan_mode="null").decode()
        except (pydantic_core.PydanticSerializationError, RecursionError, ValueError) as exc:
            try:
                text = pydantic_core.to_json(storable_text(repr(value), MAX_RESULT_BYTES)).decode()
            except RecursionError:
                return dropped_result(f"the result cannot be encoded as JSON ({exc})")
    return storable_json(text)


def step_json(value: Any) -> str:
    """A durable step's result as JSON `jsonb` takes; ValueError when it is not JSON.

    The step's function has already run, so nothing `jsonb` can hold is refused: unlike a
    handler's result there is no size, depth or number policy here (refusing would make the
    next attempt call the step again). Text the database cannot hold (NUL, lone surrogates)
    is replaced character by character (U+FFFD).
    """
    try:
        text = pydantic_core.to_json(value, inf_nan_mode="null").decode()
    except (pydantic_core.PydanticSerializationError, RecursionError, ValueError):
        try:
            text = pydantic_core.to_json(_mend(value), inf_nan_mode="null").decode()
        except (pydantic_core.PydanticSerializationError, RecursionError, ValueError) as exc:
            raise ValueError(
                "its result must be JSON (a model, dict, list, str, number, bool or None) "
                f"nested at most 254 levels, not this {type(value).__name__} ({exc})"
            ) from exc
    if "u0000" in text:
        text = _NUL_ESCAPE.sub(_keep_escaped_backslashes, text)
    return text


def _mend(value: Any) -> Any:
    """The value with every string in it (object keys too) made storable."""
    if isinstance(value, str):
        return storable_text(value)
    if isinstance(value, pydantic.BaseModel):
        value = value.model_dump(mode="python", by_alias=True)
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = dataclasses.asdict(value)
    if isinstance(value, dict):
        return {_mend(k) if isinstance(k, str) else k: _mend(v) for k, v in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        return [_mend(item) for item in value]
    return value


__all__ = [
    "MAX_KEY_BYTES",
    "MAX_KEY_LENGTH",
    "MAX_RESULT_BYTES",
    "check_claimable",
    "dropped_result",
    "encode_result",
    "step_json",
    "storable_error",
    "storable_json",
    "storable_text",
]
