"""The README's picture of the report page: `make demo`'s page as headless Chromium draws it.

    .venv/bin/python bench/report_screenshot.py [out/demo/report/report.html] [docs/report.png]

Needs Debian's `chromium` (and playwright, a dev dependency). The PNG is reduced to 256 colours so
that it stays under 300 KB.
"""

import shutil
import sys
from pathlib import Path

from PIL import Image
from playwright.sync_api import sync_playwright


def main(page_path: Path, out: Path) -> None:
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=shutil.which("chromium"), args=["--no-sandbox", "--disable-gpu"])
        page = browser.new_page(viewport={"width": 1300, "height": 900})
        page.goto(page_path.resolve().as_uri())
        page.wait_for_selector("body[data-rendered=yes]", timeout=60_000)
        page.screenshot(path=str(out), full_page=True)
        browser.close()
    Image.open(out).convert("RGB").quantize(256).save(out, optimize=True)
    print(f"{out}: {out.stat().st_size / 1e3:.0f} KB")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path("out/demo/report/report.html"),
         Path(sys.argv[2]) if len(sys.argv) > 2 else Path("docs/report.png"))
