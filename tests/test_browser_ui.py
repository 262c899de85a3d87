"""The ToMe accordion in a real browser: the Script's ``ui()`` built with real gradio 3.41.2, served on 127.0.0.1
and driven by headless Chromium through playwright.

What runs: the webui double (``tests/webui_double``, its ``host.Webui``) loads the extension's scripts as the
webui does and builds both tabs in one real ``gr.Blocks``: the real ToMe Script's ``ui(False)`` in "txt2img"
and ``ui(True)`` in "img2img" (next to the X/Y/Z plot's controls). The test adds a test-only button per tab
that sends the ToMe controls' values to Python and shows them. The webui's own javascript is not on
the page (in the webui, inputAccordion.js injects a checkbox into the accordion's header), so this tests what
gradio renders: the accordion under the Script's elem_id, its hidden checkbox, the controls and their events.
The extension's ``javascript/*.js`` is injected the way the webui loads it (after its ``titles`` object).

It writes ``out/browser-accordion.png`` (git-ignored; the README's picture is taken in the real WebUI): the
txt2img accordion open, with its "Advanced" panel open.

Chromium (``/usr/bin/chromium``, or ``$TOME_CHROMIUM``) and the ``playwright`` package are required: the test
fails, not skips, without them. Never run ``playwright install``; the system's Chromium is used.
"""

from __future__ import annotations

