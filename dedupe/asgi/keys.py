"""What an HTTP request's claim is made of, with no I/O: its idempotency key (from a header, a
form field or the JSON body, by the workers' key specs), its principal (keyed-hashed), its
fingerprint and the scope its key lives in."""

from __future__ import annotations

import email.parser
import email.policy
import hashlib
import hmac
import urllib.parse
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from dedupe.claims.fingerprints import Fingerprint
from dedupe.claims.keys import KeyFunc, KeySpec, compile_key
from dedupe.errors import ConfigurationError, InvalidPayload, KeyMissing
from dedupe.message import Headers, Message

KEY_HEADER = b"idempotency-key"
DEFAULT_KEY_SPEC = "header:Idempotency-Key"
MAX_KEY_CHARS = 255
# The part of a scope after the app's name: `shop.http`, then `/<principal hash>`.
SCOPE_SUFFIX = ".http"
# A principal's hash is keyed by a secret this long at least (an HMAC key a guess cannot find).
MIN_SECRET_BYTES = 16

FORM_URLENCODED = b"application/x-www-form-urlencoded"
FORM_MULTIPART = b"multipart/form-data"

RawHeaders = Iterable[tuple[bytes, bytes]]


class KeyRefused(ValueError):
    """The request's idempotency key cannot be a key (the message says why): a 400."""


class SourceFailed(Exception):
    """A `key=` or `scope=` function of the middleware raised on a request (other than
    InvalidPayload or KeyMissing, which mean "not in this request"): a 400, never a 5xx; the
    function's exception is the __cause__."""

    def __init__(self, option: str, exc: BaseException) -> None:
        super().__init__(f"the {option} function raised {exc.__class__.__name__}")
        self.option = option


@dataclass(frozen=True, slots=True)
class RequestLine:
    """What the fingerprint covers besides the body."""

    method: str
    path: bytes
    query: bytes


def _unquote(raw: bytes, where: str) -> bytes:
    """An RFC 8941 sf-string's content: `"..."` with `\\"` and `\\\\` escapes."""
    if len(raw) < 2 or not raw.endswith(b'"'):
        raise KeyRefused(f'a quoted {where} must end with its closing quote (")')
    out = bytearray()
    escaped = False
    for byte in raw[1:-1]:
        if escaped:
            if byte not in b'"\\':
                raise KeyRefused(f'in a quoted {where} only \\" and \\\\ are escapes')
            out.append(byte)
            escaped = False
        elif byte == 0x5C:  # backslash
            escaped = True
        elif byte == 0x22:  # a bare quote inside the string
            raise KeyRefused(f'a quoted {where} has an unescaped quote (")')
        else:
            out.append(byte)
    if escaped:
        raise KeyRefused(f"a quoted {where} ends in a lone backslash")
    return bytes(out)


def checked_key(raw: bytes, where: str = "Idempotency-Key") -> str:
    """The key a source yielded, or KeyRefused: 1-255 visible ASCII characters (%x21-7E).

    A value that starts with a quote is read as a structured-field string, as the IETF draft
    writes the key, and its content must be visible ASCII too (so `"abc"` and `abc` are the
    same key). `where` names the source in the refusal ("the Idempotency-Key", "form field k").
    """
    raw = raw.strip(b" \t")
    if raw.startswith(b'"'):
        raw = _unquote(raw, where)
    if not raw:
        raise KeyRefused(f"the {where} is empty")
    if len(raw) > MAX_KEY_CHARS:
        raise KeyRefused(f"the {where} is {len(raw)} characters long; at most {MAX_KEY_CHARS}")
    if any(byte < 0x21 or byte > 0x7E for byte in raw):
        raise KeyRefused(f"the {where} is visible ASCII only (no spaces, no controls)")
    return raw.decode("ascii")


def key_of(headers: RawHeaders, name: bytes = KEY_HEADER) -> str | None:
    """The key in header `name`; None without the header; KeyRefused when it is not one (or
    the header comes twice)."""
    values = [value for header, value in headers if header.lower() == name]
    if not values:
        return None
    label = name.decode("latin-1")
    if name == KEY_HEADER:
        label = "Idempotency-Key"
    if len(values) > 1:
        raise KeyRefused(f"send one {label} header, not {len(values)}")
    return checked_key(values[0], label)


