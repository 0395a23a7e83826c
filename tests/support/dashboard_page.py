"""The dashboard as a test sees it: Selenium calls named after what a person does."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from selenium.common.exceptions import (
    ElementNotInteractableException,
    NoSuchElementException,
    StaleElementReferenceException,
)
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webelement import WebElement
from selenium.webdriver.support.select import Select
from selenium.webdriver.support.ui import WebDriverWait

from support.dashboard import LiveServer


class Dashboard:
    def __init__(self, driver: Any, server: LiveServer) -> None:
        self.d = driver
        self.server = server
        self.d.get_log("browser")  # start each test with an empty console

    # --- navigation -----------------------------------------------------------------------

    def open(self, query: str = "", token: str | None = None) -> Dashboard:
        """The dashboard, logged in (with the login form: the server's login link works once)
        with `token`, else the workspace's admin token."""
        self.d.get(f"{self.server.url}/{query}")
        if "/login" in self.d.current_url:
            self.log_in(token or self.server.token or "")
            if query:
                self.d.get(f"{self.server.url}/{query}")
        self.wait(
            lambda: "live-on" in self.d.find_element(By.ID, "live").get_attribute("class"), "event stream connected"
        )
        return self

    def log_in(self, token: str) -> None:
        """Paste `token` into the login form, as a person does."""
        if "/login" not in self.d.current_url:
            self.d.get(f"{self.server.url}/login")
        self.d.find_element(By.ID, "token").send_keys(token)
        self.d.find_element(By.CSS_SELECTOR, "#login-form button[type=submit]").click()
        self.wait(lambda: self.d.current_url.rstrip("/") == self.server.url, "logged in")

    def log_out(self) -> None:
        self.d.find_element(By.CSS_SELECTOR, "form.logout button").click()
        self.wait(lambda: self.d.current_url == self.server.url + "/login", "logged out")

    def wait(self, condition: Callable[[], Any], message: str, timeout: float = 10.0) -> Any:
        return WebDriverWait(
            self.d,
            timeout,
            poll_frequency=0.1,
            # a live update may replace an element, or hold a form field out of reach for the
            # moment it redraws it: a person waits for it, and so does the test, up to its timeout
            ignored_exceptions=(
                NoSuchElementException,
                StaleElementReferenceException,
                ElementNotInteractableException,
            ),
        ).until(lambda _d: condition(), message)

    def fresh(self, read: Callable[[], Any], what: str) -> Any:
        """What ``read`` returns, read again from the start when a live update redraws the page
        while it reads (an element it holds goes stale), even when the answer is empty."""
        return self.wait(lambda: (read(),), f"read {what}")[0]

    def js(self, script: str, *args: Any) -> Any:
        return self.d.execute_script(script, *args)

    def viewport(self, width: int, height: int, mobile: bool | None = None) -> None:
        """Emulate a screen of `width` x `height` CSS pixels (a phone's below 600 unless said),
        until reset_viewport()."""
        self.d.execute_cdp_cmd(
            "Emulation.setDeviceMetricsOverride",
            {
                "width": width,
                "height": height,
                "deviceScaleFactor": 1,
                "mobile": width < 600 if mobile is None else mobile,
            },
        )
        self.wait(lambda: self.js("return window.innerWidth") == width, f"viewport {width} px")

    def reset_viewport(self) -> None:
        self.d.execute_cdp_cmd("Emulation.clearDeviceMetricsOverride", {})

    # --- the process table ------------------------------------------------------------------

    def row(self, process_id: str) -> WebElement:
        return self.d.find_element(By.ID, f"proc-{process_id}")

    def has_row(self, process_id: str) -> bool:
        return bool(self.d.find_elements(By.ID, f"proc-{process_id}"))

    def cell(self, process_id: str, label: str) -> str:
        return str(
            self.js(
                "var r = document.getElementById(arguments[0]);"
                "var c = r && r.querySelector('td[data-label=\"' + arguments[1] + '\"]');"
                "return c ? c.textContent.replace(/\\s+/g, ' ').trim() : null;",
                f"proc-{process_id}",
                label,
            )
        )

    def wait_cell(self, process_id: str, label: str, *texts: str, timeout: float = 10.0) -> str:
        return str(
            self.wait(
                lambda: all(t in self.cell(process_id, label) for t in texts) and self.cell(process_id, label),
                f"{process_id}: {label} shows {texts}",
                timeout,
            )
        )

    def buttons(self, process_id: str) -> dict[str, bool]:
        """Action buttons of a row: label -> enabled."""
        return {
            b.text: b.is_enabled() for b in self.row(process_id).find_elements(By.CSS_SELECTOR, "button[data-action]")
        }

    def wait_buttons(self, process_id: str, expected: dict[str, bool]) -> None:
        self.wait(lambda: self.buttons(process_id) == expected, f"{process_id}: buttons {expected}")

    def click(self, process_id: str, action: str) -> None:
        """Click a row's button; a live update that re-renders the row meanwhile is waited out."""
        self.wait(
            lambda: (
                self.row(process_id).find_element(By.CSS_SELECTOR, f'button[data-action="{action}"]').click() or True
            ),
            f"clicked {action} of {process_id}",
        )

    def job_row(self, key: str) -> WebElement:
        return self.d.find_element(By.ID, f"job-{key}")

    def click_job(self, key: str, action: str) -> None:
        self.wait(
            lambda: (
                self.job_row(key).find_element(By.CSS_SELECTOR, f'button[data-action="job-{action}"]').click() or True
            ),
            f"clicked {action} of job {key}",
        )

    def job_text(self, key: str, label: str) -> str:
        return str(
            self.js(
                "var r = document.getElementById(arguments[0]);"
                "var c = r && r.querySelector('td[data-label=\"' + arguments[1] + '\"]');"
                "return c ? c.textContent.replace(/\\s+/g, ' ').trim() : '';",
                f"job-{key}",
                label,
            )
        )

    def table_order(self) -> list[str]:
        """The ids of the process table's rows, top to bottom (job-KEY, proc-ID)."""
        return list(
            self.js(
                "return Array.from(document.querySelectorAll('#process-rows tr')).map(function (r) { return r.id; });"
            )
        )

    def visible_rows(self) -> set[str]:
        return set(
            self.js(
                "return Array.from(document.querySelectorAll('#process-rows tr.proc'))"
                ".filter(function (r) { return !r.hidden && r.offsetParent !== null; })"
                ".map(function (r) { return r.dataset.processId; });"
            )
        )

    # --- filters ----------------------------------------------------------------------------

    def search(self, text: str) -> None:
        box = self.d.find_element(By.ID, "filter-q")
        box.clear()
        if text:
            box.send_keys(text)
        else:
            self.js("arguments[0].dispatchEvent(new Event('input'))", box)

    def choose(self, select_id: str, value: str) -> None:
        Select(self.d.find_element(By.ID, select_id)).select_by_value(value)

    # --- dialog -----------------------------------------------------------------------------

    def dialog_open(self) -> bool:
        return bool(self.js("return document.getElementById('target-dialog').open"))

    def target_values(self) -> list[str]:
        return list(
            self.js(
                "return Array.from(document.querySelectorAll('#target-dialog input[name=target]'))"
                ".map(function (i) { return i.value; });"
            )
        )

    def pick_target(self, value: str) -> None:
        self.d.find_element(By.CSS_SELECTOR, f'#target-dialog input[name=target][value="{value}"]').click()

    def submit_dialog(self) -> None:
        self.d.find_element(By.CSS_SELECTOR, "#target-dialog button[type=submit]").click()

    def dialog_error(self) -> str:
        errors = self.d.find_elements(By.CSS_SELECTOR, "#target-dialog .form-error")
        return errors[0].text if errors and errors[0].is_displayed() else ""

    # --- elsewhere on the page ----------------------------------------------------------------

    def notices(self) -> list[tuple[str, str]]:
        """(role, text) of each notice shown."""
        return list(
            self.fresh(
                lambda: [
                    (n.get_attribute("role") or "", n.find_element(By.CSS_SELECTOR, ".notice-text").text)
                    for n in self.d.find_elements(By.CSS_SELECTOR, "#notices .notice")
                ],
                "the notices",
            )
        )

    def host_section(self, host: str) -> WebElement:
        for section in self.d.find_elements(By.CSS_SELECTOR, "#hosts .host"):
            if section.get_attribute("data-host") == host:
                return section
        raise NoSuchElementException(f"no GPU section for host {host!r}")

    def gpu_card(self, uuid: str) -> WebElement:
        return self.d.find_element(By.CSS_SELECTOR, f'#hosts article.gpu[data-uuid="{uuid}"]')

    def bar(self, uuid: str) -> dict[str, float]:
        """Widths (of 1000) of a GPU card's memory bar segments."""
        card = self.gpu_card(uuid)
        return {
            part: float(card.find_element(By.CSS_SELECTOR, f"rect.seg-{part}").get_attribute("width"))
            for part in ("flexium", "other")
        }

    def command_items(self) -> list[str]:
        return [li.text for li in self.d.find_elements(By.CSS_SELECTOR, "#commands li.cmd")]

    def overflow(self) -> dict[str, float]:
        """The page's scroll and client widths, and the right edges of the process table and
        of its panel's content box (the table must not spill into the padding either)."""
        return dict(
            self.js(
                "var e = document.documentElement, t = document.getElementById('processes');"
                "var p = t.parentElement, cs = getComputedStyle(p);"
                "return {scroll: e.scrollWidth, client: e.clientWidth,"
                " table: t.getBoundingClientRect().right,"
                " box: p.getBoundingClientRect().right - parseFloat(cs.paddingRight)};"
            )
        )

    def assert_console_clean(self) -> None:
        """No script errors and no Content-Security-Policy refusals (what injected markup or a
        regression to inline scripts would cause)."""
        bad = [
            e["message"]
            for e in self.d.get_log("browser")
            if e.get("level") == "SEVERE" and "Failed to load resource" not in e["message"]
        ]
        assert not bad, bad
