"""The page `edgeprefill serve` shows at /, in a real headless browser (Debian's Chromium and
its driver, driven by Selenium) against the server on a real model: a chat typed into the
page streams its answer while a document posted through the API shows its progress to
100%, and the scheduler panel fills from /metrics. A screenshot is kept in
test-artifacts/page.png.

Chromium and ChromeDriver: `apt-get install chromium chromium-driver` (Debian and Ubuntu;
CI installs them). Where they are missing the test says so and skips."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import httpx
import pytest

pytest.importorskip("fastapi")
webdriver = pytest.importorskip("selenium.webdriver", reason="pip install -e '.[test]'")

from selenium.common.exceptions import StaleElementReferenceException  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

from tests.server_helpers import KEY, serving  # noqa: E402

ROOT = Path(__file__).parents[1]
CHROMIUM, DRIVER = shutil.which("chromium"), shutil.which("chromedriver")
DOCUMENT = " ".join(f"Paragraph {i} says the meeting moved to room {i}." for i in range(60))

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        CHROMIUM is None or DRIVER is None,
        reason="needs Chromium and its driver: apt-get install chromium chromium-driver",
    ),
]


@pytest.fixture
def browser():
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage"):
        options.add_argument(flag)
    options.add_argument("--window-size=1400,900")
    driver = webdriver.Chrome(options=options, service=webdriver.ChromeService(DRIVER))
    try:
        yield driver
    finally:
        driver.quit()


def test_a_chat_streams_in_the_page_while_a_document_posted_to_the_api_is_read(
    make_backend, browser
):
    with serving(make_backend, policy="static:32") as (base, _):
        browser.get(base + "/")
        browser.find_element(By.ID, "key").send_keys(KEY)
        posted = httpx.post(
            f"{base}/v1/documents",
            json={"text": DOCUMENT, "max_tokens": 8},
            headers={"Authorization": f"Bearer {KEY}"},
        )
        assert posted.status_code == 202, posted.text
        browser.find_element(By.ID, "prompt").send_keys("Write two sentences about the sea.")
        browser.find_element(By.ID, "send").click()
        # The page redraws its lists as it polls: an element found may be gone when read.
        wait = WebDriverWait(
            browser, 240, poll_frequency=0.2, ignored_exceptions=[StaleElementReferenceException]
        )
        answer = wait.until(lambda b: _answer(b, "done"))
        assert "error" not in answer.get_attribute("class"), answer.text
        assert int(answer.get_attribute("data-pieces")) > 1  # streamed, not one write
        wait.until(lambda b: "100%" in b.find_element(By.CSS_SELECTOR, ".document").text)
        bar = browser.find_element(By.CSS_SELECTOR, ".document progress")
        assert bar.get_attribute("value") == bar.get_attribute("max")
        wait.until(lambda b: b.find_element(By.ID, "ended-foreground").text == "1")
        assert browser.find_element(By.ID, "ttft-foreground").text.endswith(" ms")
        assert browser.find_element(By.ID, "budget").text == "32"
        artifacts = ROOT / "test-artifacts"
        artifacts.mkdir(exist_ok=True)
        browser.save_screenshot(str(artifacts / "page.png"))


def test_the_page_asks_for_json_and_for_a_tool_call(make_backend, browser):
    """The page's two examples of what clients ask beyond text: an answer under a JSON
    schema (it parses), and a call to a tool (shown as the call)."""
    from selenium.webdriver.support.ui import Select

    with serving(make_backend) as (base, _):
        browser.get(base + "/")
        browser.find_element(By.ID, "key").send_keys(KEY)
        wait = WebDriverWait(browser, 240, poll_frequency=0.2)
        for n, (answer_as, prompt) in enumerate(
            [("json", "Describe Ada."), ("tool", "What is the weather in Oslo?")], 1
        ):
            Select(browser.find_element(By.ID, "answer-as")).select_by_value(answer_as)
            browser.find_element(By.ID, "prompt").send_keys(prompt)
            browser.find_element(By.ID, "send").click()
            wait.until(
                lambda b, n=n: len(b.find_elements(By.CSS_SELECTOR, ".turn.assistant.done")) == n
            )
            text = browser.find_elements(By.CSS_SELECTOR, ".turn.assistant.done")[-1].text
            if answer_as == "json":
                assert set(json.loads(text)) == {"name", "age"}, text
            else:
                assert text.startswith("call get_weather({") and '"city"' in text, text


def test_the_page_needs_no_key_holds_no_data_and_refuses_to_be_framed(make_backend):
    with serving(make_backend) as (base, _):
        page = httpx.get(base + "/")
        listed = httpx.get(base + "/v1/documents")
    assert page.status_code == 200 and "text/html" in page.headers["content-type"]
    assert "frame-ancestors 'none'" in page.headers["content-security-policy"]
    assert "connect-src 'self'" in page.headers["content-security-policy"]
    assert KEY not in page.text
    assert listed.status_code == 401  # the API behind it still wants the key


def _answer(browser, state: str):
    found = browser.find_elements(By.CSS_SELECTOR, f".turn.assistant.{state}")
    return found[0] if found and found[0].text.strip() else None