# -- forms -----------------------------------------------------------------------------------


def content_type(headers: RawHeaders) -> bytes:
    """The media type of the body, lower case, without parameters (b"" when none is sent)."""
    for name, value in headers:
        if name.lower() == b"content-type":
            return value.split(b";", 1)[0].strip().lower()
    return b""


def _raw_content_type(headers: RawHeaders) -> bytes:
    for name, value in headers:
        if name.lower() == b"content-type":
            return value
    return b""


@dataclass(frozen=True, slots=True)
class FormPart:
    """One field of a form body: its name, its value's bytes, and for a file its filename."""

    name: str
    value: bytes
    filename: str | None = None
    media_type: str | None = None


def form_parts(headers: Sequence[tuple[bytes, bytes]], body: bytes) -> list[FormPart] | None:
    """The fields of an urlencoded or multipart/form-data body; None for another body (or a
    multipart one that does not parse)."""
    kind = content_type(headers)
    if kind == FORM_URLENCODED:
        try:
            text = body.decode("ascii")
            pairs = urllib.parse.parse_qsl(
                text, keep_blank_values=True, encoding="utf-8", errors="strict"
            )
        except (UnicodeDecodeError, ValueError):
            return None
        return [FormPart(name, value.encode("utf-8")) for name, value in pairs]
    if kind != FORM_MULTIPART:
        return None
    head = b"Content-Type: " + _raw_content_type(headers) + b"\r\nMIME-Version: 1.0\r\n\r\n"
    try:
        document = email.parser.BytesParser(policy=email.policy.HTTP).parsebytes(head + body)
    except Exception:  # the email parser raises several kinds on a malformed document
        return None
    if not document.is_multipart():
        return None
    parts = []
    for part in document.iter_parts():
        name = part.get_param("name", header="content-disposition")
        if not isinstance(name, str):
            continue
        payload = part.get_payload(decode=True)
        filename = part.get_filename()
        parts.append(
            FormPart(
                name,
                payload if isinstance(payload, bytes) else b"",
                filename,
                part.get_content_type() if filename is not None else None,
            )
        )
    return parts


def form_canonical(parts: Sequence[FormPart]) -> bytes:
    """A multipart form's fields in one encoding without its boundary (a browser draws a new
    boundary for every submit of the same form)."""
    out = bytearray()
    for part in parts:
        for piece in (
            part.name.encode("utf-8", "surrogatepass"),
            (part.filename or "").encode("utf-8", "surrogatepass"),
            (part.media_type or "").encode("utf-8", "surrogatepass"),
            part.value,
        ):
            out += len(piece).to_bytes(8, "big") + piece
        out += b"\x00" if part.filename is None else b"\x01"
    return bytes(out)


# -- where the key comes from ----------------------------------------------------------------


SourceFunc = Callable[[Sequence[tuple[bytes, bytes]], "bytes | None"], "str | None"]


