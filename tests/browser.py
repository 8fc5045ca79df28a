"""Opening a report page in headless Chromium (Debian's `chromium`; `.ci/run` installs it when it
is missing), driven by playwright: what the console said, whether the figures were drawn, how
many of each element there are, and a screenshot."""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest


def chromium() -> str:
    """The browser's path; without one, the test is skipped, or fails under CI (.ci/run sets
    HETPLAN_REQUIRE_BROWSER after installing it)."""
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        why = "no Chromium on this machine (apt-get install chromium; .ci/run installs it)"
        if os.environ.get("HETPLAN_REQUIRE_BROWSER"):
            pytest.fail(why)
        pytest.skip(why)
    return path


@dataclass(frozen=True)
class Rendered:
    errors: list[str]  # console errors and warnings, and uncaught exceptions
    counts: dict[str, int]  # CSS selector -> how many elements match once the figures are drawn
    screenshot: Path


def render(page_path: Path, screenshot: Path, selectors: tuple[str, ...]) -> Rendered:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium(),
                                    args=["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"])
        try:
            page = browser.new_page(viewport={"width": 1300, "height": 900})
            errors: list[str] = []
            page.on("console", lambda m: errors.append(f"{m.type}: {m.text}") if m.type in ("error", "warning")
                    else None)
            page.on("pageerror", lambda e: errors.append(f"uncaught: {e}"))
            page.route("**/*", lambda route: route.abort() if not route.request.url.startswith("file:")
                       else route.continue_())  # the page must need no network
            page.goto(page_path.resolve().as_uri())
            page.wait_for_selector("body[data-rendered]", timeout=60_000)
            if page.get_attribute("body", "data-rendered") != "yes":
                errors.append("not drawn: " + page.inner_text("#status"))
            counts = {s: page.locator(s).count() for s in selectors}
            page.screenshot(path=str(screenshot), full_page=True)
        finally:
            browser.close()
    return Rendered(errors, counts, screenshot)
