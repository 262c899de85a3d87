"""The nodes in ComfyUI's own page, in headless Chromium (Debian's, driven by playwright): a workflow with the
advanced node between the checkpoint and the KSampler is loaded as the page loads a saved one, and each node
shows its inputs as widgets. The screenshot is the README's picture (written to ``docs/images`` when
``TOKENMERGE_SCREENSHOTS`` names that folder)."""

from __future__ import annotations

import os
import shutil

import pytest

from comfy_server import advanced, workflow

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]


@pytest.fixture(scope="module")
def page(pack, server):  # the pack loaded first: playwright runs an event loop of its own
    playwright = pytest.importorskip("playwright.sync_api")
    if not os.path.exists(CHROMIUM):
        pytest.fail("Debian's chromium is needed for the browser test (tests/run.sh installs it)")
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        page = browser.new_page(viewport={"width": 1560, "height": 960})
        page.goto(server.url, wait_until="load", timeout=120_000)
        page.wait_for_function("() => window.app && window.app.graph && window.LiteGraph", timeout=120_000)
        yield page
        browser.close()


def test_the_advanced_node_shows_every_input_in_comfyuis_page(page, tmp_path):
    graph = workflow(merge=advanced(method="Cache"))
    page.evaluate("async (graph) => { await window.app.loadApiJson(graph, 'tokenmerge.json'); }", graph)
    page.wait_for_timeout(1500)
    nodes = page.evaluate("""() => window.app.graph._nodes.map(n => ({
        type: n.type, title: n.title, widgets: (n.widgets || []).map(w => [w.name, w.value]),
        inputs: (n.inputs || []).map(i => i.name)}))""")
    ours = [n for n in nodes if n["type"] == "TokenMergingAdvanced"]
    assert len(ours) == 1
    node = ours[0]
    assert node["title"] == "Token Merging (ToMe, advanced)"
    names = [name for name, _ in node["widgets"]]
    for key in ("ratio", "method", "max_downsample", "todo_factor", "step_start", "step_end", "cache_interval",
                "cache_warmup", "size_weighted_keys"):
        assert key in names
    assert dict(node["widgets"])["method"] == "Cache"
    assert "model" in node["inputs"]
    # Arrange the workflow for the picture: loaders and prompts left, the node, then the sampler and its output.
    page.evaluate("""() => {
        const g = window.app.graph, spots = {
            CheckpointLoaderSimple: [[20, 60]], CLIPTextEncode: [[20, 230], [20, 470]], EmptyLatentImage: [[20, 700]],
            TokenMergingAdvanced: [[400, 60]], KSampler: [[780, 60]], VAEDecode: [[1120, 60]], SaveImage: [[1120, 170]]};
        for (const n of g._nodes) { const free = spots[n.type]; if (free && free.length) { n.pos = free.shift(); } }
        window.app.canvas.ds.offset = [0, 0]; window.app.canvas.ds.scale = 1;
        window.app.canvas.setDirty(true, true);
    }""")
    page.wait_for_timeout(800)
    shot = tmp_path / "comfyui-node.png"
    page.screenshot(path=str(shot))
    assert shot.stat().st_size > 10_000
    target = os.environ.get("TOKENMERGE_SCREENSHOTS")
    if target:
        shutil.copy(shot, os.path.join(target, "comfyui-node.png"))


def test_the_simple_node_can_be_added_from_its_type(page):
    widgets = page.evaluate("""() => {
        const node = window.LiteGraph.createNode('TokenMerging');
        window.app.graph.add(node);
        return node.widgets.map(w => [w.name, w.value]);
    }""")
    assert widgets == [["method", "Recommended"], ["ratio", 0.5]]
