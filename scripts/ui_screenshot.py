"""Regenerate the page's screenshot in the docs (docs/ui.md) from a data directory, by default
the one `make demo` leaves: the page is served over the store alone (no model), opened in
headless Chromium (the distribution's `chromium` and `chromium-driver`), and captured whole.

    make demo                                   # or any data directory with a run in it
    .venv/bin/python scripts/ui_screenshot.py [--data-dir .clawbridge-demo] [--out docs/ui.png]
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import sys
import threading
import time
from pathlib import Path

import uvicorn
from clawbridge.config import Settings
from clawbridge.ui.live import data_dir_app

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data-dir", type=Path, default=ROOT / ".clawbridge-demo")
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "ui.png")
    ap.add_argument("--width", type=int, default=1400)
    ap.add_argument("--max-height", type=int, default=2400, help="cut the page below this many pixels")
    args = ap.parse_args()
    if not (args.data_dir / "clawbridge.db").exists():
        sys.exit(f"no store in {args.data_dir}: run `make demo` first, or pass --data-dir")
    chromium, driver_path = shutil.which("chromium") or shutil.which("chromium-browser"), shutil.which("chromedriver")
    if not (chromium and driver_path):
        sys.exit("needs Chromium and its driver: apt-get install -y chromium chromium-driver")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    # a stored key would ask for a sign-in: the screenshot reads the data directory as its owner
    app, store = data_dir_app(Settings(data_dir=args.data_dir, api_key=None))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=lambda: asyncio.run(server.serve()), daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    port = server.servers[0].sockets[0].getsockname()[1]

    opts = webdriver.ChromeOptions()
    opts.binary_location = chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                f"--window-size={args.width},1000", "--hide-scrollbars", "--force-device-scale-factor=1"):
        opts.add_argument(arg)
    driver = webdriver.Chrome(options=opts, service=Service(driver_path))
    try:
        driver.get(f"http://127.0.0.1:{port}/ui")
        deadline = time.monotonic() + 30
        while not driver.execute_script("return document.body.dataset.token && "
                                        "document.querySelectorAll('#turns tbody tr').length > 0"):
            if time.monotonic() > deadline:
                sys.exit("the page did not load its data within 30 s")
            time.sleep(0.2)
        time.sleep(0.5)  # the charts draw in the same pass; let layout settle
        height = int(driver.execute_script("return document.documentElement.scrollHeight"))
        shown = min(height + 20, args.max_height)
        driver.set_window_size(args.width, shown)
        time.sleep(0.3)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        driver.save_screenshot(str(args.out))
        print(f"wrote {args.out} ({args.width} x {shown})")
    finally:
        driver.quit()
        server.should_exit = True
        thread.join(10)
        store.close()


if __name__ == "__main__":
    main()
