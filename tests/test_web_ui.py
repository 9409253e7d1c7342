"""The chat page at `/`: its files and headers, CORS, the flags, and the page itself in a real
headless browser (Debian's chromium driven by selenium through the system chromedriver; no
browser is downloaded).

The browser tests run against live servers in this process: the real engine on the tiny model
(`tiny_chat_model_dir`) for streaming, stats and Stop (pages back to 0), and the FakeEngine of
test_server for what needs a scripted reply (markdown, `<script>` shown as text), a full queue
(429), an API key, or a server that went away. A screenshot of the page after a short conversation
is saved under the pytest tmp dir (its path is printed).
"""
from __future__ import annotations

import asyncio
import base64
import importlib.util
import json
import os
import re
import shutil
import struct
import sys
import threading
import zlib
from pathlib import Path

import pytest
import requests
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from jaxserve.commands import cli
from serve import web_ui
from serve.app import STATE, ServerConfig
from tests import test_server
from tests.test_server import MODEL, FakeEngine, LiveServer, byte_tokenizer, read_events, wait_until

pytestmark = pytest.mark.slow  # a browser against a server: out of `make test-quick`

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = "/usr/bin/chromedriver"
HAVE_BROWSER = (CHROMIUM is not None and os.path.exists(CHROMEDRIVER)
                and importlib.util.find_spec("selenium") is not None)
NO_BROWSER = ("needs Debian's chromium and chromium-driver and the selenium package (apt-get install chromium "
              "chromium-driver; pip install -e '.[test]'; `make install-test` does both)")
needs_browser = pytest.mark.skipif(not HAVE_BROWSER, reason=NO_BROWSER)
STATIC = Path(web_ui.__file__).parent / "static"


@pytest.fixture
def make_server():
    servers = []

    def make(config: ServerConfig | None = None, **engine_kwargs) -> LiveServer:
        server = LiveServer(FakeEngine(**engine_kwargs), config or ServerConfig(drain_timeout_s=1.0))
        servers.append(server)
        return server

    yield make
    for server in servers:
        server.close()


def url(server: LiveServer, path: str = "/") -> str:
    return f"http://127.0.0.1:{server.port}{path}"


# ---- the files and their headers -------------------------------------------------------------

def test_page_and_assets_are_served_with_types_no_cache_and_a_strict_csp(make_server):
    server = make_server(ServerConfig(api_key="sesame"))
    expected = {"/": "text/html", "/static/app.js": "text/javascript", "/static/markdown.js": "text/javascript",
                "/static/style.css": "text/css", "/static/favicon.svg": "image/svg+xml"}
    for path, content_type in expected.items():
        r = requests.get(url(server, path), timeout=10)  # no API key: the page holds no data
        assert r.status_code == 200, path
        assert r.headers["Content-Type"].split(";")[0] == content_type
        assert r.headers["Cache-Control"] == "no-cache"
        assert r.headers["X-Content-Type-Options"] == "nosniff"
        csp = r.headers["Content-Security-Policy"]
        assert "default-src 'self'" in csp and "script-src 'self'" in csp and "unsafe" not in csp
        assert "img-src 'self' data:;" in csp  # the attached images, shown inline; nothing remote
        assert "Access-Control-Allow-Origin" not in r.headers
        again = requests.get(url(server, path), headers={"If-None-Match": r.headers["ETag"]}, timeout=10)
        assert again.status_code == 304 and again.content == b""
    assert requests.head(url(server), timeout=10).status_code == 200
    assert requests.get(url(server, "/v1/models"), timeout=10).status_code == 401  # the API stays locked
    assert requests.get(url(server, "/static/nope.js"), timeout=10).status_code == 401  # not a page file


def test_the_page_has_no_inline_script_or_style_no_remote_resources_and_never_writes_html():
    html = (STATIC / "index.html").read_text()
    for tag in re.findall(r"<script\b[^>]*>(.*?)</script>", html, re.S):
        assert tag.strip() == "", "inline script"
    assert all('src="/static/' in tag for tag in re.findall(r"<script\b[^>]*>", html))
    assert not re.search(r"\sstyle=|<style\b|\son[a-z]+=", html)
    for name in ("index.html", "app.js", "markdown.js", "style.css"):
        text = (STATIC / name).read_text()
        assert not re.search(r"https?://|//cdn|@import", text), name  # works offline: nothing fetched elsewhere
    for name in ("app.js", "markdown.js"):
        text = (STATIC / name).read_text()
        assert not re.search(r"innerHTML|outerHTML|insertAdjacentHTML|document\.write|\beval\(|new Function", text)
    assert not re.search(r"localStorage|sessionStorage|document\.cookie", (STATIC / "app.js").read_text())
    assert set(web_ui.STATIC_FILES) == {p.name for p in STATIC.iterdir()}