import glob
import json
import os
import socket
import sys
import re
import threading
from urllib.parse import urlsplit

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = os.path.join(ROOT, "tests")
SCREENSHOT = os.path.join(ROOT, "out", "browser-accordion.png")
CHROMIUM = os.environ.get("TOME_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
VIEWPORT = {"width": 900, "height": 1000}
TIMEOUT_MS = 15_000

if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

from tome_core import settings as tm  # noqa: E402

TABS = ("txt2img", "img2img")
SCRIPT_TITLE = "ToMe"


# -- the app ------------------------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class App:
    """The served page: its URL, each control's elem_id per tab, and what the test buttons sent to Python."""

    def __init__(self) -> None:
        self.url = ""
        self.ids: dict[str, dict[str, str]] = {}
        self.received: dict[str, list] = {}
        self.calls = 0
        self.lock = threading.Lock()

    def take(self, tab: str) -> list | None:
        with self.lock:
            return self.received.pop(tab, None)


@pytest.fixture(scope="module")
def app():
    """The double webui with this extension (its scripts loaded, both tabs built in a real gr.Blocks), plus a
    test-only button per tab that sends the ToMe controls' values to Python and shows them; served on
    127.0.0.1 at a free port."""
    if TESTS not in sys.path:
        sys.path.insert(0, TESTS)
    import webui_double
    if not webui_double.install():
        pytest.skip("a real webui's modules are importable here; this test drives the double")
    import gradio as gr
    from modules import errors
    from webui_double.host import Webui

    served = App()
    errors.reported.clear()
    webui = Webui(ROOT)
    try:
        assert errors.reported == [], "loading the scripts or building their UI raised"
        def reader(tab: str):
            def read(*values):
                with served.lock:
                    served.received[tab] = list(values)
                    served.calls += 1
                    call = served.calls
                # The call number makes each answer differ from the last, so the page can wait for it.
                return json.dumps({"call": call, "values": dict(zip(tm.KEYS, values))})
            return read

        # Back into the webui's Blocks, to add the test's own components below the tabs.
        with webui.blocks:
            for tab in TABS:
                script = webui.script(tab, SCRIPT_TITLE)
                assert script.controls is not None and len(script.controls) == len(tm.KEYS), \
                    "ui() must return one component per parameter"
                served.ids[tab] = {key: script.elem_id(key) for key in (*tm.KEYS, "ratio_note", "advanced")}
                with gr.Row():
                    button = gr.Button(f"Send {tab} values to Python (test only)", elem_id=f"test_read_{tab}")
                    output = gr.Textbox(label=f"{tab} values Python received", elem_id=f"test_values_{tab}")
                button.click(reader(tab), inputs=list(script.controls), outputs=[output], queue=False)

        last_error = None
        for _ in range(5):  # another process may take the free port between the check and the bind
            port = _free_port()
            try:
                webui.blocks.launch(server_name="127.0.0.1", server_port=port, prevent_thread_lock=True,
                                    quiet=True, show_api=False, share=False, inbrowser=False)
                break
            except OSError as error:
                last_error = error
        else:
            pytest.fail(f"gradio could not serve on a free port: {last_error}")
        try:
            served.url = f"http://127.0.0.1:{port}/"
            yield served
        finally:
            webui.blocks.close()
    finally:
        webui.unload()


# -- the browser ---------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def browser():
    try:
        from playwright.sync_api import sync_playwright
    except ImportError as error:
        pytest.fail(f"the playwright package is required (pip install playwright==1.47.0; never "
                    f"'playwright install'): {error}")
    if not os.access(CHROMIUM, os.X_OK):
        pytest.fail(f"Chromium is required at {CHROMIUM} (Debian: apt-get install chromium; or set $TOME_CHROMIUM)")
    playwright = sync_playwright().start()
    try:
        chromium = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        try:
            yield chromium
        finally:
            chromium.close()
    finally:
        playwright.stop()


# Stand-ins for the webui's page globals the extension's javascript may use (A hints.js, script.js), loaded
# before the extension's files as the webui loads its own javascript first.
WEBUI_GLOBALS_JS = """
var titles = {};
var tomeTestCallbacks = {uiLoaded: [], uiUpdate: [], afterUiUpdate: [], uiTabChange: [], optionsChanged: []};
function onUiLoaded(callback) { tomeTestCallbacks.uiLoaded.push(callback); }
function onUiUpdate(callback) { tomeTestCallbacks.uiUpdate.push(callback); }
function onAfterUiUpdate(callback) { tomeTestCallbacks.afterUiUpdate.push(callback); }
function onUiTabChange(callback) { tomeTestCallbacks.uiTabChange.push(callback); }
function onOptionsChanged(callback) { tomeTestCallbacks.optionsChanged.push(callback); }
function gradioApp() {
    const app = document.getElementsByTagName('gradio-app')[0];
    return app ? (app.shadowRoot || app) : document;
}
"""


def extension_javascript() -> list[str]:
    return sorted(glob.glob(os.path.join(ROOT, "javascript", "*.js")))


def webui_head() -> str:
    """What the webui puts into the page's <head>: its own javascript (here the stand-ins above), then each
    extension's ``javascript/*.js`` as a classic script, so that top-level declarations are page globals."""
    scripts = [WEBUI_GLOBALS_JS]
    for path in extension_javascript():
        with open(path, encoding="utf-8") as file:
            source = file.read()
        assert "</script" not in source.lower(), f"{path} cannot be inlined into the page"
        scripts.append(f"{source}\n//# sourceURL={os.path.basename(path)}\n")
    return "".join(f'<script type="text/javascript">{source}</script>\n' for source in scripts)


@pytest.fixture
def page(app, browser):
    head = webui_head()
    context = browser.new_context(viewport=VIEWPORT, device_scale_factor=1, color_scheme="light")
    try:
        def route(route):
            request = route.request
            if urlsplit(request.url).hostname not in ("127.0.0.1", "localhost"):
                # Nothing leaves the machine: gradio's theme asks for web fonts, which would only time out.
                route.abort()
            elif request.resource_type == "document":
                response = route.fetch()
                html = response.text()
                html = html.replace("</head>", head + "</head>", 1) if "</head>" in html else head + html
                route.fulfill(response=response, body=html)
            else:
                route.continue_()
        context.route("**/*", route)
        context.set_default_timeout(TIMEOUT_MS)
        tab = context.new_page()
        tab.errors = []
        tab.tome_ids = app.ids
        tab.on("pageerror", lambda error: tab.errors.append(str(error)))
        tab.goto(app.url, wait_until="domcontentloaded")
        tab.locator(f"#{app.ids['txt2img']['enabled']}").wait_for(state="visible")
        # The webui runs its onUiLoaded callbacks once the UI exists, the others on DOM changes.
        tab.evaluate("""() => {
            tomeTestCallbacks.uiLoaded.forEach(callback => callback());
            tomeTestCallbacks.uiUpdate.forEach(callback => callback([]));
            tomeTestCallbacks.afterUiUpdate.forEach(callback => callback());
        }""")
        yield tab
        assert tab.errors == [], f"javascript errors on the page: {tab.errors}"
    finally:
        context.close()


# -- helpers -------------------------------------------------------------------------------------------------------


def control(page, tab: str, key: str):
    # .first: gradio 3.41 gives a Markdown's elem_id both to its block and to its inner element.
    return page.locator(f"#{page.tome_ids[tab][key]}").first


def open_accordion(page, tab: str, key: str) -> None:
    """Click the header of the accordion with the elem_id of ``key`` and wait until its body shows."""
    accordion = control(page, tab, key)
    header = accordion.locator(".label-wrap").first
    assert "open" not in (header.get_attribute("class") or "").split(), f"{key} accordion is already open"
    header.click()
    page.wait_for_function("(h) => h.classList.contains('open')", arg=header.element_handle())


def set_number(page, tab: str, key: str, value: float) -> None:
    """Type ``value`` into a slider's number box, as a user does, and leave the field."""
    box = control(page, tab, key).locator("input[type=number]")
    box.fill(str(value))
    box.press("Tab")


def send_values(page, app: App, tab: str) -> dict:
    """Click the test button; return the values Python received, keyed by parameter, once the page shows them."""
    app.take(tab)
    output = page.locator(f"#test_values_{tab} textarea")
    before = output.input_value()
    page.locator(f"#test_read_{tab}").click()
    page.wait_for_function("([el, before]) => el.value !== before", arg=[output.element_handle(), before])
    shown = json.loads(output.input_value())["values"]
    received = app.take(tab)
    assert received is not None, "the button's values did not reach Python"
    values = dict(zip(tm.KEYS, received))
    assert shown == json.loads(json.dumps(values)), "the page shows other values than Python received"
    return values


# -- tests ---------------------------------------------------------------------------------------------------------


def test_accordion_is_rendered_closed_with_its_hidden_checkbox(page):
    for tab in TABS:
        accordion = control(page, tab, "enabled")
        assert accordion.count() == 1
        assert "input-accordion" in accordion.get_attribute("class").split()
        # The InputAccordion's value lives in a hidden checkbox next to the accordion.
        checkbox = page.locator(f"#{page.tome_ids[tab]['enabled']}-checkbox")
        assert checkbox.count() == 1
        assert not checkbox.is_visible()
    accordion = control(page, "txt2img", "enabled")
    assert accordion.locator(".label-wrap").first.inner_text().strip().startswith(tm.PARAM["enabled"].label)
    # Disabled by default, so closed: the controls are not shown.
    assert not control(page, "txt2img", "ratio").is_visible()


def test_accordions_open_and_show_controls_screenshot(page):
    tab = "txt2img"
    open_accordion(page, tab, "enabled")
    for key in ("ratio", "hr_only", "hr_ratio"):
        expect_visible(control(page, tab, key), key)
    assert tm.PARAM["ratio"].label in control(page, tab, "ratio").inner_text()
    other_methods = [key for method, keys in tm.METHOD_KEYS.items() if method != "tome" for key in keys
                     if key not in tm.METHOD_KEYS["tome"]]
    advanced_keys = [key for key in tm.KEYS if key not in ("enabled", "ratio", "hr_only", "hr_ratio")
                     and key not in other_methods]
    # "Advanced" is closed at first.
    expect_visible(control(page, tab, "advanced"), "advanced")
    for key in advanced_keys:
        assert not control(page, tab, key).is_visible(), f"{key} shows while Advanced is closed"
    open_accordion(page, tab, "advanced")
    for key in advanced_keys:
        expect_visible(control(page, tab, key), key)
        assert tm.PARAM[key].label in control(page, tab, key).inner_text(), f"{key} lacks its label"
    for key in other_methods:  # ToMe is chosen: ToDo's and the local method's own controls wait
        assert not control(page, tab, key).is_visible(), f"{key} shows while ToMe is chosen"

    os.makedirs(os.path.dirname(SCREENSHOT), exist_ok=True)
    page.mouse.move(0, 0)
    control(page, tab, "enabled").screenshot(path=SCREENSHOT, animations="disabled")
    from PIL import Image
    with Image.open(SCREENSHOT) as image:
        assert image.width >= 600 and image.height >= 600, f"the screenshot is only {image.size}"
        gray = image.convert("L")
        low, high = gray.getextrema()
        assert high - low > 100 and len(gray.getcolors(maxcolors=1 << 16)) > 20, "the screenshot looks blank"


def expect_visible(locator, what: str) -> None:
    try:
        locator.wait_for(state="visible", timeout=5_000)
    except Exception as error:  # playwright's TimeoutError
        raise AssertionError(f"{what} does not show: {error}") from None


def test_controls_take_input_and_reach_python(page, app):
    tab = "txt2img"
    open_accordion(page, tab, "enabled")
    open_accordion(page, tab, "advanced")
    values = send_values(page, app, tab)
    assert tm.parse_args(list(values.values())) == tm.DISABLED, "the controls start at the defaults"

    # A ratio above the 2x2 stride's cap (0.75): the panel says what will be used.
    note = control(page, tab, "ratio_note")
    assert not note.is_visible()
    set_number(page, tab, "ratio", 0.8)
    expect_visible(note, "the ratio note")
    page.wait_for_function("(el) => el.innerText.includes('0.75')", arg=note.element_handle())
    assert "0.8" in note.inner_text()

    control(page, tab, "merge_mlp").locator("input[type=checkbox]").check()
    control(page, tab, "use_rand").locator("input[type=checkbox]").uncheck()
    set_number(page, tab, "sx", 3)  # cap 1 - 1/6: 0.8 is allowed, the note goes
    note.wait_for(state="hidden")
    # The local method: its own control shows, ToMe's stride and partition hide; its 2×2 cap brings the note.
    control(page, tab, "method").get_by_text("Local", exact=True).click()
    expect_visible(control(page, tab, "local_replan"), "local_replan")
    control(page, tab, "sx").wait_for(state="hidden")
    assert not control(page, tab, "use_rand").is_visible() and not control(page, tab, "todo_pool").is_visible()
    expect_visible(note, "the ratio note of the local method")
    set_number(page, tab, "local_replan", 3)
    control(page, tab, "method").get_by_text("ToDo", exact=True).click()
    expect_visible(control(page, tab, "todo_pool"), "todo_pool")
    control(page, tab, "local_replan").wait_for(state="hidden")
    note.wait_for(state="hidden")
    control(page, tab, "todo_pool").get_by_text("average", exact=True).click()
    control(page, tab, "max_downsample").get_by_text("2", exact=True).click()
    set_number(page, tab, "step_end", 0.6)

    values = send_values(page, app, tab)
    assert values["ratio"] == pytest.approx(0.8)
    assert values["merge_mlp"] is True and values["use_rand"] is False
    assert values["method"] == "ToDo" and values["todo_pool"] == "average" and values["max_downsample"] == "2"
    assert values["sx"] == 3 and values["step_end"] == pytest.approx(0.6)
    assert values["local_replan"] == 3  # hidden controls keep their values
    # The hidden checkbox's value arrives as a bool. (Opening the accordion ticks it only through the webui's
    # inputAccordion.js, which is not on this page, so its value is not asserted.)
    assert isinstance(values["enabled"], bool)
    settings = tm.parse_args(list(values.values()))
    assert settings.method == "todo" and settings.max_downsample == 2 and settings.todo_pool == "average"
    assert settings.pass_ratio(hires=False) == pytest.approx(0.8)


def test_img2img_accordion_hides_the_hires_controls(page, app):
    tab = "img2img"
    page.locator(".tab-nav button").filter(has_text=re.compile(r"^\s*img2img\s*$")).click()
    expect_visible(control(page, tab, "enabled"), "the img2img accordion")
    open_accordion(page, tab, "enabled")
    expect_visible(control(page, tab, "ratio"), "ratio")
    for key in ("hr_only", "hr_ratio"):
        assert not control(page, tab, key).is_visible(), f"{key} shows in img2img"
    set_number(page, tab, "ratio", 0.3)
    values = send_values(page, app, tab)
    assert len(values) == len(tm.KEYS)
    assert values["ratio"] == pytest.approx(0.3)
    assert values["hr_only"] is False and values["hr_ratio"] == 0


def test_every_control_label_has_a_hover_hint(page):
    files = extension_javascript()
    assert files, "javascript/*.js (the hover hints) is missing"
    labels = [param.label for param in tm.PARAMS]
    missing = page.evaluate("(labels) => labels.filter(label => typeof titles[label] !== 'string' "
                            "|| titles[label].trim() === '')", labels)
    assert missing == [], f"no hover hint in {', '.join(map(os.path.basename, files))} for: {missing}"
