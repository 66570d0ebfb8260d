"""The page in a real headless Chromium (the distribution's package, driven by its chromedriver)
against a real `clawbridge up` on loopback: the tiny model, a real store, the learning loop with
the rules judge, a key. The browser signs in, the page shows turns whose text is HTML and script
without running any of it, updates without a reload when a turn is judged and when a training
step publishes a version, pauses and resumes training, and rolls back through its control.

Skips, saying the one command that installs the browser, where Chromium is missing; CI
installs it (`.ci/run`)."""

from __future__ import annotations

import asyncio
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from clawbridge.backends.local import LocalBackend
from clawbridge.server import Running, serve, serving_extras
from helpers.learning import settings_for

INSTALL = "apt-get install -y chromium chromium-driver"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
DRIVER = shutil.which("chromedriver")
if not (CHROMIUM and DRIVER):
    pytest.skip(f"needs Chromium and its driver: {INSTALL}", allow_module_level=True)
webdriver = pytest.importorskip("selenium.webdriver", reason="needs selenium: pip install -e '.[dev]'")
from selenium.common.exceptions import NoAlertPresentException, StaleElementReferenceException  # noqa: E402
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402

KEY = "browser-test-key"
HOSTILE = [
    "<script>window.__pwned = 1</script>",
    '<img src=x onerror="window.__pwned = 2">',
    '"><svg onload="window.__pwned = 3"></svg>',
]
SESSION = '<img src=x onerror="window.__pwned = 4">'
CORRECTION = 'No, that is wrong. <b onmouseover="window.__pwned = 5">Answer in one short sentence</b><script>window.__pwned = 6</script>'


class Server:
    """`clawbridge up`'s composition (`serving_extras`: the learner, its routes and the page) on
    a free port, in a thread."""

    def __init__(self, settings: Any) -> None:
        self.settings = settings
        self.running: Running | None = None
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self._main, daemon=True)

    def _main(self) -> None:
        def started(r: Running) -> None:
            self.running = r
            self.ready.set()

        asyncio.run(serve(self.settings, backend=LocalBackend.from_settings(self.settings), quiet=True,
                          started=started, **serving_extras(self.settings)))

    def __enter__(self) -> Server:
        self.thread.start()
        assert self.ready.wait(240), "clawbridge did not start"
        return self

    def __exit__(self, *exc: object) -> None:
        if self.running is not None:
            self.running.server.should_exit = True
        self.thread.join(60)

    @property
    def url(self) -> str:
        assert self.running is not None
        return self.running.base_url

    def chat(self, session: str, messages: list[dict[str, Any]]) -> dict[str, Any]:
        r = httpx.post(f"{self.url}/v1/chat/completions", timeout=120,
                       headers={"Authorization": f"Bearer {KEY}", "X-Session-Id": session},
                       json={"model": "tiny-random", "max_tokens": 6, "messages": messages})
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["message"]

    def conversation(self, session: str, first: str, reply: str) -> None:
        """Two requests of one session: the second carries the user's reply to the first answer
        (its next state), which the rules judge reads."""
        msgs: list[dict[str, Any]] = [{"role": "user", "content": first}]
        answer = self.chat(session, msgs)
        self.chat(session, [*msgs, {"role": "assistant", "content": answer.get("content") or ""},
                            {"role": "user", "content": reply}])


def wait(what: str, done: Callable[[], Any], timeout: float = 90) -> Any:
    """`done()` until it is truthy. The page redraws its tables as it polls, so an element found a
    moment ago may be gone (stale): that is "not yet", not a failure."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            got = done()
        except StaleElementReferenceException:
            got = None
        if got:
            return got
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


@pytest.fixture
def browser() -> Iterator[Any]:
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1400,1000", "--no-first-run", "--disable-extensions"):
        opts.add_argument(arg)
    driver = webdriver.Chrome(options=opts, service=Service(DRIVER))
    driver.set_page_load_timeout(60)
    try:
        yield driver
    finally:
        driver.quit()


def text(driver: Any, css: str) -> str:
    return "\n".join(e.text for e in driver.find_elements(By.CSS_SELECTOR, css))


def row_element(driver: Any, asked: str) -> Any:
    """The turns table's row whose `asked` cell is `asked` (None while there is none)."""
    for row in driver.find_elements(By.CSS_SELECTOR, "#turns tr.turn"):
        cells = row.find_elements(By.TAG_NAME, "td")
        if len(cells) > 4 and cells[4].text == asked:  # when, user, conversation, version, asked
            return row
    return None


def row_asking(driver: Any, asked: str) -> str:
    row = row_element(driver, asked)
    return "" if row is None else str(row.text)


def accept_confirm(driver: Any) -> str:
    def alert() -> Any:
        try:
            return driver.switch_to.alert
        except NoAlertPresentException:
            return None

    box = wait("the confirmation", alert, 10)
    message = str(box.text)
    box.accept()
    return message