def test_no_web_ui_makes_slash_a_404_json(make_server):
    server = make_server(ServerConfig(web_ui=False))
    for path in ("/", "/static/app.js"):
        status, headers, body = server.request("GET", path)
        assert status == 404 and body["error"]["code"] == "not_found", path
    assert server.request("GET", "/v1/models")[0] == 200


# ---- CORS --------------------------------------------------------------------------------------

def test_cors_only_for_allowed_origins_and_preflight_before_the_api_key(make_server):
    origin = "http://ui.example:3000"
    server = make_server(ServerConfig(api_key="sesame", allowed_origins=(origin + "/",)))
    preflight = {"Origin": origin, "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization, content-type"}
    status, headers, _ = server.request("OPTIONS", "/v1/chat/completions", headers=preflight)
    assert status == 204
    assert headers["Access-Control-Allow-Origin"] == origin
    assert "POST" in headers["Access-Control-Allow-Methods"]
    assert headers["Access-Control-Allow-Headers"] == "authorization, content-type"
    assert "Origin" in headers["Vary"] and "Access-Control-Allow-Credentials" not in headers

    status, headers, body = server.request("OPTIONS", "/v1/chat/completions",
                                           headers={**preflight, "Origin": "http://evil.example"})
    assert status == 403 and body["error"]["code"] == "origin_not_allowed"
    assert "Access-Control-Allow-Origin" not in headers
    status, headers, body = server.request("OPTIONS", "/v1/no/such/route", headers=preflight)
    assert status == 401 and "error" in body  # no such route: no 204, only what any call without the key gets

    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    status, headers, _ = server.request("POST", "/v1/chat/completions", chat,
                                        headers={"Origin": origin, "Authorization": "Bearer sesame"})
    assert status == 200 and headers["Access-Control-Allow-Origin"] == origin and "Origin" in headers["Vary"]
    with requests.post(url(server, "/v1/chat/completions"), json={**chat, "stream": True}, stream=True, timeout=10,
                       headers={"Origin": origin, "Authorization": "Bearer sesame"}) as r:
        assert r.headers["Access-Control-Allow-Origin"] == origin and r.text.endswith("data: [DONE]\n\n")
    status, headers, _ = server.request("POST", "/v1/chat/completions", chat, headers={"Origin": origin})
    assert status == 401 and headers["Access-Control-Allow-Origin"] == origin  # the page can read the error
    status, headers, _ = server.request("GET", "/v1/models",
                                        headers={"Origin": "http://evil.example", "Authorization": "Bearer sesame"})
    assert status == 200 and "Access-Control-Allow-Origin" not in headers
    assert "Access-Control-Allow-Origin" not in server.request("GET", "/", headers={"Origin": origin})[1]


def test_without_allowed_origins_there_are_no_cors_headers(make_server):
    server = make_server()
    origin = {"Origin": "http://ui.example"}
    status, headers, _ = server.request("OPTIONS", "/v1/chat/completions",
                                        headers={**origin, "Access-Control-Request-Method": "POST"})
    assert status == 405 and not any(h.startswith("Access-Control") for h in headers)
    status, headers, _ = server.request("GET", "/v1/models", headers=origin)
    assert status == 200 and not any(h.startswith("Access-Control") for h in headers)


def test_allowed_origins_are_checked():
    assert web_ui.parse_allowed_origins(["HTTP://Localhost:3000/", " https://a.example ", "", "*"]) == \
        ("http://localhost:3000", "https://a.example", "*")
    for bad in ("localhost:3000", "http://a.example/path", "ftp://a.example", "http://", "http://a:b"):
        with pytest.raises(ValueError, match="not an origin"):
            web_ui.parse_allowed_origins([bad])


# ---- flags -------------------------------------------------------------------------------------

