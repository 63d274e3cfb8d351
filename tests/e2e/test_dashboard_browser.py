"""The dashboard in a real browser: Debian's headless chromium driven by selenium through the
system chromedriver, against a real `sigprop serve` on loopback (embedded SQLite backend, so
validations run in the service's own local runner) with solutions made by POST /v1/solve.

Screenshots go to test-artifacts/dashboard/ (git-ignored). Skipped only when chromium or
chromedriver is not installed (`.ci/run` installs both from Debian).
"""

from __future__ import annotations

import hashlib
import re
import time
from pathlib import Path

import httpx
import pytest

from sigprop.api.auth import tenant_of
from sigprop.api.validations import OWNER
from sigprop.storage import SqliteSolutionCache, SqliteValidationStore

from ..dashboard_fixtures import CHROMEDRIVER, CHROMIUM, EVIL, EVIL_KEY, evil_record, headless_chromium
from ..service_fixtures import running_service

ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS = ROOT / "test-artifacts" / "dashboard"
API_KEY = "dashboard-browser-key"
WAIT_S = 20.0

pytestmark = pytest.mark.skipif(
    not (CHROMIUM.exists() and CHROMEDRIVER.exists()),
    reason="needs Debian's chromium and chromium-driver (/usr/bin/chromium, "
    "/usr/bin/chromedriver): apt-get install chromium chromium-driver",
)

SOLVES = {
    "tat_lrelu": {
        "graph": {"template": "mlp", "depth": 20, "width": 64},
        "method": "tat",
        "activation": "leaky_relu",
        "targets": {"eta": 0.9},
    },
    "tat_softplus_resnet": {
        "graph": {"template": "resnet", "depth": 18, "shortcut_weight": 0.8},
        "method": "tat",
        "activation": "softplus",
        "targets": {"tau": 0.3},
    },
    "sparse": {
        "graph": {"template": "mlp", "depth": 10, "width": 64},
        "method": "sparse_eoc",
        "activation": "crelu",
        "targets": {"sparsity": 0.7, "v_slope": 0.7},
    },
    "geometric": {"graph": {"template": "cnn", "depth": 8, "width": 16}, "method": "geometric", "activation": "relu"},
    # a long graph (about 250 levels) whose diagram must fit its box
    "densenet121": {"graph": {"template": "densenet", "depth": 121}, "method": "eoc", "activation": "relu"},
}
VALIDATION = {
    "solve": {
        "graph": {"template": "mlp", "depth": 4, "width": 16, "input_shape": [64], "classes": 10},
        "method": "tat",
        "activation": "leaky_relu",
        "targets": {"eta": 0.5},
    },
    "dataset": "digits",
    "steps": 40,
    "batch_size": 32,
    "baselines": ["he", "eoc"],
}


# -- fixtures -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dash-browser")
    with running_service(tmp, {"SIGPROP_API_KEYS": API_KEY}) as svc:
        svc.data_file = tmp / "data" / "solutions.sqlite3"
        yield svc


@pytest.fixture(scope="module")
def api(service):
    # the key that submits this test's validations, and reads stored records back (issue 35)
    with httpx.Client(base_url=service.base_url, timeout=60.0, headers={"Authorization": f"Bearer {API_KEY}"}) as c:
        yield c


@pytest.fixture(scope="module")
def keys(service, api):
    """Real cached solutions, and one planted record whose ids and activation carry a script tag."""
    out = {}
    for name, body in SOLVES.items():
        r = api.post("/v1/solve", json=body)
        assert r.status_code == 200, r.text
        out[name] = r.json()["key"]
    cache = SqliteSolutionCache(service.data_file)
    try:
        cache.put(evil_record())
    finally:
        cache.close()
    out["evil"] = EVIL_KEY
    return out


@pytest.fixture(scope="module")
def driver():
    drv = headless_chromium(console_log=True)
    drv.set_page_load_timeout(30)
    # with API keys configured the dashboard shows stored records to a key only (issue 35): the
    # browser sends this test's key with every request, as a signed-in user's browser would
    drv.execute_cdp_cmd("Network.enable", {})
    drv.execute_cdp_cmd("Network.setExtraHTTPHeaders", {"headers": {"Authorization": f"Bearer {API_KEY}"}})
    yield drv
    drv.quit()


@pytest.fixture(autouse=True)
def fresh_console(driver):
    """Each test sees only its own console messages (chromium's log is read destructively)."""
    driver.get_log("browser")


# -- helpers ------------------------------------------------------------------------------------


