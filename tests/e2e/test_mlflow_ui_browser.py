"""What a user sees of a run in MLflow, checked in a real browser: Debian's chromium, headless, driven by Playwright,
starting at the home page of `diffrl ui` on a tiny run's mlflow.db and clicking through as a user does.

Screenshots go to DIFFRL_TEST_ARTIFACTS (CI keeps that folder as its output), else under pytest's tmp dir; the test
prints the folder. Every wait is for something on the page (generous timeouts on the shared 2-core machine), never a
fixed sleep.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request

import pytest
from e2e_settings import TINY

from diffrl.flows.train import train

CHROMIUM = next((p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None)
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="no chromium on PATH (make test installs Debian's chromium)")

RUN = TINY + ["run.steps=2", "run.validate_every=1"]  # validation at steps 0, 1 and 2; rollout images at 1 and 2
WAIT_MS = 120_000


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(url: str, server: subprocess.Popen, timeout_s: float = 180) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert server.poll() is None, f"diffrl ui exited with {server.returncode}"
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)  # polling for readiness, not asserting speed
    raise AssertionError(f"diffrl ui did not answer on {url} within {timeout_s} s")


@pytest.fixture(scope="module")
def ui_url(tmp_path_factory, diffrl_cache):
    """`diffrl ui` on 127.0.0.1 (a free port) over a two-step tiny run's mlflow.db."""
    folder = tmp_path_factory.mktemp("ui_run")
    here = os.getcwd()
    os.chdir(folder)
    try:
        os.environ.pop("MLFLOW_TRACKING_URI", None)
        train(config=None, overrides=RUN)
    finally:
        os.chdir(here)
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    server = subprocess.Popen(
        [sys.executable, "-m", "diffrl.flows.cli", "ui", "--port", str(port)],
        cwd=folder,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(url, server)
        yield url
    finally:
        server.terminate()
        server.wait(timeout=30)


@pytest.fixture
def page(tmp_path_factory, request):
    """A fresh headless chromium (no local storage: a first visit); a screenshot of the last page on teardown."""
    from playwright.sync_api import sync_playwright

    shots = os.environ.get("DIFFRL_TEST_ARTIFACTS") or str(tmp_path_factory.mktemp("screenshots"))
    os.makedirs(shots, exist_ok=True)
    print(f"screenshots of {request.node.name}: {shots}")
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1600, "height": 1000})
        page.set_default_timeout(WAIT_MS)
        page.shots = shots
        try:
            yield page
        finally:
            page.screenshot(path=os.path.join(shots, f"{request.node.name}.png"))
            browser.close()


def _open_the_run(page, ui_url: str) -> None:
    """Home page -> the experiment (as listed there) -> its run, by clicking."""
    page.goto(ui_url + "/")
    page.get_by_role("link", name="diffrl-quickstart", exact=True).first.click()
    page.wait_for_url("**/experiments/*/runs**")  # the runs list, not the GenAI overview
    run_row = page.get_by_role("link", name="quickstart", exact=True).first
    run_row.wait_for(state="visible")  # the run's row is listed
    page.screenshot(path=os.path.join(page.shots, "experiment.png"))
    run_row.click()
    page.wait_for_url("**/runs/*")


def _show_image_card(page, key: str):
    """The run's "Model metrics" tab filtered to the image card `key` (the search box of the charts): the card's
    image, once loaded, and its step slider."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    page.get_by_role("tab", name="Model metrics").click()
    page.get_by_placeholder("Search metric charts").fill(key)
    # the card titled `key` that has a step slider (a metric chart of the same name has none)
    card = page.locator(f'xpath=//h4[@title="{key}"]/ancestor::*[.//*[@role="slider"]][1]')
    deadline = time.monotonic() + WAIT_MS / 1000
    while True:  # MLflow draws a card once it is scrolled into view: scroll down as a user would, until it is
        try:
            card.wait_for(state="attached", timeout=1000)
            break
        except PlaywrightTimeout:
            assert time.monotonic() < deadline, f"no image card {key!r} on the run page"
            page.mouse.move(800, 600)
            page.mouse.wheel(0, 600)
    card.scroll_into_view_if_needed()
    image = card.locator("img").first
    image.wait_for(state="visible")
    page.wait_for_function("img => img.complete && img.naturalWidth > 0", arg=image.element_handle())
    return image, card.get_by_role("slider")


def test_the_experiment_opens_on_its_runs_and_the_validation_grid_at_full_size(ui_url, page):
    _open_the_run(page, ui_url)
    assert "/overview" not in page.url and "workflowType=genai" not in page.url, page.url
    image, slider = _show_image_card(page, "validation")
    page.screenshot(path=os.path.join(page.shots, "validation.png"))
    # the logged grid is 4 tiles of 256 px: the card shows that file, not a 256-px thumbnail of the whole grid
    assert image.evaluate("img => img.naturalWidth") >= 512
    # validation at steps 0, 1 and 2: the card opens on the last one (MLflow's own card starts at step 0)
    assert (slider.get_attribute("aria-valuenow"), slider.get_attribute("aria-valuemax")) == ("2", "2")
    assert "step%2B2%2B" in image.get_attribute("src").replace("+", "%2B")


def test_the_rollout_card_opens_on_the_last_step_without_the_params(ui_url, page):
    """The rollout card was empty: its slider started at step 0, and the first rollout is step 1. On the run page
    (one run) the card leaves out the run's params, which stood above the image."""
    _open_the_run(page, ui_url)
    image, slider = _show_image_card(page, "rollout")
    page.screenshot(path=os.path.join(page.shots, "rollout.png"))
    assert (slider.get_attribute("aria-valuenow"), slider.get_attribute("aria-valuemax")) == ("2", "2")
    assert "step%2B2%2B" in image.get_attribute("src").replace("+", "%2B")
    assert page.get_by_text("algorithm.name=").count() == 0