def test_serve_flags_no_web_ui_and_allowed_origins(monkeypatch, capsys):
    import serve.server
    configs = []

    async def fake_serve(app, host, port, **kwargs):
        configs.append(app[STATE].config)

    monkeypatch.setitem(sys.modules, "jaxserve.async_engine", test_server._fake_engine_module([]))
    monkeypatch.setattr(serve.server, "serve_until_stopped", fake_serve)
    fake = [f"--model={MODEL}", "--generation_config=none"]  # the fake model has no directory to read
    assert cli.main(["jaxserve", "serve", *fake]) == 0
    assert cli.main(["jaxserve", "serve", *fake, "--no_web_ui",
                     "--allowed_origins=http://localhost:3000,https://ui.example"]) == 0
    assert [(c.web_ui, c.allowed_origins) for c in configs] == [
        (True, ()), (False, ("http://localhost:3000", "https://ui.example"))]
    assert cli.main(["jaxserve", "serve", f"--model={MODEL}", "--allowed_origins=localhost:3000"]) == 2
    assert "not an origin: 'localhost:3000'" in capsys.readouterr().err


# ---- the page in a browser ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def browser():
    if not HAVE_BROWSER:
        pytest.skip(NO_BROWSER)
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu", "--no-first-run",
                "--disable-extensions", "--window-size=1280,800", "--force-color-profile=srgb",
                "--force-device-scale-factor=1"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(options=options, service=Service(CHROMEDRIVER))
    driver.set_script_timeout(20)
    yield driver
    driver.quit()


class Page:
    """The chat page open in the browser, with the few actions a person takes."""

    def __init__(self, driver, server: LiveServer, *, wait_ready: bool = True) -> None:
        self.driver = driver
        driver.get_log("browser")  # drop what earlier tests logged
        driver.get(url(server))
        if wait_ready:
            self.wait(lambda: self.status_state() != "unknown")

    def wait(self, condition, timeout: float = 20.0):
        from selenium.webdriver.support.ui import WebDriverWait
        return WebDriverWait(self.driver, timeout, poll_frequency=0.02).until(lambda _: condition())

    def find(self, css: str):
        return self.driver.find_element("css selector", css)

    def find_all(self, css: str):
        return self.driver.find_elements("css selector", css)

    def status_state(self) -> str:
        return self.find("#server-status").get_attribute("data-state")

    def set_field(self, element_id: str, value) -> None:
        field = self.find("#" + element_id)
        field.clear()
        field.send_keys(str(value))

    def send(self, text: str) -> None:
        from selenium.webdriver.common.keys import Keys
        self.find("#input").send_keys(text, Keys.ENTER)

    def answers(self):
        return self.find_all(".message.assistant")

    def wait_finished(self, count: int, timeout: float = 30.0):
        """The `count`-th answer once it has ended (data-finish set)."""
        self.wait(lambda: len(self.answers()) >= count and self.answers()[count - 1].get_attribute("data-finish"),
                  timeout)
        return self.answers()[count - 1]

    def console_errors(self) -> list[str]:
        return [e["message"] for e in self.driver.get_log("browser") if e["level"] == "SEVERE"]


def record_renders(page: Page) -> None:
    """Records the text of the last answer's body at each change, to see tokens stream in."""
    page.driver.execute_script("""
        window.__seen = [];
        new MutationObserver(() => {
          const bodies = document.querySelectorAll('.message.assistant .body');
          if (bodies.length) window.__seen.push(bodies[bodies.length - 1].textContent);
        }).observe(document.getElementById('messages'), {childList: true, subtree: true, characterData: true});
    """)


@pytest.fixture(scope="module")
def tiny_server(tiny_chat_model_dir):
    """The real engine on the tiny random model behind the app, in this process."""
    from jaxserve.async_engine import build_async_engine

    engine = build_async_engine(tiny_chat_model_dir, max_num_seqs=4, max_num_batched_tokens=128, page_size=8,
                                num_pages=160)
    server = LiveServer(engine, ServerConfig(drain_timeout_s=1.0))
    yield server
    server.close()


def metric(server: LiveServer, name: str, labels: dict | None = None) -> float:
    text = requests.get(url(server, "/metrics"), timeout=10).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and (labels is None or labels.items() <= sample.labels.items()):  # + model_name
                return sample.value
    return 0.0