def owned(request: dict) -> dict:
    """A planted validation's request as the API stores it: owned by this test's key (issue 35), so
    the browser, signed in with it, sees the record."""
    return {**request, OWNER: tenant_of(hashlib.sha256(API_KEY.encode()).hexdigest())}


def wait_for(driver, condition, what: str, timeout_s: float = WAIT_S):
    """``condition(driver)`` once truthy; elements that vanish in a reload meanwhile are retried.
    An element found just before a reload and read just after can also fail with chromedriver's
    generic "Node with given id does not belong to the document" (a plain WebDriverException, no
    subclass), so any driver error retries too: a real failure still ends in the timeout below."""
    from selenium.common.exceptions import WebDriverException
    from selenium.webdriver.support.ui import WebDriverWait

    try:
        return WebDriverWait(driver, timeout_s, poll_frequency=0.05, ignored_exceptions=(WebDriverException,)).until(
            condition
        )
    except Exception as exc:
        screenshot(driver, f"failed-{re.sub(r'[^a-z0-9]+', '-', what.lower())[:40]}")
        raise AssertionError(f"timed out waiting for {what} on {driver.current_url}") from exc


def rendered_lines(driver, plot_id: str) -> list[str]:
    """The `d` of every line plotly has drawn in a plot (a straight line is just "M..L.."), or []."""
    paths = driver.execute_script(
        "return Array.from(document.querySelectorAll(arguments[0])).map(p => p.getAttribute('d') || '')",
        f"#{plot_id} .scatterlayer .trace path.js-line",
    )
    return [d for d in paths if d.startswith("M") and "L" in d]


def rendered_points(driver, plot_id: str) -> int:
    return driver.execute_script(
        "return document.querySelectorAll(arguments[0]).length", f"#{plot_id} .scatterlayer .trace .points path"
    )


def diagram_nodes(driver) -> list[str]:
    """The tooltips of the nodes of the server-drawn graph diagram."""
    return driver.execute_script(
        "return Array.from(document.querySelectorAll('#graph-svg .nodes path'))"
        ".map(p => p.querySelector('title').textContent)"
    )


def screenshot(driver, name: str) -> Path:
    """A PNG of the whole page (the window grown to the page's height, at most 5000 px)."""
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    height = driver.execute_script(
        "return Math.min(5000, document.documentElement.scrollHeight + window.outerHeight - window.innerHeight)"
    )
    driver.set_window_size(1400, max(800, height))
    path = ARTIFACTS / f"{name}.png"
    driver.save_screenshot(str(path))
    driver.set_window_size(1400, 1000)
    return path


def assert_no_alert(driver) -> None:
    from selenium.common.exceptions import NoAlertPresentException

    try:
        alert = driver.switch_to.alert
    except NoAlertPresentException:
        return
    text = alert.text
    alert.dismiss()
    raise AssertionError(f"the page opened an alert: {text!r}")


def severe_console_errors(driver) -> list[str]:
    return [e["message"] for e in driver.get_log("browser") if e.get("level") == "SEVERE"]


# -- tests --------------------------------------------------------------------------------------


def test_list_then_solution_page_draws_the_c_map(service, keys, driver):
    from selenium.webdriver.common.by import By

    driver.get(f"{service.base_url}/dashboard")
    links = {
        a.get_attribute("href").rsplit("/", 1)[1]
        for a in driver.find_elements(By.CSS_SELECTOR, "table.solutions tbody a.key")
    }
    assert set(keys.values()) <= links, links
    screenshot(driver, "list")
    driver.find_element(By.CSS_SELECTOR, f'a[href="/dashboard/solutions/{keys["tat_lrelu"]}"]').click()
    wait_for(driver, lambda d: d.current_url.endswith(keys["tat_lrelu"]), "the solution page")
    lines = wait_for(driver, lambda d: rendered_lines(d, "c-map"), "the C map")
    assert len(lines) >= 3  # identity, the solved network, the untransformed (ReLU) network
    assert len(diagram_nodes(driver)) == 43  # 20-layer MLP: input, 20 x (dense, activation), logits, output
    assert "leaky_relu" in driver.find_element(By.TAG_NAME, "h1").text
    assert not severe_console_errors(driver)
    screenshot(driver, "solution-tat-leaky-relu")


@pytest.mark.parametrize(
    "name, plots", [("tat_softplus_resnet", ["c-map"]), ("sparse", ["c-map", "v-map"]), ("geometric", ["gr-plot"])]
)
def test_method_specific_plots(service, keys, driver, name, plots):
    driver.get(f"{service.base_url}/dashboard/solutions/{keys[name]}")
    for plot in plots:
        wait_for(driver, lambda d: rendered_lines(d, plot) or rendered_points(d, plot), f"the {plot} plot")
    assert diagram_nodes(driver)
    assert not severe_console_errors(driver)
    screenshot(driver, f"solution-{name.replace('_', '-')}")


