"""What a person sees in a running Ray cluster's dashboard, read from a real headless Chromium.

look(url, token, out_dir) opens the dashboard at `url` and, when the cluster uses token auth
(RAY_AUTH_MODE=token), logs in the way a user does: the page's "Authentication Token Required"
dialog appears on the first 401, the token is typed into its "Authentication Token" field and
Submit is pressed; the page then POSTs /api/authenticate with `Authorization: Bearer <token>`,
the head answers with the HttpOnly cookie `ray-authentication-token` and the page reloads (see
ray/dashboard/http_server_head.py `authenticate`, ray/_private/authentication/
http_token_authentication.py and the frontend's App.tsx / TokenAuthenticationDialog.tsx).
It then reads the Actors view (#/actors), the Jobs view (#/jobs) and, on the page of each RUNNING
job, the "Placement Group Table" section (the only place the dashboard lists placement groups,
filtered to that job), and saves a full-page PNG of each into out_dir.

Each table is read once the page's own request for it has come back (and, when expect_* names
are given, until those are shown: the dashboard refreshes these tables every 10 s). Anything not
shown within timeout_s raises TimeoutError naming it; a rejected token raises AssertionError.
The browser is always quit. Needs /usr/bin/chromium, /usr/bin/chromedriver and selenium; the
driver path is given explicitly so Selenium Manager never downloads anything.
"""

from __future__ import annotations

import base64
import contextlib
import os
import shutil
import subprocess
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar, cast

try:
    from selenium import webdriver
    from selenium.common.exceptions import StaleElementReferenceException, TimeoutException
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.remote.webdriver import WebDriver
    from selenium.webdriver.support.wait import WebDriverWait
except ImportError:  # chromium_available() says so
    webdriver = None  # type: ignore[assignment]

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
WINDOW = (1600, 1000)
MAX_SHOT_HEIGHT = 12000  # px; a huge table would otherwise make a huge PNG
T = TypeVar("T")

# Every <table> as {head: [header texts], rows: [[cell texts]]}, as rendered (innerText).
_TABLES_JS = """return Array.from(document.querySelectorAll('table')).map(t => ({
  head: Array.from(t.querySelectorAll('thead th')).map(c => c.innerText.trim()),
  rows: Array.from(t.querySelectorAll('tbody > tr')).map(
    r => Array.from(r.children).map(c => c.innerText.trim()))}));"""
# Whether this page's request to a URL containing arguments[0] got a 200 at least 200 ms ago
# (long enough for React to have rendered its data).
_FETCHED_JS = """return performance.getEntriesByType('resource').some(e => e.name.includes(arguments[0])
  && e.responseStatus === 200 && performance.now() - e.responseEnd > 200);"""


@dataclass
class DashboardView:
    actors: dict[str, str]  # actor name -> state shown (ALIVE, DEAD, ...); unnamed actors left out
    placement_groups: dict[str, str]  # placement-group name -> state shown (CREATED, ...)
    jobs: dict[str, str]  # job id (or submission id) -> status shown
    screenshots: list[Path] = field(default_factory=list)


def chromium_available() -> str | None:
    """None when look() can run here, else why not (for a pytest skip message)."""
    missing = [str(p) for p in (CHROMIUM, CHROMEDRIVER) if not os.access(p, os.X_OK)]
    if missing:
        return f"not installed: {', '.join(missing)} (apt-get install chromium chromium-driver)"
    return "the selenium package is not installed" if webdriver is None else None


def ensure_chromium() -> None:
    """Install Debian's chromium and chromium-driver when missing and running as root."""
    if (CHROMIUM.exists() and CHROMEDRIVER.exists()) or os.geteuid() != 0 or not shutil.which("apt-get"):
        return
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    apt = ["apt-get", "install", "-y", "--no-install-recommends", "chromium", "chromium-driver"]
    if subprocess.run(apt, env=env, capture_output=True, timeout=900).returncode != 0:  # stale package lists
        subprocess.run(["apt-get", "update"], env=env, capture_output=True, timeout=600)
        subprocess.run(apt, env=env, capture_output=True, timeout=900, check=True)