@needs_browser
def test_a_conversation_on_the_tiny_model_streams_and_shows_stats(browser, tiny_server, tmp_path, capsys):
    page = Page(browser, tiny_server)
    assert page.status_state() == "ok"
    assert page.find("#model-name").text == "model"  # the converted dir's short name
    assert page.find("#model-ctx").text == f"{tiny_server.engine.max_model_len} tokens"
    assert page.find("#api-key-box").is_displayed() is False
    page.set_field("max-tokens", 24)
    page.set_field("seed", 5)
    page.set_field("system-prompt", "You are terse.")
    record_renders(page)
    page.send("Hello there!")
    answer = page.wait_finished(1)
    assert answer.get_attribute("data-finish") == "length"
    text = answer.find_element("css selector", ".body").text
    seen = [s for s in browser.execute_script("return window.__seen") if s]
    assert text and len(set(seen)) >= 2, seen  # the answer grew token by token
    stats = answer.find_element("css selector", ".stats").text
    assert re.search(r"TTFT \d+ ms", stats) and re.search(r"[\d.]+ tokens/s", stats), stats
    match = re.search(r"(\d+) prompt \+ 24 completion tokens", stats)
    assert match, stats
    prompt_tokens = int(match.group(1))

    page.set_field("max-tokens", 8)
    page.send("And again?")
    second = page.wait_finished(2)
    match = re.search(r"(\d+) prompt \+ 8 completion tokens", second.find_element("css selector", ".stats").text)
    assert match and int(match.group(1)) > prompt_tokens + 24  # the history went along
    assert [m.find_element("css selector", ".body").text for m in page.find_all(".message.user")] == \
        ["Hello there!", "And again?"]
    assert page.console_errors() == []
    assert metric(tiny_server, "jaxserve_kv_pages_used") == 0

    shot = tmp_path / "web_ui.png"
    browser.save_screenshot(str(shot))
    assert shot.stat().st_size > 10_000
    with capsys.disabled():
        print(f"\nweb UI screenshot: {shot}")


@needs_browser
def test_stop_aborts_a_long_answer_and_the_pages_come_back(browser, tiny_server):
    page = Page(browser, tiny_server)
    aborted = metric(tiny_server, "jaxserve_requests_finished_total", {"finish_reason": "abort"})
    prompt_room = tiny_server.engine.max_model_len - 64
    page.set_field("max-tokens", prompt_room)  # a random model rarely emits EOS: this runs long
    page.send("Tell me a long story.")
    page.wait(lambda: page.find(".message.assistant .body").text.strip())
    assert metric(tiny_server, "jaxserve_kv_pages_used") > 0
    page.find("#stop").click()
    answer = page.wait_finished(1)
    assert answer.get_attribute("data-finish") == "stopped"
    stats = answer.find_element("css selector", ".stats").text
    tokens = int(re.search(r"~(\d+) tokens", stats).group(1))
    assert 0 < tokens < prompt_room and "stopped" in stats
    assert wait_until(lambda: metric(tiny_server, "jaxserve_kv_pages_used") == 0, 10)
    # (the handler counts the abort after the engine has freed the pages: wait for it as for them)
    assert wait_until(lambda: metric(tiny_server, "jaxserve_requests_finished_total",
                                     {"finish_reason": "abort"}) == aborted + 1, 10)
    assert page.find("#send").is_displayed() and not page.find("#stop").is_displayed()
    assert page.status_state() == "ok"


SCRIPTED_REPLY = ("Here is **bold** and *italic* and `<b>code</b>`:\n\n"
                  "<script>alert(1)</script>\n"
                  "<img src=x onerror=alert(2)>\n\n"
                  "- first item\n- second item\n\n"
                  "1. one\n2. two\n\n"
                  "```python\nprint('<script>alert(3)</script>')\n```\n"
                  "Done.")


