"""The web page of `strata serve` in a real headless browser: Debian's `chromium` driven by Selenium.

`make test` installs `chromium` and `chromium-driver` with apt-get when it can. Without them these tests
skip, saying why, except under CI=true, where a missing browser fails them. The page server has an API
key, so the page is seen asking for it; a second server, started with `--no-webui`, loads in the
background meanwhile. With WEBUI_SCREENSHOT=PATH the Stop test saves a screenshot of the page
mid-generation there (docs/webui.png is made so).
"""

from __future__ import annotations

import os
import re
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import httpx
import pytest

from serving import running_server

KEY = "sk-webui-test"
CTX = 2048
WAIT_S = 15.0


def _browser_or_reason() -> tuple[str, str] | str:
    """(chromium binary, chromedriver binary), or why there are none."""
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "selenium is not installed (pip install -e '.[test]')"
    chromium = next((p for p in map(shutil.which, ("chromium", "chromium-browser")) if p), None)
    driver = shutil.which("chromedriver") or next(
        (p for p in ("/usr/lib/chromium/chromedriver", "/usr/lib/chromium-browser/chromedriver") if os.path.exists(p)),
        None)
    if not chromium or not driver:
        return ("Debian's chromium and chromium-driver are not installed "
                "(make test installs them: apt-get install chromium chromium-driver)")
    return chromium, driver


@pytest.fixture(scope="module")
def browser_paths() -> tuple[str, str]:
    found = _browser_or_reason()
    if isinstance(found, str):
        if os.environ.get("CI", "").strip().lower() in ("1", "true", "yes"):
            pytest.fail(f"CI must run the web page test, but {found}")
        pytest.skip(found)
    return found


@pytest.fixture(scope="module")
def servers(browser_paths, tmp_path_factory):
    """(base URL of the page server, with an API key and 2 slots; a future of the base URL of a server
    started with --no-webui). The second starts once the first is up and loads while the browser works."""
    page = running_server(tmp_path_factory.mktemp("webui"), {"parallel": 2, "ctx": CTX, "api_key": KEY})
    bare = running_server(tmp_path_factory.mktemp("no_webui"), {"parallel": 1, "ctx": CTX}, ["--no-webui"])
    with ThreadPoolExecutor(1) as pool:
        with page as page_url:
            bare_url = pool.submit(bare.__enter__)
            stopping = None
            try:
                yield page_url, bare_url
            finally:
                if bare_url.exception() is None:  # a failed start has failed its test already
                    stopping = pool.submit(bare.__exit__, None, None, None)  # stops beside the page server
        if stopping is not None:
            stopping.result()


@pytest.fixture(scope="module")
def driver(browser_paths, servers):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    chromium, chromedriver = browser_paths
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    # --no-sandbox: CI runs as root, where chromium's sandbox refuses to start.
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu", "--no-first-run",
                "--disable-extensions", "--window-size=1280,900"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    d = webdriver.Chrome(service=Service(executable_path=chromedriver), options=options)
    d.set_script_timeout(10)
    yield d
    d.quit()


def wait_for(condition: Callable[[], Any], what: str, timeout: float = WAIT_S, every: float = 0.05) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(every)


def severe_logs(d) -> list[str]:
    """The browser console's SEVERE entries since the last call (reading drains them)."""
    return [e["message"] for e in d.get_log("browser") if e["level"] == "SEVERE"]


def js(d, script: str, *args: Any) -> Any:
    return d.execute_script(script, *args)


PAGE_STATE = """
const reply = [...document.querySelectorAll('.msg.assistant')].pop();
const slots = [...document.querySelectorAll('#slots [data-state]')].map(e => e.dataset.state);
return {
  text: reply ? reply.querySelector('.body').textContent : '',
  status: reply ? reply.dataset.status : null,
  replies: document.querySelectorAll('.msg.assistant').length,
  slots: slots,
  sendDisabled: document.getElementById('send').disabled,
  stopDisabled: document.getElementById('stop').disabled,
};
"""