def look(url: str, token: str | None, out_dir: Path, timeout_s: float = 60, *,
         expect_actors: Iterable[str] = (), expect_placement_groups: Iterable[str] = ()) -> DashboardView:
    """Log in to the dashboard at url and read its actors, jobs and placement groups (module docstring)."""
    if reason := chromium_available():
        raise RuntimeError(f"cannot open the dashboard in Chromium: {reason}")
    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                f"--window-size={WINDOW[0]},{WINDOW[1]}", "--force-device-scale-factor=1"):
        options.add_argument(arg)
    out_dir.mkdir(parents=True, exist_ok=True)
    base, deadline = url.rstrip("/"), time.monotonic() + timeout_s
    driver = webdriver.Chrome(service=Service(str(CHROMEDRIVER)), options=options)
    try:
        driver.set_page_load_timeout(timeout_s)
        _open(driver, f"{base}/#/actors")
        _login(driver, token, deadline)
        rows = _read(driver, "logical/actors", ["Name", "State", "Class"], deadline, "actors on #/actors",
                     set(expect_actors))
        view = DashboardView({}, {}, {}, [_shot(driver, out_dir / "actors.png")])
        for name, state, _ in rows:  # ALIVE ones come first: a dead namesake does not hide them
            view.actors.setdefault(name, state)
        _open(driver, f"{base}/#/jobs")
        rows = _read(driver, "api/jobs/", ["Job ID", "Status", "Submission ID"], deadline, "jobs on #/jobs")
        view.jobs = {(job if job != "(no ray driver)" else sub): status for job, status, sub in rows}
        view.screenshots.append(_shot(driver, out_dir / "jobs.png"))
        _read_placement_groups(driver, base, view, out_dir, set(expect_placement_groups), deadline)
        return view
    except Exception:
        with contextlib.suppress(Exception):  # what the page showed when it went wrong, if it still can
            _shot(driver, out_dir / "failed.png")
        raise
    finally:
        driver.quit()


def _open(driver: WebDriver, url: str) -> None:
    """Load url as a fresh document, so each view's requests and tables start from nothing."""
    driver.get("about:blank")
    driver.get(url)


def _login(driver: WebDriver, token: str | None, deadline: float) -> None:
    def dialog_or_data() -> str | None:
        if driver.find_elements(By.ID, "token-auth-dialog-title"):
            return "dialog"
        return "data" if driver.execute_script(_FETCHED_JS, "logical/actors") else None

    if _wait(driver, dialog_or_data, deadline, "the login dialog or the actors") == "data":
        return  # no token auth
    assert token, "the dashboard asks for an authentication token and none was given"
    dialog = driver.find_element(By.CSS_SELECTOR, "[role=dialog]")
    dialog.find_element(By.CSS_SELECTOR, "input").send_keys(token)
    dialog.find_element(By.XPATH, ".//button[normalize-space()='Submit']").click()

    def answered() -> str | None:
        alerts = driver.find_elements(By.CSS_SELECTOR, "[role=dialog] [role=alert]")
        if alerts:
            return alerts[0].text or "error"
        return "ok" if not driver.find_elements(By.ID, "token-auth-dialog-title") else None

    result = _wait(driver, answered, deadline, "the login dialog to accept the token")
    assert result == "ok", f"the dashboard rejected the token: {result}"