@needs_browser
def test_model_output_is_rendered_as_text_never_as_html(browser, make_server, monkeypatch):
    script_ids = byte_tokenizer().encode(SCRIPTED_REPLY, add_special_tokens=False)
    monkeypatch.setattr(test_server, "fake_token_ids", lambda prompt_ids, count, seed: script_ids[:count])
    server = make_server(max_model_len=1024)
    page = Page(browser, server)
    page.send("<script>alert('user')</script> show me markdown")
    answer = page.wait_finished(1)
    body = answer.find_element("css selector", ".body")
    assert browser.execute_script("return document.querySelectorAll('script').length") == 2  # the page's own
    assert browser.execute_script("return document.querySelectorAll('.message img, .message [onerror]').length") \
        == 0
    text = body.get_attribute("textContent")
    assert "<script>alert(1)</script>" in text and "<img src=x onerror=alert(2)>" in text
    assert [e.text for e in body.find_elements("css selector", "strong")] == ["bold"]
    assert [e.text for e in body.find_elements("css selector", "em")] == ["italic"]
    assert [e.text for e in body.find_elements("css selector", "p > code")] == ["<b>code</b>"]
    assert [e.text for e in body.find_elements("css selector", "ul > li")] == ["first item", "second item"]
    assert [e.text for e in body.find_elements("css selector", "ol > li")] == ["one", "two"]
    assert body.find_element("css selector", ".code-lang").text == "python"
    assert body.find_element("css selector", "pre code").get_attribute("textContent") == \
        "print('<script>alert(3)</script>')"
    user = page.find(".message.user .body")
    assert user.text == "<script>alert('user')</script> show me markdown"
    from selenium.common.exceptions import NoAlertPresentException
    with pytest.raises(NoAlertPresentException):
        browser.switch_to.alert.text
    assert not [m for m in page.console_errors() if "Content Security Policy" in m]
    assert f"{len(script_ids)} completion tokens" in answer.find_element("css selector", ".stats").text


@needs_browser
def test_a_full_queue_shows_the_429_message(browser, make_server):
    server = make_server(ServerConfig(retry_after_s=2), max_running=1, max_waiting=0, token_delay_s=0.02)
    page = Page(browser, server)
    page.set_field("max-tokens", 5)
    conn, response = server.open_stream("/v1/completions", {"prompt": "x", "max_tokens": 200, "stream": True})
    try:
        assert read_events(response, limit=1)
        page.send("hello")
        answer = page.wait_finished(1)
        error = answer.find_element("css selector", ".error").text
        assert "429" in error and "the server is at capacity" in error and "retry after 2 s" in error, error
        assert answer.get_attribute("data-finish") == "error"
        assert page.find("#input").get_attribute("value") == "hello"  # back in the box, to send again
    finally:
        response.close()
        conn.close()
    assert wait_until(lambda: server.engine.num_running == 0)
    page.find("#send").click()
    assert page.wait_finished(2).get_attribute("data-finish") == "length"


@needs_browser
def test_with_an_api_key_the_page_opens_and_sends_the_key_it_is_given(browser, make_server):
    server = make_server(ServerConfig(api_key="sesame"))
    page = Page(browser, server)
    assert page.status_state() == "locked"
    assert page.find("#api-key-box").is_displayed()
    page.set_field("max-tokens", 3)
    page.send("hi")
    error = page.wait_finished(1).find_element("css selector", ".error").text
    assert "401" in error and "API key" in error
    assert server.engine.prompts == []
    page.set_field("api-key", "sesame")
    page.find("#system-prompt").click()  # leaving the field reloads /v1/models with the key
    page.wait(lambda: page.status_state() == "ok")
    assert page.find("#model-name").text == MODEL
    page.find("#send").click()  # the refused message is back in the box
    assert page.wait_finished(2).get_attribute("data-finish") == "length"
    assert len(server.engine.prompts) == 1 and server.engine.params[0].max_tokens == 3
    stored = browser.execute_script(
        "return document.cookie + JSON.stringify(localStorage) + JSON.stringify(sessionStorage)")
    assert "sesame" not in stored


@needs_browser
def test_the_sampling_controls_reach_the_engine(browser, make_server):
    server = make_server()
    page = Page(browser, server)
    for field, value in (("temperature", 0.3), ("top-p", 0.5), ("max-tokens", 7), ("seed", 42),
                         ("system-prompt", "Answer in French.")):
        page.set_field(field, value)
    page.send("hi")
    page.wait_finished(1)
    params = server.engine.params[0]
    assert (params.temperature, params.top_p, params.max_tokens, params.seed) == (
        pytest.approx(0.3), pytest.approx(0.5), 7, 42)
    assert "Answer in French." in byte_tokenizer().decode(server.engine.prompts[0])