def page_state(d) -> dict:
    return js(d, PAGE_STATE)


def all_idle(d) -> bool:
    slots = page_state(d)["slots"]
    return len(slots) == 2 and all(s == "idle" for s in slots)


def fill(d, name: str, value: str) -> None:
    from selenium.webdriver.common.by import By

    field = d.find_element(By.CSS_SELECTOR, f"#settings [name={name}]")
    field.clear()
    field.send_keys(value)


def send_message(d, text: str) -> None:
    from selenium.webdriver.common.by import By

    box = d.find_element(By.ID, "message")
    box.send_keys(text)
    d.find_element(By.ID, "send").click()


# ---- the tests run in file order on one page --------------------------------------------------------


def test_page_needs_no_key_itself_and_asks_for_the_api_key(servers, driver):
    from selenium.webdriver.common.by import By

    base, _ = servers
    page = httpx.get(base + "/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "Content-Security-Policy" in page.headers
    for path in ("static/app.js", "static/chat.js", "static/style.css", "static/favicon.svg"):
        assert httpx.get(f"{base}/{path}").status_code == 200, path
    assert httpx.get(base + "/v1/models").status_code == 401

    driver.get(base + "/")
    slots_need_key = httpx.get(base + "/strata/slots").status_code == 401  # as /metrics does

    def asked_for_key() -> bool:
        asked = "API key" in driver.find_element(By.ID, "status").text
        named = driver.find_element(By.ID, "model-name").text == "no model"
        dashboard = "API key" in driver.find_element(By.ID, "dash-note").text if slots_need_key else all_idle(driver)
        return asked and named and dashboard

    wait_for(asked_for_key, "the page to ask for the API key")
    # The only errors so far are the refused calls made before the key was typed.
    assert all("401" in m for m in severe_logs(driver))

    driver.find_element(By.ID, "api-key").send_keys(KEY)
    driver.find_element(By.ID, "save-key").click()
    wait_for(lambda: driver.find_element(By.ID, "model-name").text == "strata-default", "the model name")
    wait_for(lambda: all_idle(driver), "the dashboard to show 2 idle slots")
    assert driver.find_element(By.ID, "status").text == ""
    assert js(driver, "return localStorage.getItem('strata.apiKey')") == KEY
    assert severe_logs(driver) == []


def test_markdown_is_rendered_from_escaped_text(servers, driver):
    render = "return import('./static/markdown.js').then(m => m.renderMarkdown(arguments[0]));"
    html = js(driver, render, "Hi **you** and *me* `<b>x</b>`\n<script>alert(1)</script>\n\n"
                              "- one\n- two\n\n1. first\n2. second\n\n```py\nif a < b: pass\n```")
    assert html == ("<p>Hi <strong>you</strong> and <em>me</em> <code>&lt;b&gt;x&lt;/b&gt;</code><br>"
                    "&lt;script&gt;alert(1)&lt;/script&gt;</p>"
                    "<ul><li>one</li><li>two</li></ul><ol><li>first</li><li>second</li></ol>"
                    '<pre><code class="language-py">if a &lt; b: pass</code></pre>')
    # A reply still streaming may hold an unclosed fence: the rest of the text is code.
    assert js(driver, render, "a\n```\nx = 1") == "<p>a</p><pre><code>x = 1</code></pre>"
    assert severe_logs(driver) == []


def test_chat_streams_the_reply_and_the_dashboard_follows(servers, driver):
    fill(driver, "temperature", "0.8")
    fill(driver, "seed", "3")
    fill(driver, "max_tokens", "600")  # long enough for the dashboard's 500 ms refresh to see it
    send_message(driver, "Tell me about the sea.")
    texts, slot_states = [], set()
    deadline = time.monotonic() + WAIT_S
    while True:
        state = page_state(driver)
        texts.append(state["text"])
        slot_states.update(state["slots"])
        if state["status"] not in ("streaming", None):
            break
        assert time.monotonic() < deadline, "the reply did not finish"
        time.sleep(0.03)
    assert state["status"] == "done", state
    # Markdown may hide a marker once its pair arrives, so the rendered length need not only grow.
    lengths = [len(t) for t in texts]
    assert lengths[-1] > 0 and len(set(lengths)) >= 4, f"the text did not arrive piece by piece: {lengths}"
    assert slot_states - {"idle"}, "the dashboard never showed the busy slot"
    meta = driver.find_element("css selector", ".msg.assistant .meta").text
    assert re.match(r"\d+ tokens · [\d.]+ tok/s · first token [\d.]+ s · ", meta), meta
    final = texts[-1]
    time.sleep(0.3)
    assert page_state(driver)["text"] == final  # nothing more arrives after the end
    wait_for(lambda: all_idle(driver), "every slot to be idle again")
    state = page_state(driver)
    assert not state["sendDisabled"] and state["stopDisabled"]
    assert severe_logs(driver) == []


def test_stop_ends_a_long_generation_and_frees_the_slot(servers, driver):
    base, _ = servers
    fill(driver, "max_tokens", str(CTX - 800))  # room for the first exchange (600 tokens at most), sent again
    fill(driver, "seed", "")
    # The reply is sampled with a fresh seed: now and then the small model ends it (EOS) before the
    # click lands (more often on a loaded machine). Such a reply shows "done", not "stopped"; then ask
    # again, at most four more times.
    for retries in range(5):
        send_message(driver, "Tell me a long story.")
        wait_for(lambda: len(page_state(driver)["text"]) > 20 or page_state(driver)["status"] == "done",
                 "the long reply to start")
        wait_for(lambda: "decoding" in page_state(driver)["slots"] or page_state(driver)["status"] == "done",
                 "the dashboard to show a decoding slot")
        if os.environ.get("WEBUI_SCREENSHOT"):
            generated = "return document.querySelector('#slots [data-state=decoding] [data-figure=gen] .figure-value')" \
                        "?.textContent.split('/')[0] ?? '0';"
            wait_for(lambda: int(js(driver, generated)) >= 40, "the dashboard to count 40 tokens")
            js(driver, "document.querySelector('.side').scrollTop = 0; document.activeElement.blur();")
            driver.save_screenshot(os.environ["WEBUI_SCREENSHOT"])
        driver.find_element("id", "stop").click()
        wait_for(lambda: page_state(driver)["status"] in ("stopped", "done"), "the reply to end")
        if page_state(driver)["status"] == "stopped":
            break
        wait_for(lambda: all_idle(driver), "every slot to be idle again")
        driver.find_element("id", "new-chat").click()  # the next try's history fits max_tokens as the first's
    assert page_state(driver)["status"] == "stopped", "five sampled replies ended before the stop"
    stopped_at = page_state(driver)["text"]
    wait_for(lambda: all_idle(driver), "the server to free the slot")
    generated = []
    for _ in range(2):
        doc = httpx.get(base + "/strata/slots", headers={"Authorization": f"Bearer {KEY}"}).json()
        assert all(s["state"] == "idle" for s in doc["slots"]) and doc["totals"]["queue"] == 0
        generated.append(doc["totals"]["generation_tokens"])
        time.sleep(0.3)
    assert generated[0] == generated[1], "the stopped request is still generating"
    state = page_state(driver)
    assert state["text"] == stopped_at and not state["sendDisabled"] and state["stopDisabled"]
    assert state["replies"] == (2 if retries == 0 else 1)  # the first exchange and this reply, or a new chat's
    driver.find_element("id", "new-chat").click()
    assert page_state(driver)["replies"] == 0
    assert severe_logs(driver) == []


def test_no_webui_serves_no_page(servers):
    bare = servers[1].result()
    assert httpx.get(bare + "/").status_code == 404
    assert httpx.get(bare + "/static/app.js").status_code == 404
    assert httpx.get(bare + "/health").status_code == 200