def _read_placement_groups(driver: WebDriver, base: str, view: DashboardView, out_dir: Path, expect: set[str],
                           deadline: float) -> None:
    running = [job for job, status in view.jobs.items() if status.startswith("RUNNING")]
    if expect and not running:
        raise TimeoutError(f"no RUNNING job on #/jobs (shown: {view.jobs}) to list {sorted(expect)} under")
    while True:  # a new placement group shows on the next visit: revisit until the expected ones do
        for job in running:
            _open(driver, f"{base}/#/jobs/{job}")
            _expand(driver, "Placement Group Table", deadline, f"#/jobs/{job}")
            rows = _read(driver, "api/v0/placement_groups", ["Name", "State", "Reserved Resources"], deadline,
                         f"placement groups on #/jobs/{job}")
            view.placement_groups.update((name, state) for name, state, _ in rows)
            shot = _shot(driver, out_dir / f"job-{job}.png")
            view.screenshots += [shot] if shot not in view.screenshots else []
        missing = expect - set(view.placement_groups)
        if not missing:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"the dashboard did not show placement groups {sorted(missing)} on the pages of "
                               f"RUNNING jobs {running}; shown {view.placement_groups}")


def _expand(driver: WebDriver, title: str, deadline: float, page: str) -> None:
    """Open the collapsed section `title` (a CollapsibleSection: its <h4> toggles it)."""
    xpath = f"//h4[normalize-space()='{title}']"
    found = _wait(driver, lambda: driver.find_elements(By.XPATH, xpath) or None, deadline, f"{title!r} on {page}")
    driver.execute_script("arguments[0].scrollIntoView({block: 'center'});", found[0])
    found[0].click()


def _read(driver: WebDriver, api: str, head: list[str], deadline: float, what: str,
          expect: Iterable[str] = ()) -> list[list[str]]:
    """The cells under `head` of the table with those headers, once the page's request to `api` has
    answered and every name in `expect` is shown in column head[0]. Shows up to 100 rows."""
    wanted, seen = set(expect), []

    def ready() -> list[list[str]] | None:
        nonlocal seen
        if not driver.execute_script(_FETCHED_JS, api):
            return None
        _page_size(driver, 100)
        rows = _table(driver, head)
        seen = rows or []
        return rows if rows is not None and wanted <= {r[0] for r in rows} else None

    try:
        return _wait(driver, ready, deadline, what)
    except TimeoutError as e:
        missing = sorted(wanted - {r[0] for r in seen})
        raise TimeoutError(f"{e}: missing {missing}; shown {[r[:2] for r in seen]}") from None


def _page_size(driver: WebDriver, n: int) -> None:
    for box in driver.find_elements(By.XPATH, "//label[normalize-space()='Page Size']/..//input"):
        if box.get_attribute("value") != str(n):
            box.send_keys(Keys.CONTROL, "a")
            box.send_keys(str(n))


def _table(driver: WebDriver, head: list[str]) -> list[list[str]] | None:
    """Rows of the first table whose header has all of `head`, as the cells of those columns."""
    for table in driver.execute_script(_TABLES_JS):
        if all(h in table["head"] for h in head):
            cols = [table["head"].index(h) for h in head]
            return [[row[c] for c in cols] for row in table["rows"] if len(row) == len(table["head"])]
    return None


def _wait(driver: WebDriver, condition: Callable[[], T | None], deadline: float, what: str) -> T:
    wait = WebDriverWait(driver, max(deadline - time.monotonic(), 0.1), poll_frequency=0.25,
                         ignored_exceptions=(StaleElementReferenceException,))  # the page re-rendered under us
    try:  # a table may rightly be empty: only None means "not yet"
        return cast(tuple[T], wait.until(lambda _: (r,) if (r := condition()) is not None else None))[0]
    except TimeoutException:
        raise TimeoutError(f"the dashboard did not show {what} in time") from None


def _shot(driver: WebDriver, path: Path) -> Path:
    """A full-page PNG: the whole document, not just the window, from its top, no field focused."""
    width, height = driver.execute_script("""window.scrollTo(0, 0); document.activeElement?.blur();
        const d = document.documentElement; return [d.scrollWidth, d.scrollHeight];""")
    clip = {"x": 0, "y": 0, "width": max(width, WINDOW[0]), "height": min(height, MAX_SHOT_HEIGHT), "scale": 1}
    png = driver.execute_cdp_cmd("Page.captureScreenshot", {"format": "png", "captureBeyondViewport": True,
                                                            "clip": clip})
    path.write_bytes(base64.b64decode(png["data"]))
    return path
