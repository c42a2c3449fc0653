"""The status page: per handler, claims by status, duplicates suppressed, the outbox's backlog,
recent trouble and stuck keys with a button to release one. Server-rendered HTML, no JavaScript
framework.

    GET  /status            the page (?stuck_after_s=60)
    POST /status/release    release one key (form: scope, key[, token])

Mounted by the webhook receiver and served by `dedupe-worker status --serve`. Releasing is
an operator's action: with a token configured (DEDUPE_STATUS_TOKEN) the page must be opened
as /status?token=... and every release carries it; without one, only clients on the loopback
interface may release (an empty token is no token). Loopback counts only when the Host header
names this machine too (localhost, 127.x, [::1]: no DNS rebinding) and the request carries
no X-Forwarded-For or Forwarded header (behind a proxy every client looks local: use the
token there). A release whose Origin is another site (or "null") is refused, and so
is one without an Origin when no token protects it (no cross-site forms); the browser asks
for confirmation first. With `operators_only` (the receiver's port faces the senders), only
those who may release see the page at all: token holders and loopback clients.
"""

from __future__ import annotations

import hmac
import html
import ipaddress
import logging
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import urlencode, urlsplit

from starlette.exceptions import HTTPException
from starlette.formparsers import MultiPartException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import HTMLResponse, RedirectResponse, Response
from starlette.routing import BaseRoute, Route

from dedupe.claims.store import ClaimStore
from dedupe.errors import StoreError
from dedupe.operations.claims import ClaimAdmin

logger = logging.getLogger(__name__)

LOOPBACK = frozenset({"localhost"})
PROXY_HEADERS = ("forwarded", "x-forwarded-for")
# A release form holds scope, key and maybe token: anything bigger is not our page's.
RELEASE_MAX_BYTES = 16 * 1024
RELEASE_MAX_FIELDS = 8
RELEASE_MAX_FIELD_BYTES = 4 * 1024
STYLE = """
body{font:14px/1.4 system-ui,sans-serif;margin:2em;color:#222}
h1{font-size:1.4em}h2{font-size:1.1em;margin-top:2em}
table{border-collapse:collapse;min-width:40em}th,td{padding:.3em .8em;text-align:left;
border-bottom:1px solid #ddd}th{background:#f4f4f4}td.n{text-align:right}
.flash{background:#e8f5e9;padding:.5em 1em;border-left:4px solid #43a047}
.error{background:#fdecea;border-left-color:#e53935}.muted{color:#777}
button{cursor:pointer}#recent td:nth-child(-n+4){white-space:nowrap}
"""


def _e(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.1f}"
    if hasattr(value, "isoformat"):
        return html.escape(value.isoformat(sep=" ", timespec="seconds"))
    text = str(value)
    return html.escape(text if len(text) <= 120 else text[:117] + "...")


def is_loopback(host: str | None) -> bool:
    """Whether a client address is this machine (127.0.0.0/8, ::1, ::ffff:127.x)."""
    if host is None:
        return False
    if host in LOOPBACK:
        return True
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped.is_loopback
    return address.is_loopback


def host_name(host: str | None) -> str | None:
    """The name in a Host header without its port ("[::1]:8000" -> "::1")."""
    if not host:
        return None
    host = host.strip().lower()
    if host.startswith("["):
        name, closed, rest = host[1:].partition("]")
        return name if closed and (not rest or rest.startswith(":")) else None
    if host.count(":") > 1:
        return host  # a bare IPv6 literal
    return host.partition(":")[0]


def is_local_request(request: Request) -> bool:
    """Whether a request is from this machine, to this machine, and not through a proxy."""
    if any(name in request.headers for name in PROXY_HEADERS):
        # uvicorn may have taken the client from X-Forwarded-For already; either way a
        # proxy makes every client look local.
        return False
    client = request.client.host if request.client else None
    # A loopback client naming another host is a browser fooled by DNS rebinding.
    return is_loopback(client) and is_loopback(host_name(request.headers.get("host")))