@needs_browser
def test_empty_sampling_fields_show_the_servers_defaults_and_send_nothing(browser, make_server):
    server = make_server(ServerConfig(sampling_defaults={"temperature": 0.2, "top_p": 0.9}))
    page = Page(browser, server)
    page.wait(lambda: page.status_state() == "ok")
    assert [page.find(f"#{name}").get_attribute(a) for name in ("temperature", "top-p") for a in ("value", "placeholder")
            ] == ["", "0.2", "", "0.9"]
    page.set_field("max-tokens", 2)
    page.send("hi")
    page.wait_finished(1)
    params = server.engine.params[0]
    assert (params.temperature, params.top_p) == (pytest.approx(0.2), pytest.approx(0.9))  # the server's
    other = Page(browser, make_server())  # no server defaults: OpenAI's
    other.wait(lambda: other.status_state() == "ok")
    assert [other.find(f"#{n}").get_attribute("placeholder") for n in ("temperature", "top-p")] == ["1", "1"]


@needs_browser
def test_a_server_that_went_away_is_reported(browser, make_server):
    server = make_server()
    page = Page(browser, server)
    server.stop()
    page.send("anyone there?")
    error = page.wait_finished(1).find_element("css selector", ".error").text
    assert "cannot reach the server" in error
    assert page.status_state() == "down"


@needs_browser
def test_cross_origin_calls_from_a_browser_need_allowed_origins(browser, make_server):
    other = make_server()  # serves the calling page's origin
    origin = f"http://127.0.0.1:{other.port}"
    allowed = make_server(ServerConfig(api_key="sesame", allowed_origins=(origin,)))
    closed = make_server(ServerConfig(api_key="sesame"))
    browser.get(url(other, "/health"))
    fetch = """
        const [target, done] = arguments;
        fetch(target + '/v1/chat/completions', {method: 'POST', headers: {'Content-Type': 'application/json',
              'Authorization': 'Bearer sesame'}, body: JSON.stringify({messages: [{role: 'user', content: 'x'}],
              max_tokens: 2})})
          .then(r => r.json().then(b => done(['ok', r.status, b.choices[0].message.content])))
          .catch(e => done(['failed', String(e)]));
    """
    result = browser.execute_async_script(fetch, url(allowed, ""))
    assert result[:2] == ["ok", 200] and len(result[2]) == 2
    result = browser.execute_async_script(fetch, url(closed, ""))
    assert result[0] == "failed" and closed.engine.prompts == []


@needs_browser
def test_a_lora_adapter_is_picked_from_the_models_list(browser, make_server):
    """With LoRA adapters served, the page lists them beside the base model; the one picked is the
    `model` of the next message (the engine gets its adapter), and the base model again after."""
    from selenium.webdriver.support.ui import Select

    from jaxserve.setting_checks import LoRAModule
    server = make_server()
    single = Page(browser, server)
    single.wait(lambda: single.status_state() == "ok")
    assert not single.find("#model-select").is_displayed() and single.find("#model-name").is_displayed()
    server.engine.lora_modules = lambda: [LoRAModule("sql", "/adapters/sql")]
    page = Page(browser, server)
    page.wait(lambda: page.status_state() == "ok")
    select = Select(page.find("#model-select"))
    assert [o.text for o in select.options] == [MODEL, "sql (LoRA)"] and page.find("#model-select").is_displayed()
    select.select_by_value("sql")
    page.set_field("max-tokens", 2)
    page.send("hi")
    page.wait_finished(1)
    select.select_by_value(MODEL)
    page.send("again")
    page.wait_finished(2)
    assert [p.lora_name for p in server.engine.params] == ["sql", None]
    assert not page.console_errors()



# ---- images attached to a message ----------------------------------------------------------------

