"""The status page in a real headless Chromium: what it shows and its release button.

Served by the real `dedupe-worker status --serve`; Chromium and chromedriver come from
Debian (`make browser`, which `make test` runs). The screenshot is kept for people to look
at: .services/screenshots/status-page.png.
"""

from __future__ import annotations

import asyncio
import os
import socket
import sys
import time
from collections.abc import AsyncIterator

import asyncpg
import httpx
import pytest
from selenium import webdriver
from selenium.webdriver.common.by import By
from selenium.webdriver.support import expected_conditions
from selenium.webdriver.support.ui import WebDriverWait

from tests.conftest import ROOT

SCREENSHOTS = ROOT / ".services" / "screenshots"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
async def status_server(db_url: str) -> AsyncIterator[str]:
    port = free_port()
    env = {**os.environ, "DEDUPE_DATABASE_URL": db_url, "DEDUPE_STATUS_PORT": str(port)}
    env.pop("DEDUPE_STATUS_TOKEN", None)
    proc = await asyncio.create_subprocess_exec(
        *[sys.executable, "-m", "dedupe.cli", "status", "--serve"],
        cwd=ROOT,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 20
        async with httpx.AsyncClient() as client:
            while True:
                try:
                    if (await client.get(f"{url}/status")).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                if proc.returncode is not None or time.monotonic() > deadline:
                    proc.kill()
                    output = await proc.stdout.read() if proc.stdout else b""
                    pytest.fail(f"status --serve did not start: {output.decode()}")
                await asyncio.sleep(0.1)
        yield url
    finally:
        if proc.returncode is None:
            proc.terminate()
            await asyncio.wait_for(proc.wait(), 10)


async def plant(db: asyncpg.Connection) -> None:
    await db.execute(
        """INSERT INTO dedupe_claims (scope, key, payload_hash, status, owner, lease_until,
                                      created_at, claimed_at, expires_at, attempts, error)
           VALUES ('shop.charge', 'stuck-1', '\\x00', 'in_progress', 'worker-gone',
                   now() - interval '4 minutes', now() - interval '15 minutes',
                   now() - interval '15 minutes', now() + interval '7 days', 1, NULL),
                  ('shop.charge', 'done-1', '\\x00', 'completed', 'worker-a', NULL,
                   now(), now(), now() + interval '7 days', 1, NULL),
                  ('shop.charge', 'bad-1', '\\x00', 'in_progress', 'worker-a', now(),
                   now(), now(), now() + interval '7 days', 1, NULL)"""
    )
    # bad-1 fails (its history records it), then a conflict is seen on done-1
    await db.execute(
        "UPDATE dedupe_claims SET status = 'failed', reason = 'handler_error', "
        "error = 'ValueError: no' "
        "WHERE key = 'bad-1'"
    )
    await db.execute(
        "INSERT INTO dedupe_claim_events (scope, key, event, detail) "
        "VALUES ('shop.charge', 'done-1', 'conflict', 'another payload')"
    )
    await db.execute(
        "INSERT INTO dedupe_scope_counts (scope, duplicates, conflicts) "
        "VALUES ('shop.charge', 7, 1)"
    )


async def test_the_status_page_shows_the_claims_and_releases_a_stuck_key(
    db: asyncpg.Connection, status_server: str, browser: webdriver.Chrome
) -> None:
    """Per handler counts, stuck keys with their age, recent trouble; release asks first."""
    await plant(db)
    await asyncio.to_thread(browser.get, f"{status_server}/status")
    handlers = browser.find_element(By.ID, "handlers").text
    assert "shop.charge 1 1 1 7 1" in handlers  # in progress, completed, failed, dups, conflicts
    stuck = browser.find_element(By.ID, "stuck").text
    assert "stuck-1" in stuck and "worker-gone" in stuck and "lapsed" in stuck
    assert "bad-1" not in stuck
    recent = browser.find_element(By.ID, "recent").text
    assert "conflict" in recent and "failed" in recent and "handler_error" in recent
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    shot = SCREENSHOTS / "status-page.png"
    assert browser.save_screenshot(str(shot))
    assert shot.stat().st_size > 10_000

    # Dismissing the confirmation releases nothing.
    browser.find_element(By.CSS_SELECTOR, "#stuck button.release").click()
    WebDriverWait(browser, 5).until(expected_conditions.alert_is_present())
    alert = browser.switch_to.alert
    assert "Release shop.charge/stuck-1?" in alert.text
    alert.dismiss()
    assert await db.fetchval("SELECT retryable FROM dedupe_claims WHERE key = 'stuck-1'") is False

    # Accepting it releases the key, and the page says so.
    browser.find_element(By.CSS_SELECTOR, "#stuck button.release").click()
    WebDriverWait(browser, 5).until(expected_conditions.alert_is_present())
    browser.switch_to.alert.accept()
    flash = WebDriverWait(browser, 10).until(
        expected_conditions.presence_of_element_located((By.ID, "flash"))
    )
    assert "released shop.charge/stuck-1 (was in_progress)" in flash.text
    row = await db.fetchrow(
        "SELECT retryable, attempts, lease_until <= now() AS lapsed FROM dedupe_claims "
        "WHERE key = 'stuck-1'"
    )
    assert dict(row) == {"retryable": True, "attempts": 0, "lapsed": True}
    events = await db.fetch("SELECT event FROM dedupe_claim_events WHERE key = 'stuck-1'")
    assert [e["event"] for e in events] == ["released"]
    browser.save_screenshot(str(SCREENSHOTS / "status-page-released.png"))


async def test_the_status_page_shows_the_outbox_backlog_by_channel(
    db: asyncpg.Connection, status_server: str
) -> None:
    """Per destination channel: unsent rows, the oldest one's age, refusals and the latest
    error; the totals above the table."""
    async with httpx.AsyncClient() as client:
        empty = (await client.get(f"{status_server}/status")).text
        assert "nothing waiting to be relayed" in empty
        await db.execute(
            """INSERT INTO dedupe_outbox (producer, channel, message_id, body, created_at,
                                          attempts, last_error, expires_at)
               VALUES ('shop.charge\x1fa', 'receipts', 'r-1', 'x', now() - interval '5 minutes',
                       2, 'ConnectionError: broker <down>', now() + interval '1 day'),
                      ('shop.charge\x1fb', 'receipts', 'r-2', 'x', now(), 0, NULL,
                       now() + interval '1 day')"""
        )
        page = (await client.get(f"{status_server}/status")).text
    section = page[page.index("id='outbox'") :]
    assert "2 unsent" in page and "1 refused" in page
    assert "<td>receipts</td><td class='n'>2</td><td class='n'>30" in section  # 300-odd s
    assert "ConnectionError: broker &lt;down&gt;" in section  # escaped


async def test_the_status_page_shows_how_long_sent_outbox_rows_wait_for_clean_up(
    db: asyncpg.Connection, status_server: str
) -> None:
    """A sent row a day past its retention (no clean-up ran): the page says how long, and
    which command cleans it when the workers do not."""
    await db.execute(
        """INSERT INTO dedupe_outbox (producer, channel, message_id, body, sent_at, expires_at)
           VALUES ('shop.charge\x1fa', 'receipts', 'r-1', 'x', now() - interval '2 days',
                   now() - interval '1 day')"""
    )
    async with httpx.AsyncClient() as client:
        page = (await client.get(f"{status_server}/status")).text
    section = page[page.index("id='outbox-cleanup'") :]
    assert "have waited 86,4" in section and "dedupe-worker gc" in section
