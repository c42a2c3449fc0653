"""How a handler's first parameter is decoded from a message body, chosen by its annotation."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import pydantic

from dedupe.errors import ConfigurationError, InvalidPayload
from dedupe.message import Message

Decoder = Callable[[Message], Any]


def decoder_for(annotation: Any, where: str) -> Decoder:
    """A pydantic model (JSON, validated), bytes, a dedupe.Message, or any type pydantic takes."""
    if annotation is Message:
        return lambda message: message
    if annotation is bytes:
        return lambda message: message.body
    if annotation is inspect.Parameter.empty:
        raise ConfigurationError(
            f"{where}: annotate the first parameter (a pydantic model, bytes, dict, "
            "or dedupe.Message) so the worker knows how to decode the body"
        )
    try:
        adapter: pydantic.TypeAdapter[Any] = pydantic.TypeAdapter(annotation)
    except (pydantic.PydanticSchemaGenerationError, TypeError) as exc:
        raise ConfigurationError(f"{where}: cannot decode into {annotation!r}: {exc}") from exc

    def decode(message: Message) -> Any:
        try:
            return adapter.validate_json(message.body)
        except pydantic.ValidationError as exc:
            kinds = sorted({err["type"] for err in exc.errors()})
            if "json_invalid" in kinds:
                raise InvalidPayload("body is not valid JSON") from exc
            fields = sorted({".".join(map(str, err["loc"])) or "<root>" for err in exc.errors()})
            raise InvalidPayload(
                f"body does not match {getattr(annotation, '__name__', annotation)}: "
                f"{', '.join(kinds)} at {', '.join(fields)}"
            ) from exc

    return decode


__all__ = ["Decoder", "decoder_for"]