def test_solve_form_shows_errors_and_opens_the_new_solution(service, keys, driver, api):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    driver.get(f"{service.base_url}/dashboard/new")
    wait_for(driver, lambda d: d.find_element(By.ID, "solve-form").get_attribute("data-ready") == "1", "the form")
    Select(driver.find_element(By.ID, "template")).select_by_value("mlp")

    def fill(element_id: str, value) -> None:
        box = driver.find_element(By.ID, element_id)
        box.clear()
        box.send_keys(str(value))

    fill("param-depth", 3)
    fill("param-width", 8)
    Select(driver.find_element(By.ID, "method")).select_by_value("tat")
    Select(driver.find_element(By.ID, "activation")).select_by_value("leaky_relu")
    fill("target-eta", 0.99)  # unreachable on a 3-layer MLP: the contract's error, shown in the page
    driver.find_element(By.ID, "submit").click()
    box = wait_for(
        driver,
        lambda d: d.find_element(By.ID, "error") if d.find_element(By.ID, "error").is_displayed() else None,
        "the error message",
    )
    assert driver.find_element(By.ID, "error-code").text == "unreachable_target", box.text
    assert driver.find_element(By.ID, "error-message").text
    assert driver.find_element(By.ID, "error-hint").text
    screenshot(driver, "form-error")

    fill("target-eta", 0.5)
    driver.find_element(By.ID, "submit").click()
    wait_for(driver, lambda d: re.search(r"/dashboard/solutions/[0-9a-f]{64}$", d.current_url), "the new solution page")
    key = driver.current_url.rsplit("/", 1)[1]
    wait_for(driver, lambda d: rendered_lines(d, "c-map"), "the new C map")
    answer = api.get(f"/v1/solutions/{key}").json()
    assert answer["request"]["graph"] == {"template": "mlp", "depth": 3, "width": 8}
    assert answer["answer"]["targets"] == {"eta": 0.5}
    screenshot(driver, "form-new-solution")


def test_escaped_record_opens_no_alert(service, keys, driver):
    from selenium.webdriver.common.by import By

    for path in (f"/dashboard?q={EVIL_KEY[:8]}", f"/dashboard/solutions/{EVIL_KEY}"):
        driver.get(service.base_url + path)
        time.sleep(0.5)  # give any injected script its chance to run
        assert_no_alert(driver)
        assert EVIL in driver.find_element(By.TAG_NAME, "main").text  # shown as text
    assert any(title.startswith(EVIL) for title in diagram_nodes(driver))  # the id, as text
    wait_for(driver, lambda d: rendered_lines(d, "c-map"), "the C map of the planted record")
    assert_no_alert(driver)
    screenshot(driver, "escaped-record")


def test_validation_page_follows_a_real_run(service, keys, driver, api):
    """A real (tiny) validation in the service's local runner: the page follows it live and shows
    the curves once it has ended."""
    from selenium.webdriver.common.by import By

    r = api.post("/v1/validations", json=VALIDATION, headers={"Authorization": f"Bearer {API_KEY}"})
    assert r.status_code == 202, r.text
    vid = r.json()["id"]
    driver.get(f"{service.base_url}/dashboard/validations/{vid}")
    wait_for(driver, lambda d: "finished" in d.find_element(By.ID, "status").text, "the run to finish", timeout_s=60)
    for plot in ("loss-plot", "accuracy-plot", "grad-plot", "c-values-plot"):
        wait_for(driver, lambda d: rendered_lines(d, plot), f"the {plot}")
    assert not severe_console_errors(driver)
    assert_powers_of_ten(tick_labels(driver, "grad-plot", "ytick"))
    screenshot(driver, "validation-finished")
    # the solution page links it
    key = api.get(f"/v1/validations/{vid}").json()["key"]
    driver.get(f"{service.base_url}/dashboard/solutions/{key}")
    assert driver.find_elements(By.CSS_SELECTOR, f'a[href="/dashboard/validations/{vid}"]')