@dataclass(frozen=True, slots=True)
class KeySource:
    """A compiled key= of the middleware: header terms read before the body, the others (form
    fields, body paths, a callable) from the body when its type can carry them."""

    spec: str
    terms: tuple[tuple[str, object], ...]

    @property
    def reads_body(self) -> bool:
        return any(kind != "header" for kind, _ in self.terms)

    def wants_body(self, headers: Sequence[tuple[bytes, bytes]]) -> bool:
        """Whether the body is to be read to look for the key (its type can carry one)."""
        kind = content_type(headers)
        for term, _ in self.terms:
            if term == "callable":
                return True
            if term == "form" and kind in (FORM_URLENCODED, FORM_MULTIPART):
                return True
            if term == "body" and (kind in (b"", b"application/json") or kind.endswith(b"+json")):
                return True
        return False

    def find(
        self,
        line: RequestLine,
        headers: Sequence[tuple[bytes, bytes]],
        body: bytes | None,
    ) -> str | None:
        """The key, trying the terms in order (those needing the body only when it is given);
        None when no term yields one; KeyRefused when the one found is no key; SourceFailed
        when a callable raised."""
        parts: list[FormPart] | None = None
        message: Message | None = None
        for kind, term in self.terms:
            if kind == "header":
                assert isinstance(term, bytes)
                value = key_of(headers, term)
                if value is not None:
                    return value
                continue
            if body is None:
                continue
            if kind == "form":
                assert isinstance(term, str)
                if parts is None:
                    parts = form_parts(headers, body) or []
                values = [p.value for p in parts if p.name == term and p.filename is None]
                if len(values) > 1:
                    raise KeyRefused(f"send one form field {term}, not {len(values)}")
                if values:
                    return checked_key(values[0], f"form field {term}")
                continue
            if message is None:
                message = request_message(line, headers, body)
            func: KeyFunc = term  # type: ignore[assignment]
            if kind == "body" and not self._json_body(headers):
                continue
            try:
                found = func(message)
            except (InvalidPayload, KeyMissing):
                continue  # a body path on a body that is not JSON: not here
            except Exception as exc:
                raise SourceFailed("key=", exc) from exc
            if found is not None and found != "":
                text = found if isinstance(found, str) else str(found)
                return checked_key(text.encode("utf-8", "surrogatepass"), "idempotency key")
        return None

    @staticmethod
    def _json_body(headers: Sequence[tuple[bytes, bytes]]) -> bool:
        kind = content_type(headers)
        return kind in (b"", b"application/json") or kind.endswith(b"+json")


def compile_key_source(spec: KeySpec, where: str = "IdempotencyMiddleware") -> KeySource:
    """The middleware's key=: `header:NAME`, `form:NAME`, `body:dotted.path`, several joined
    by `|` (the first that yields), or a callable (dedupe.Message) -> str | None."""
    if callable(spec):
        return KeySource(getattr(spec, "__qualname__", "callable"), (("callable", spec),))
    if not isinstance(spec, str) or not spec.strip():
        raise ConfigurationError(f"{where}: key= is a key spec such as {DEFAULT_KEY_SPEC!r}")
    terms: list[tuple[str, object]] = []
    for raw_term in spec.split("|"):
        term = raw_term.strip()
        kind, sep, rest = term.partition(":")
        if sep and rest and kind == "header":
            terms.append(("header", rest.strip().lower().encode("latin-1")))
        elif sep and rest and kind == "form":
            terms.append(("form", rest.strip()))
        elif sep and rest and kind == "body":
            try:
                terms.append(("body", compile_key(term)))
            except ConfigurationError as exc:
                raise ConfigurationError(f"{where}: key={spec!r}: {exc}") from exc
        else:
            raise ConfigurationError(
                f"{where}: key={spec!r}: {term!r} is no key source of an HTTP request; use "
                "'header:NAME', 'form:NAME' (a field of an urlencoded or multipart body), "
                "'body:dotted.path' (a JSON body), several joined by '|', or a callable "
                "(dedupe.Message) -> str | None"
            )
    return KeySource(spec, tuple(terms))


# -- fingerprint, principal, scope -----------------------------------------------------------


def fingerprint(line: RequestLine, body: bytes) -> bytes:
    """SHA-256 of method, path, query and body, each length-prefixed (no two requests share
    an encoding)."""
    digest = hashlib.sha256()
    for part in (line.method.encode("ascii", "replace"), line.path, line.query, body):
        digest.update(len(part).to_bytes(8, "big"))
        digest.update(part)
    return digest.digest()


def request_hashes(
    scheme: Fingerprint, line: RequestLine, headers: Sequence[tuple[bytes, bytes]], body: bytes
) -> tuple[bytes, bytes | None]:
    """(payload hash, raw hash) of a request under the middleware's fingerprint=: the method,
    path and query always count; the body by its bytes (a multipart form by its fields, not its
    boundary), or under "json" / a callable as on handlers. The raw hash (None under raw) is
    what a claim stored before the scheme changed is compared with. InvalidPayload when a
    fingerprint function fails."""
    parts = form_parts(headers, body) if content_type(headers) == FORM_MULTIPART else None
    raw = fingerprint(line, body if parts is None else form_canonical(parts))
    if scheme.stored is None:
        return raw, None
    digest = scheme.digest(request_message(line, headers, body))
    return fingerprint(line, digest), raw