def png(width: int, height: int, rgb: tuple[int, int, int]) -> bytes:
    """A PNG of one colour, written by hand (8-bit RGB, no filter)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    rows = b"".join(b"\0" + bytes(rgb) * width for _ in range(height))
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(rows)) + chunk(b"IEND", b""))


def data_url(image: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(image).decode()


class RecordingServer:
    """The page's files (web_ui's routes and headers) beside a fake /v1/models listing `model` and a
    fake /v1/chat/completions that records each request body and streams "A picture." (or refuses
    it with a 400 carrying `refuse`), on a loopback port in a thread."""

    def __init__(self, model: dict | None = None, refuse: str | None = None) -> None:
        self.model = model or {"id": "vlm", "object": "model", "max_model_len": 4096}
        self.refuse = refuse
        self.bodies: list[dict] = []
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.port = asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(timeout=10)

    async def _start(self) -> int:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        web_ui.add_web_ui_routes(app)
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/chat/completions", self.chat)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", 0).start()
        return self.runner.addresses[0][1]

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [self.model]})

    async def chat(self, request: web.Request) -> web.StreamResponse:
        self.bodies.append(await request.json())
        if self.refuse:
            return web.json_response({"error": {"message": self.refuse, "type": "invalid_request_error"}},
                                     status=400)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        chunks = [{"choices": [{"index": 0, "delta": {"content": "A "}, "finish_reason": None}]},
                  {"choices": [{"index": 0, "delta": {"content": "picture."}, "finish_reason": "stop"}]},
                  {"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 2, "total_tokens": 9}}]
        for chunk in chunks:
            await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
        await response.write(b"data: [DONE]\n\n")
        return response

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(timeout=10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        self.loop.close()


@pytest.fixture
def recording_server():
    servers = []

    def make(**kwargs) -> RecordingServer:
        servers.append(RecordingServer(**kwargs))
        return servers[-1]

    yield make
    for server in servers:
        server.close()


def thumbnails(page: Page):
    return page.find_all("#attachments .thumb")


def loaded_images(page: Page, css: str) -> list[str]:
    """The `src` of the images matched by `css` that the browser could load and decode."""
    return page.driver.execute_script(
        "return [...document.querySelectorAll(arguments[0])].filter(i => i.complete && i.naturalWidth > 0)"
        ".map(i => i.src)", css)


@needs_browser
def test_attached_images_are_sent_as_data_url_parts_before_the_text_and_kept_in_the_history(
        browser, recording_server, tmp_path):
    red, blue = png(3, 2, (255, 0, 0)), png(2, 2, (0, 0, 255))
    (tmp_path / "red.png").write_bytes(red)
    (tmp_path / "blue.png").write_bytes(blue)
    server = recording_server()
    page = Page(browser, server)
    page.wait(lambda: page.status_state() == "ok")
    assert page.find("#attach").is_enabled() and not page.find("#attachments").is_displayed()
    page.find("#attach-input").send_keys(f"{tmp_path / 'red.png'}\n{tmp_path / 'blue.png'}")
    page.wait(lambda: len(loaded_images(page, "#attachments .thumb img")) == 2)
    assert sorted(loaded_images(page, "#attachments .thumb img")) == sorted([data_url(red), data_url(blue)])
    blue_thumb = next(t for t in thumbnails(page)
                      if t.find_element("css selector", "img").get_attribute("src") == data_url(blue))
    blue_thumb.find_element("css selector", "button.remove").click()
    page.wait(lambda: len(thumbnails(page)) == 1)
    assert loaded_images(page, "#attachments img") == [data_url(red)]

    page.send("What is in this picture?")
    page.wait_finished(1)
    assert server.bodies[0]["messages"] == [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": data_url(red)}},
        {"type": "text", "text": "What is in this picture?"}]}]
    assert thumbnails(page) == [] and not page.find("#attachments").is_displayed()  # gone with the message
    user = page.find(".message.user")
    assert loaded_images(page, ".message.user .images img") == [data_url(red)]  # shown in the conversation
    assert user.find_element("css selector", ".body").text == "What is in this picture?"

    page.send("And in words?")  # text only: a plain string; the earlier image goes along in the history
    page.wait_finished(2)
    assert server.bodies[1]["messages"] == [
        server.bodies[0]["messages"][0], {"role": "assistant", "content": "A picture."},
        {"role": "user", "content": "And in words?"}]
    assert len(page.find_all(".message.user .images img")) == 1
    assert page.console_errors() == []  # e.g. no Content-Security-Policy refusal of the data: images


@needs_browser
def test_a_pasted_image_is_attached_and_too_large_or_non_image_files_are_refused(browser, recording_server,
                                                                                  tmp_path):
    red = png(4, 4, (255, 0, 0))
    server = recording_server()
    page = Page(browser, server)
    page.wait(lambda: page.status_state() == "ok")
    paste = """
        const [b64, name, type, size] = arguments;
        const bytes = b64 ? Uint8Array.from(atob(b64), (c) => c.charCodeAt(0)) : new Uint8Array(size);
        const data = new DataTransfer();
        data.items.add(new File([bytes], name, {type}));
        document.getElementById('input').dispatchEvent(
            new ClipboardEvent('paste', {clipboardData: data, bubbles: true, cancelable: true}));
    """
    browser.execute_script(paste, base64.b64encode(red).decode(), "image.png", "image/png", 0)
    page.wait(lambda: loaded_images(page, "#attachments img") == [data_url(red)])
    assert page.find("#attach-note").text == ""

    browser.execute_script(paste, "", "huge.png", "image/png", 20 * 1024 * 1024 + 1)
    page.wait(lambda: page.find("#attach-note").text)
    assert page.find("#attach-note").text == "huge.png is 20.0 MB, over the 20.0 MB limit for one image"
    (tmp_path / "notes.txt").write_text("not an image")
    page.find("#attach-input").send_keys(str(tmp_path / "notes.txt"))
    page.wait(lambda: "notes.txt" in page.find("#attach-note").text)
    assert page.find("#attach-note").text == "notes.txt is not an image"
    assert len(thumbnails(page)) == 1

    page.find("#send").click()  # an image without text: the image part alone
    page.wait_finished(1)
    assert server.bodies[0]["messages"] == [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(red)}}]}]
    assert page.find("#attach-note").text == ""


@needs_browser
def test_a_refused_image_shows_the_servers_message_and_comes_back_to_the_box(browser, recording_server, tmp_path):
    red = png(2, 2, (255, 0, 0))
    (tmp_path / "red.png").write_bytes(red)
    server = recording_server(refuse="the model takes no images")
    page = Page(browser, server)
    page.wait(lambda: page.status_state() == "ok")
    page.find("#attach-input").send_keys(str(tmp_path / "red.png"))
    page.wait(lambda: len(thumbnails(page)) == 1)
    page.send("Describe it")
    error = page.wait_finished(1).find_element("css selector", ".error").text
    assert error == "HTTP 400 Bad Request: the model takes no images"
    assert len(server.bodies) == 1
    assert page.find("#input").get_attribute("value") == "Describe it"  # to edit and send again
    assert loaded_images(page, "#attachments img") == [data_url(red)]

    text_only = recording_server(model={"id": "llm", "object": "model", "input_modalities": ["text"]})
    page = Page(browser, text_only)  # a model card that says so: no attaching
    page.wait(lambda: page.status_state() == "ok")
    assert not page.find("#attach").is_enabled()
    assert page.find("#attach").get_attribute("title") == "this model takes no images"
    with_images = recording_server(model={"id": "vlm", "object": "model", "input_modalities": ["text", "image"]})
    page = Page(browser, with_images)
    page.wait(lambda: page.status_state() == "ok")
    assert page.find("#attach").is_enabled()


@needs_browser
def test_the_pages_image_message_gets_what_the_real_app_answers_a_client(browser, make_server, tmp_path):
    """The page's image parts reach the real app (the FakeEngine's text model behind it), which
    answers them as it answers the same parts from any client: its 400 shown word for word, or an
    answer. (Which one depends on how far the server's image input has come, not on the page.)"""
    red = png(2, 2, (255, 0, 0))
    (tmp_path / "red.png").write_bytes(red)
    server = make_server()
    content = [{"type": "image_url", "image_url": {"url": data_url(red)}}, {"type": "text", "text": "hi"}]
    status, _, direct = server.request("POST", "/v1/chat/completions",
                                       {"messages": [{"role": "user", "content": content}], "max_tokens": 2})
    assert status in (200, 400), direct
    page = Page(browser, server)
    page.wait(lambda: page.status_state() == "ok")
    page.set_field("max-tokens", 2)
    page.find("#attach-input").send_keys(str(tmp_path / "red.png"))
    page.wait(lambda: len(thumbnails(page)) == 1)
    page.send("hi")
    answer = page.wait_finished(1)
    if status == 400:
        assert answer.find_element("css selector", ".error").text == \
            "HTTP 400 Bad Request: " + direct["error"]["message"]
        assert answer.get_attribute("data-finish") == "error"
    else:
        assert answer.get_attribute("data-finish") == "length" and not answer.find_elements("css selector", ".error")
        assert server.engine.prompts[1] == server.engine.prompts[0]  # the same prompt as the direct request