def test_validation_page_live_progress(service, keys, driver, api):
    """Deterministic live updates: a running job planted in the store, its progress moved by the
    test; the page's progress bar follows within a couple of seconds and the page reloads with the
    results when the job finishes."""
    from selenium.webdriver.common.by import By

    store = SqliteValidationStore(service.data_file)
    vid = "live" + "0" * 28
    try:
        store.create(
            vid,
            keys["tat_lrelu"],
            owned({"key": keys["tat_lrelu"], "dataset": "digits", "steps": 100, "batch_size": 32, "baselines": []}),
            time.time(),
        )
        assert store.start(vid, "cpu") == 1
        store.set_progress(vid, {"step": 30, "total": 100, "run": "solved"})
        driver.get(f"{service.base_url}/dashboard/validations/{vid}")
        assert driver.find_element(By.ID, "progress").get_attribute("value") == "30"
        store.set_progress(vid, {"step": 60, "total": 100, "run": "solved"})
        wait_for(
            driver,
            lambda d: d.find_element(By.ID, "progress").get_attribute("value") == "60",
            "progress 60%",
            timeout_s=5,
        )
        assert "step 60 of 100" in driver.find_element(By.ID, "progress-text").text
        screenshot(driver, "validation-running")
        finished = [j for j in api.get("/v1/validations").json()["items"] if j["status"] == "finished"]
        results = api.get(f"/v1/validations/{finished[0]['id']}").json()["results"] if finished else {"runs": {}}
        assert store.finish(vid, results)
        wait_for(
            driver,
            lambda d: "finished" in d.find_element(By.ID, "status").text and not d.find_elements(By.ID, "progress"),
            "the reload after the end",
            timeout_s=5,
        )
    finally:
        store.close()


def _charlm_results() -> dict:
    """The results of a charlm validation (``sigprop.worker.charlm``) with three arms' curves."""
    steps = [10, 20, 30, 40]
    runs = {}
    for i, name in enumerate(("solved", "shortcuts", "standard")):
        values = [4.0 - 0.3 * k - 0.1 * i for k in range(4)]
        runs[name] = {
            "description": f"arm {name}",
            "steps_done": 40,
            "diverged": False,
            "loss": {"steps": steps, "values": [v + 0.05 for v in values]},
            "validation_loss": {"steps": steps, "values": values},
            "test_accuracy": {"steps": steps, "values": [0.2 + 0.05 * k for k in range(4)]},
            "final_train_loss": values[-1] - 0.02,
            "final_validation_loss": values[-1],
            "final_test_loss": values[-1],
            "final_test_accuracy": 0.35,
            "grad_norms": [{"step": 0, "norms": {"b0.q": 0.1, "b0.k": 0.2}}, {"step": 39, "norms": {"b0.q": 0.3}}],
            "wall_time_s": 1.0,
        }
    return {
        "task": "charlm",
        "dataset": {"name": "stdlib", "digest": "ab" * 32, "n_train": 1000, "n_validation": 100},
        "graph": {"transformer": {"depth": 2, "width": 16, "heads": 2, "seq_len": 8}},
        "runs": runs,
        "summary": {"text": "solved vs standard: validation loss"},
    }


def test_charlm_validation_page_draws_the_arms_loss_curves(service, keys, driver):
    """A finished character-level LM validation: training and validation loss curves, one line per arm."""
    from selenium.webdriver.common.by import By

    store = SqliteValidationStore(service.data_file)
    vid = "charlm" + "0" * 26
    try:
        request = {"key": keys["tat_lrelu"], "task": "charlm", "dataset": "stdlib", "steps": 40, "batch_size": 4}
        store.create(
            vid, keys["tat_lrelu"], owned({**request, "arms": ["solved", "shortcuts", "standard"]}), time.time()
        )
        assert store.start(vid, "cpu") == 1
        assert store.finish(vid, _charlm_results())
        driver.get(f"{service.base_url}/dashboard/validations/{vid}")
        for plot in ("loss-plot", "validation-loss-plot"):
            wait_for(driver, lambda d: len(rendered_lines(d, plot)) == 3, f"three lines in the {plot}")
        assert not driver.find_elements(By.ID, "accuracy-plot") and not driver.find_elements(By.ID, "c-values-plot")
        assert "Next-byte accuracy" in driver.find_element(By.TAG_NAME, "main").text
        assert not severe_console_errors(driver)
        screenshot(driver, "validation-charlm")
    finally:
        store.close()


# -- layout at 800 and 1400 px --------------------------------------------------------------------

WIDTHS = (800, 1400)


def tick_labels(driver, plot_id: str, which: str) -> list[str]:
    """The tick labels plotly drew on one axis kind (``ytick``, ``y2tick``, ...) of a plot."""
    return driver.execute_script(
        "return Array.from(document.querySelectorAll(arguments[0])).map(t => t.textContent)",
        f"#{plot_id} .{which} text",
    )


