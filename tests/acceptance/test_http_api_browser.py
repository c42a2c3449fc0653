"""The order form of handlers/orders_api.py in a real headless Chromium: its hidden key field
(drawn when the page is rendered) makes a double click on "Buy" and a reload of the answer one
order, and every second submit shows the first one's page.

Chromium and chromedriver come from Debian (`make browser`, which `make test` runs). The API runs
in this process on a real uvicorn; the browser is driven from a thread, so the server's event
loop keeps serving while a WebDriver call waits.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any

import asyncpg
from prometheus_client import generate_latest
from selenium import webdriver
from selenium.common.exceptions import NoAlertPresentException
from selenium.webdriver.common.by import By
from selenium.webdriver.support import expected_conditions
from selenium.webdriver.support.ui import WebDriverWait
from starlette.middleware import Middleware

from dedupe.observability.metrics import Metrics
from handlers.orders_api import setup
from tests.apps.http_api import create_test_api
from tests.conftest import ROOT
from tests.integration.http_server import serving

SCREENSHOTS = ROOT / ".services" / "screenshots"
# The form's answer is held this long: the double click's second submit meets the first one
# still running (a real shop's payment call), waits for it and gets its page.
ANSWER_PAUSE_S = 0.8


class _SlowAnswer:
    """Holds the start of /orders/form's answer (inside the idempotency middleware)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] != "/orders/form":
            await self.app(scope, receive, send)
            return

        async def held(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                await asyncio.sleep(ANSWER_PAUSE_S)
            await send(message)

        await self.app(scope, receive, held)


def placed(browser: webdriver.Chrome) -> str:
    """The answer page's heading, once it is shown."""
    heading = WebDriverWait(browser, 20).until(
        expected_conditions.presence_of_element_located((By.ID, "placed"))
    )
    return str(heading.text)


def counted(metrics: Metrics, outcome: str) -> float:
    for family in metrics.registry.collect():
        for sample in family.samples:
            if sample.name == "dedupe_http_requests_total" and sample.labels == {
                "route": "/orders/form",
                "outcome": outcome,
            }:
                return float(sample.value)
    return 0.0


async def in_thread(fn: Callable[..., Any], *args: Any) -> Any:
    return await asyncio.wait_for(asyncio.to_thread(fn, *args), 60)


async def test_a_double_click_and_a_reload_of_the_order_form_make_one_order(
    db_url: str, db: asyncpg.Connection, browser: webdriver.Chrome
) -> None:
    """Double click on Buy: two POSTs, one order, the page of that order. Reload the answer
    (the browser posts the form again, same hidden key): the same page, still one order."""
    await setup(db_url)
    metrics = Metrics()
    api = create_test_api(db_url, wait_s=5, metrics=metrics)
    api.user_middleware.append(Middleware(_SlowAnswer))
    async with serving(api) as base:
        await in_thread(browser.get, f"{base}/order-form")
        key = await in_thread(
            lambda: browser.find_element(By.NAME, "idempotency_key").get_attribute("value")
        )
        buy = await in_thread(browser.find_element, By.ID, "buy")
        # A double click as an impatient user makes it: the second click a moment after the
        # first, while the first submit's answer is still coming (the page still shows).
        await in_thread(
            browser.execute_script,
            "const buy = arguments[0]; buy.click(); setTimeout(() => buy.click(), 150);",
            buy,
        )
        first_page = await in_thread(placed, browser)
        assert first_page == "Order 1 placed"
        assert counted(metrics, "new") == 1
        # The second click's submit reached the server and was answered from the first.
        assert counted(metrics, "replayed") + counted(metrics, "in_flight") >= 1, generate_latest(
            metrics.registry
        ).decode()
        before_reload = counted(metrics, "replayed")

        def reload() -> str:
            shown = browser.find_element(By.ID, "placed")
            browser.refresh()  # a POST result: the browser sends the form again
            with contextlib.suppress(NoAlertPresentException):
                browser.switch_to.alert.accept()  # "Confirm Form Resubmission", where asked
            WebDriverWait(browser, 20).until(expected_conditions.staleness_of(shown))
            return placed(browser)

        assert await in_thread(reload) == "Order 1 placed"
        assert counted(metrics, "replayed") == before_reload + 1
        SCREENSHOTS.mkdir(parents=True, exist_ok=True)
        await in_thread(browser.save_screenshot, str(SCREENSHOTS / "order-form-replayed.png"))
    rows = await db.fetch("SELECT id, sku, quantity, idempotency_key FROM orders")
    assert [tuple(r) for r in rows] == [(1, "espresso-machine", 1, key)]