class StatusPage:
    """The page and its release action over a claim store."""

    def __init__(
        self,
        store: ClaimStore | Callable[[], ClaimStore | None],
        *,
        token: str | None = None,
        title: str = "dedupe-worker",
        path: str = "/status",
        operators_only: bool = False,
    ) -> None:
        self._store = store
        self.token = token or None  # "" would let in everyone who sends ?token=
        self.title = title
        self.path = path
        self.operators_only = operators_only

    def routes(self) -> list[BaseRoute]:
        return [
            Route(self.path, self.page, methods=["GET"]),
            Route(f"{self.path}/release", self.release, methods=["POST"]),
        ]

    def _admin(self) -> ClaimAdmin | None:
        store = self._store if isinstance(self._store, ClaimStore) else self._store()
        return ClaimAdmin(store) if store is not None else None

    def _token_matches(self, token: str | None) -> bool:
        return (
            self.token is not None
            and token is not None
            and hmac.compare_digest(token.encode(), self.token.encode())
        )

    def _may_release(self, request: Request, token: str | None) -> bool:
        if self.token is not None:
            return self._token_matches(token)
        return is_local_request(request)

    def _may_view(self, request: Request, token: str | None) -> bool:
        if not self.operators_only:
            return True
        return self._token_matches(token) or is_local_request(request)

    # -- GET -----------------------------------------------------------------------------

    async def page(self, request: Request) -> Response:
        token = request.query_params.get("token")
        if not self._may_view(request, token):
            needs = "?token=<the status token>" if self.token else "a loopback client"
            return Response(f"the status page needs {needs}", status_code=403)
        admin = self._admin()
        if admin is None:
            return HTMLResponse("<p>not started</p>", status_code=503)
        try:
            stuck_after_s = float(request.query_params.get("stuck_after_s", "60"))
        except ValueError:
            stuck_after_s = 60.0
        try:
            overview = await admin.overview()
            stuck = await admin.stuck(older_than_s=stuck_after_s, limit=100)
            recent = await admin.recent(("conflict", "failed", "dead_lettered"), limit=30)
            conflicts = await admin.conflicts(limit=30)
            outbox = await admin.outbox(limit=30)
        except StoreError as exc:
            logger.warning("status page: %s", exc)
            return HTMLResponse("<p>the claims database is unavailable</p>", status_code=503)
        can_release = self._may_release(request, token)
        parts = [
            f"<!doctype html><html><head><meta charset='utf-8'><title>{_e(self.title)} status"
            f"</title><style>{STYLE}</style></head><body>",
            f"<h1>{_e(self.title)} — claims</h1>",
            f"<p class='muted'>as of {_e(time.strftime('%Y-%m-%d %H:%M:%S'))}</p>",
            self._flash(request),
            self._overview(overview),
            self._outbox(outbox),
            self._stuck(stuck, stuck_after_s, can_release, token),
            self._conflicts(conflicts),
            self._recent(recent),
            "</body></html>",
        ]
        return HTMLResponse("".join(parts))

    def _flash(self, request: Request) -> str:
        if released := request.query_params.get("released"):
            return f"<p class='flash' id='flash'>released {_e(released)}</p>"
        if refused := request.query_params.get("refused"):
            return f"<p class='flash error' id='flash'>not released: {_e(refused)}</p>"
        return ""

    def _overview(self, rows: list[dict[str, Any]]) -> str:
        head = (
            "<h2>Handlers</h2><table id='handlers'><tr><th>handler (scope)</th>"
            "<th>in progress</th><th>completed</th><th>failed</th>"
            "<th>duplicates suppressed</th><th>conflicts</th></tr>"
        )
        body = "".join(
            f"<tr><td>{_e(r['handler'])}</td><td class='n'>{r['in_progress']}</td>"
            f"<td class='n'>{r['completed']}</td><td class='n'>{r['failed']}</td>"
            f"<td class='n'>{r['duplicates']}</td><td class='n'>{r['conflicts']}</td></tr>"
            for r in rows
        )
        empty = "" if rows else "<tr><td colspan='6' class='muted'>no claims yet</td></tr>"
        return head + body + empty + "</table>"

    def _outbox(self, backlog: dict[str, Any]) -> str:
        lag = backlog.get("cleanup_lag_s") or 0
        cleanup = (
            f"<p id='outbox-cleanup'>sent rows past their retention have waited {lag:,.0f} s "
            "for clean-up (workers clean up every --gc-interval-s; with 0, schedule "
            "<code>dedupe-worker gc</code>)</p>"
            if lag
            else ""
        )
        if not backlog["unsent"]:
            return (
                "<h2>Outbox</h2><p class='muted' id='outbox-totals'>nothing waiting to be "
                f"relayed</p>{cleanup}"
            )
        totals = (
            f"<p id='outbox-totals'>{backlog['unsent']} unsent, the oldest "
            f"{backlog['oldest_unsent_s']:,.0f} s old, {backlog['refused']} refused by the "
            "broker at least once (each is tried again with backoff)</p>"
        )
        head = (
            "<table id='outbox'><tr><th>channel</th><th>unsent</th><th>oldest (s)</th>"
            "<th>refused</th><th>latest error</th></tr>"
        )
        body = "".join(
            f"<tr><td>{_e(r['channel'])}</td><td class='n'>{r['unsent']}</td>"
            f"<td class='n'>{_e(r['oldest_unsent_s'])}</td><td class='n'>{r['refused']}</td>"
            f"<td>{_e(r['last_error'])}</td></tr>"
            for r in backlog["channels"]
        )
        return "<h2>Outbox</h2>" + totals + cleanup + head + body + "</table>"

    def _stuck(
        self, rows: list[dict[str, Any]], after_s: float, can_release: bool, token: str | None
    ) -> str:
        head = (
            f"<h2>In progress for more than {after_s:g} s</h2><table id='stuck'><tr>"
            "<th>scope</th><th>key</th><th>age (s)</th><th>owner</th><th>attempts</th>"
            "<th>lease</th><th></th></tr>"
        )
        body = []
        for r in rows:
            button = ""
            if can_release:
                # The token rides in the query so a release is judged before its body is read.
                action = f"{self.path}/release" + (
                    f"?{urlencode({'token': token})}" if token else ""
                )
                question = html.escape(
                    f"Release {r['scope']}/{r['key']}? The next delivery runs it again.", quote=True
                )
                button = (
                    f"<form method='post' action='{html.escape(action, quote=True)}' "
                    f"onsubmit=\"return confirm('{question}')\">"
                    f"<input type='hidden' name='scope' value='{_e(r['scope'])}'>"
                    f"<input type='hidden' name='key' value='{_e(r['key'])}'>"
                    f"<button type='submit' class='release'>release</button></form>"
                )
            lease = "lapsed" if r["lease_lapsed"] else "live"
            body.append(
                f"<tr><td>{_e(r['scope'])}</td><td class='key'>{_e(r['key'])}</td>"
                f"<td class='n'>{_e(r['age_s'])}</td><td>{_e(r['owner'])}</td>"
                f"<td class='n'>{r['attempts']}</td><td>{lease}</td><td>{button}</td></tr>"
            )
        empty = "" if rows else "<tr><td colspan='7' class='muted'>none</td></tr>"
        note = (
            ""
            if can_release
            else "<p class='muted'>Releasing needs the status token or a loopback client.</p>"
        )
        return head + "".join(body) + empty + "</table>" + note

    def _conflicts(self, rows: list[dict[str, Any]]) -> str:
        """Unsettled conflicts: both fingerprints and the paths that differ (no values)."""
        head = (
            "<h2>Unsettled conflicts</h2><table id='conflicts'><tr><th>since</th><th>scope</th>"
            "<th>key</th><th>deliveries</th><th>this payload / the claim's</th>"
            "<th>differs at</th></tr>"
        )
        body = "".join(
            f"<tr><td>{_e(r['at'])}</td><td>{_e(r['scope'])}</td><td class='key'>"
            f"{_e(r['key'])}</td><td class='n'>{r['deliveries']}</td><td class='key'>"
            f"{_e(r['fingerprint'][:80])}<br>{_e(r['claimed_fingerprint'][:80])}</td>"
            f"<td>{'<br>'.join(_e(c) for c in (r['diff'] or [])) or _e(r['note'])}</td></tr>"
            for r in rows
        )
        empty = "" if rows else "<tr><td colspan='6' class='muted'>none</td></tr>"
        note = (
            "<p class='muted'>Settle one with <code>dedupe-worker conflicts settle SCOPE KEY "
            "--discard</code> or <code>--run-as NEW_KEY</code>.</p>"
        )
        return head + body + empty + "</table>" + note

    def _recent(self, rows: list[dict[str, Any]]) -> str:
        head = (
            "<h2>Recent conflicts and dead letters</h2><table id='recent'><tr><th>when</th>"
            "<th>event</th><th>scope</th><th>key</th><th>reason</th><th>detail</th></tr>"
        )
        body = "".join(
            f"<tr><td>{_e(r['at'])}</td><td>{_e(r['event'])}</td><td>{_e(r['scope'])}</td>"
            f"<td>{_e(r['key'])}</td><td>{_e(r['reason'])}</td><td>{_e(r['detail'])}</td></tr>"
            for r in rows
        )
        empty = "" if rows else "<tr><td colspan='6' class='muted'>none</td></tr>"
        return head + body + empty + "</table>"

    # -- POST ----------------------------------------------------------------------------

    async def release(self, request: Request) -> Response:
        origin = request.headers.get("origin")
        if origin is None:
            # Without a token, being on this machine is the only credential, and every
            # browser here has it; browsers send Origin with a POST, so a request without
            # one is not our page's form. A token vouches for curl and scripts.
            if self.token is None:
                return Response("a release needs an Origin header", status_code=403)
        elif origin == "null" or urlsplit(origin).netloc != request.headers.get("host"):
            # "null": a sandboxed frame, a file: page or a redirect from another site.
            return Response("cross-site release refused", status_code=403)
        # Judge who asks before reading the body when the query says enough: a stranger
        # must not make us buffer and parse a form.
        token = request.query_params.get("token")
        if (self.token is None or token is not None) and not self._may_release(request, token):
            return Response("releasing needs the status token", status_code=403)
        length = request.headers.get("content-length", "0")
        if not (length.isascii() and length.isdigit()):
            return Response("the release form could not be read", status_code=400)
        if int(length) > RELEASE_MAX_BYTES:
            return Response("the release form is too large", status_code=413)
        try:
            form = await request.form(
                max_files=0, max_fields=RELEASE_MAX_FIELDS, max_part_size=RELEASE_MAX_FIELD_BYTES
            )
        except (HTTPException, MultiPartException, ClientDisconnect):
            return Response("the release form could not be read", status_code=400)
        scope, key, in_form = form.get("scope"), form.get("key"), form.get("token")
        if token is None and isinstance(in_form, str):
            token = in_form  # a script may post the token in the form instead
        if not self._may_release(request, token):
            return Response("releasing needs the status token", status_code=403)
        if not isinstance(scope, str) or not isinstance(key, str):
            return Response("scope and key are required", status_code=400)
        admin = self._admin()
        if admin is None:
            return Response("not started", status_code=503)
        try:
            status = await admin.release(scope, key)
        except StoreError as exc:
            logger.warning("status page: release failed: %s", exc)
            return Response("the claims database is unavailable", status_code=503)
        query: dict[str, str] = {"token": token} if token else {}
        if status is None:
            query["refused"] = f"{scope}/{key} is completed or gone"
        else:
            query["released"] = f"{scope}/{key} (was {status})"
            logger.info(
                "released %s/%s from the status page",
                scope,
                key,
                extra={"scope": scope, "key": key, "outcome": "released"},
            )
        return RedirectResponse(f"{self.path}?{urlencode(query)}", status_code=303)


__all__ = ["StatusPage"]