def assert_powers_of_ten(labels: list[str]) -> None:
    """One label per power of ten, written as a number (1, 0.1, 0.01, 1e-5): no 2s and 5s between."""
    import math

    assert len(labels) >= 2, labels
    for text in labels:
        value = float(text.replace("\u2212", "-"))  # plotly writes minus signs as U+2212
        assert value > 0 and abs(math.log10(value) - round(math.log10(value))) < 1e-9, labels


def rect(driver, selector: str) -> dict:
    return driver.execute_script(
        "const r = document.querySelector(arguments[0]).getBoundingClientRect();"
        "return {left: r.left, right: r.right, top: r.top, bottom: r.bottom, width: r.width};",
        selector,
    )


def at_width(driver, width: int) -> None:
    driver.set_window_size(width, 1000)
    inner = driver.execute_script("return window.innerWidth")
    driver.set_window_size(width + (width - inner), 1000)  # the viewport itself is `width` wide


# every plot drawn at its box's width (plotly's svg spans the 1 px borders too, hence 3 px of slack)
PLOTS_FIT = (
    "return Array.from(document.querySelectorAll('.js-plotly-plot')).every(p => {"
    "  const s = p.querySelector('.main-svg');"
    "  return s && Math.abs(s.getBoundingClientRect().width - p.clientWidth) <= 3;"
    "})"
)


def layout_shot(driver, name: str, width: int) -> None:
    """A screenshot at this width (the page's full height, the window grown to it), taken once
    plotly has redrawn its plots for the new size (its resize handler runs after the resize)."""
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    height = driver.execute_script("return Math.min(5000, document.documentElement.scrollHeight)")
    driver.set_window_size(width + (driver.get_window_size()["width"] - width), max(800, height + 140))
    wait_for(driver, lambda d: d.execute_script(PLOTS_FIT), "the plots to fit the new window size")
    driver.save_screenshot(str(ARTIFACTS / f"{name}-{width}.png"))
    at_width(driver, width)
    wait_for(driver, lambda d: d.execute_script(PLOTS_FIT), "the plots to fit the window again")


@pytest.mark.parametrize("width", WIDTHS)
def test_list_shows_the_hits_column_within_the_viewport(service, keys, driver, width):
    driver.get(f"{service.base_url}/dashboard")
    at_width(driver, width)
    layout_shot(driver, "list", width)  # first, so a failure leaves the picture to look at
    viewport = driver.execute_script("return document.documentElement.clientWidth")
    hits = rect(driver, "table.solutions thead th:last-child")
    assert hits["right"] <= viewport + 0.5, (hits, viewport)
    assert driver.execute_script("return document.documentElement.scrollWidth") <= viewport  # no sideways page


@pytest.mark.parametrize("width", WIDTHS)
def test_densenet_diagram_fits_its_box(service, keys, driver, width):
    driver.get(f"{service.base_url}/dashboard/solutions/{keys['densenet121']}")
    at_width(driver, width)
    layout_shot(driver, "diagram-densenet121", width)
    box, svg = rect(driver, ".diagram"), rect(driver, "#graph-svg")
    assert box["left"] - 0.5 <= svg["left"] and svg["right"] <= box["right"] + 0.5, (box, svg)
    # everything drawn lies inside the viewBox (arcs included), so nothing is cut off
    drawn, view = driver.execute_script(
        "const s = document.getElementById('graph-svg'); const b = s.getBBox(); const v = s.viewBox.baseVal;"
        "return [[b.x, b.y, b.x + b.width, b.y + b.height], [v.x, v.y, v.x + v.width, v.y + v.height]];"
    )
    assert view[0] <= drawn[0] and view[1] <= drawn[1] and drawn[2] <= view[2] and drawn[3] <= view[3], (drawn, view)


@pytest.mark.parametrize("width", WIDTHS)
def test_c_map_insets_the_solved_curve_on_its_own_scale(service, keys, driver, width):
    driver.get(f"{service.base_url}/dashboard/solutions/{keys['tat_lrelu']}")
    at_width(driver, width)
    wait_for(driver, lambda d: rendered_lines(d, "c-map"), "the C map")
    layout_shot(driver, "c-map-tat-leaky-relu", width)
    main_range, inset_range = driver.execute_script(
        "const l = document.getElementById('c-map')._fullLayout; return [l.yaxis.range, l.yaxis2 && l.yaxis2.range];"
    )
    assert main_range[1] - main_range[0] >= 2  # the main plot keeps the whole [-1, 1]
    assert inset_range and inset_range[1] - inset_range[0] < 0.5, inset_range  # eta = 0.9: about 0.83..1
    assert len(tick_labels(driver, "c-map", "y2tick")) >= 3  # the inset has a scale of its own
    assert rendered_lines(driver, "c-map")