def principal_hash(principal: str, secret: bytes) -> str:
    """The principal as stored: the hex HMAC-SHA256 of its UTF-8 text under the middleware's
    secret, never the text nor a plain digest a dictionary reverses."""
    return hmac.new(secret, principal.encode("utf-8", "surrogatepass"), hashlib.sha256).hexdigest()


def scope_for(app_name: str, principal: str | None, secret: bytes | None) -> str:
    """The claims' scope of a request: `<app>.http`, plus `/<principal hash>` when scoped."""
    base = app_name + SCOPE_SUFFIX
    if principal is None:
        return base
    assert secret is not None  # the middleware refuses a scope= without a secret
    return f"{base}/{principal_hash(principal, secret)}"


def request_message(
    line: RequestLine, headers: Iterable[tuple[bytes, bytes]], body: bytes
) -> Message:
    """The request as a dedupe.Message, for a scope= key spec or callable to read."""
    return Message(
        channel=line.path.decode("latin-1"),
        body=body,
        # latin-1 maps every byte to one character: a header's bytes survive as its text.
        headers=Headers(
            {name.decode("latin-1"): value.decode("latin-1") for name, value in headers}
        ),
        meta={"method": line.method, "path": line.path.decode("latin-1"), "query": line.query},
    )


@dataclass(frozen=True, slots=True)
class PrincipalSource:
    """Whose request it is (the middleware's scope=): a compiled key spec or callable read
    from the request's Message; for a spec of one header (`header:NAME`, the default), that
    header read straight from the raw ASGI headers, as the Message's headers would give it,
    without building the Message."""

    func: KeyFunc
    header: bytes | None = None  # the header's name, lower case

    def of(
        self, line: RequestLine, headers: Sequence[tuple[bytes, bytes]], body: bytes
    ) -> str | None:
        """The principal's text; None when the request names nobody; SourceFailed when a
        function raised."""
        if self.header is None:
            return principal_of(self.func, request_message(line, headers, body))
        # As dedupe.message.Headers reads them: one value per spelling of the name (the last
        # sent under it), and of those the last spelling first seen.
        spellings: dict[bytes, bytes] = {}
        for name, value in headers:
            if name.lower() == self.header:
                spellings[bytes(name)] = value
        found = b""
        for value in spellings.values():
            found = value
        return bytes(found).decode("latin-1") or None


def compile_principal(spec: KeySpec) -> PrincipalSource:
    """The middleware's scope= (a key spec or callable; ConfigurationError when malformed)."""
    func = compile_key(spec)
    header = None
    if isinstance(spec, str) and "|" not in spec:
        kind, sep, rest = spec.strip().partition(":")
        if kind == "header" and sep and rest and rest.isascii():
            header = rest.lower().encode("ascii")
    return PrincipalSource(func, header)


def principal_of(scope_func: KeyFunc, message: Message) -> str | None:
    """Whose request this is, by the middleware's scope=; None when it names nobody;
    SourceFailed when the function raised anything else."""
    try:
        value = scope_func(message)
    except (InvalidPayload, KeyMissing):
        # A body path on a body that is not JSON: the request names no principal.
        return None
    except Exception as exc:
        raise SourceFailed("scope=", exc) from exc
    if value is None or value == "":
        return None
    return value if isinstance(value, str) else str(value)


__all__ = [
    "DEFAULT_KEY_SPEC",
    "KEY_HEADER",
    "MAX_KEY_CHARS",
    "MIN_SECRET_BYTES",
    "SCOPE_SUFFIX",
    "FormPart",
    "KeyRefused",
    "KeySource",
    "PrincipalSource",
    "RequestLine",
    "SourceFailed",
    "checked_key",
    "compile_key_source",
    "compile_principal",
    "content_type",
    "fingerprint",
    "form_canonical",
    "form_parts",
    "key_of",
    "principal_hash",
    "principal_of",
    "request_hashes",
    "request_message",
    "scope_for",
]