@pytest.mark.timeout(300)
def test_the_page_signs_in_shows_hostile_text_as_text_updates_live_and_rolls_back(tmp_path: Path, browser: Any) -> None:
    settings = settings_for(tmp_path / "data", batch_size=2, api_key=KEY, port=0, gate="off", default_max_tokens=6)
    with Server(settings) as server:
        assert server.running is not None
        # turns whose text is HTML and script, through the API (and a correction the rules
        # judge turns into a hint, HTML included)
        server.conversation(SESSION, HOSTILE[0] + HOSTILE[1], HOSTILE[2])
        server.conversation("hostile-hint", "What is 2+2?", CORRECTION)

        browser.get(f"{server.url}/ui")
        assert "sign in" in browser.title.lower()  # no session yet: the key, once
        browser.find_element(By.ID, "key").send_keys(KEY)
        browser.find_element(By.ID, "sign-in").click()
        wait("the dashboard", lambda: "is it getting better" in browser.title.lower())
        cookie = browser.get_cookie("clawbridge_ui")
        assert cookie is not None and cookie["httpOnly"] and cookie["sameSite"] == "Strict" and KEY not in cookie["value"]
        browser.execute_script("window.__sameDocument = true")  # gone if the page ever reloads

        # the hostile turns are shown, as text, and nothing in them ran
        wait("the hostile turns", lambda: HOSTILE[0] in text(browser, "#turns"))
        wait("the hint, judged", lambda: "Answer in one short sentence" in text(browser, "#turns"), 120)
        shown = text(browser, "#turns")
        assert HOSTILE[1] in shown and HOSTILE[2] in shown and "<script>window.__pwned = 6</script>" in shown
        assert not browser.find_elements(By.CSS_SELECTOR, "#turns img, #turns svg, #turns script, #turns b")
        assert browser.execute_script("return window.__pwned") is None

        # the conversation view of the session whose id is markup
        wait("the session's link", lambda: row_element(browser, HOSTILE[2]).find_element(
            By.CSS_SELECTOR, "a.session").click() or True)
        wait("the conversation", lambda: SESSION in text(browser, "#conv-id") or None)
        wait("its messages", lambda: HOSTILE[0] in text(browser, "#conv-turns"))
        assert browser.execute_script("return window.__pwned") is None
        browser.execute_script("window.location.hash = '#/'")

        # a new turn, judged while the page is open: its verdict appears without a reload
        server.conversation("thankful", "Tell me a fact.", "Thanks, that's perfect!")
        wait("the new verdict", lambda: "+1" in row_asking(browser, "Tell me a fact."), 120)
        # two judged samples fill a batch of 2: a training step publishes v1, shown live
        row = wait("v1 in the versions table",
                   lambda: browser.find_elements(By.CSS_SELECTOR, '#versions tr[data-version="1"]'), 180)
        assert "training step" in row[0].text
        assert browser.find_elements(By.CSS_SELECTOR, "#chart-reactions svg rect")  # the chart drew
        assert browser.execute_script("return window.__sameDocument") is True
        assert browser.execute_script("return window.__pwned") is None

        # paused from the page, a full batch waits; resumed, it trains and publishes v2
        browser.find_element(By.ID, "pause").click()
        wait("paused", lambda: browser.find_element(By.ID, "training").text == "paused")
        published = server.running.backend.version
        server.conversation("paused-1", "Name a colour.", "Thanks, great!")
        server.conversation("paused-2", "Name a fruit.", "Perfect, thank you!")
        wait("a full batch waiting", lambda: browser.find_element(By.ID, "waiting").text.endswith("2 to train"), 120)
        time.sleep(3)  # a step would have started at once
        assert server.running.backend.version == published
        browser.find_element(By.ID, "pause").click()
        wait("resumed", lambda: browser.find_element(By.ID, "training").text != "paused")
        wait(f"v{published + 1} after the resume",
             lambda: browser.find_elements(By.CSS_SELECTOR, f'#versions tr[data-version="{published + 1}"]'), 180)

        # roll back to v0 through the page's control, with its confirmation
        serving = server.running.backend.version
        wait("the rollback button", lambda: browser.find_element(
            By.CSS_SELECTOR, '#versions button.rollback[data-version="0"]').click() or True)
        assert "v0" in accept_confirm(browser)
        wait("the rollback's message", lambda: "now serves the weights of v0" in browser.find_element(By.ID, "message").text)
        assert server.running.backend.version == serving + 1
        new = wait("the restored version's row",
                   lambda: browser.find_elements(By.CSS_SELECTOR, f'#versions tr[data-version="{serving + 1}"]'))
        assert "a copy of v0" in new[0].text and "serving" in new[0].text
        assert browser.execute_script("return window.__pwned") is None

        # the correction was heard as a preference, shown as text: markup is never applied (no
        # Confirm), and Forget drops it, with its confirmation
        def preference() -> Any:
            return browser.find_element(By.CSS_SELECTOR, '#preferences li[data-preference="1"]')

        wait("the preference", lambda: "Answer in one short sentence" in preference().text)
        assert "never applied: it reads like code or markup" in preference().text
        assert not preference().find_elements(By.CSS_SELECTOR, "button.confirm, b, script")
        preference().find_element(By.CSS_SELECTOR, "button.forget").click()
        assert "#1" in accept_confirm(browser)
        wait("the preference dropped", lambda: "dropped" in preference().text)
        assert browser.execute_script("return window.__pwned") is None
