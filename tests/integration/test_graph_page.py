"""graph.html (`countlens.features.graph_page`) in a real browser (headless chromium, tests/browser.py),
on a pruned attribution graph of the organism with tiny transcoders trained once for the module: the
page runs without a console error and loads nothing, draws one mark per node of the JSON, and a
click (or a hover) on a node shows its panel — with the feature's card where it has one. Also
`graph_page`'s refusals, which write nothing.

Without chromium the browser tests fail where CI is set (CI always runs them) and are skipped
elsewhere, naming the packages to install.
"""

from __future__ import annotations

import json

import pytest
import torch

from countlens.datasets.tasks import task_samples
from countlens.errors import InputError
from countlens.features import attribution_graph, feature_cards, graph_json, prune
from countlens.features import graph_page as graph_page_module
from countlens.features.graph_page import graph_page
from countlens.features.scores import graph_scores


@pytest.fixture(scope="module")
def built(small_transcoders, loaded, tmp_path_factory):
    """The organism's graph of a 3-object scene (tiny transcoders), pruned, its viewer JSON, the cards
    of three of its features, and the page."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    vlm = loaded("toy")
    tcs = small_transcoders
    sample = next(s for s in task_samples("count", 64, seed=0) if s.meta["count"] == 3)
    graph = attribution_graph(vlm, tcs, sample)
    pruned = prune(graph, 0.9, 0.98)
    features = list(dict.fromkeys((layer, f) for layer, _, f in pruned.features.tolist()))[:3]
    assert features, "the pruned graph kept no feature: raise the node threshold"
    cards = feature_cards(vlm, tcs, task_samples("count", 12, seed=1), features, top=3, batch_size=12)
    path = graph_page(pruned, tmp_path_factory.mktemp("graph_page") / "graph.html", title="toy: 3 objects", cards=cards)
    torch.set_num_threads(before)
    return {"graph": graph, "pruned": pruned, "json": graph_json(pruned, "x"), "cards": cards, "path": path}


def _open(driver, path):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    driver.get(path.as_uri())
    WebDriverWait(driver, 20).until(lambda d: d.find_elements(By.CSS_SELECTOR, "#graph .node"))


def _wait_for_panel(driver, mark, node_id: str) -> None:
    """Wait (a loaded machine's renderer may lag the click) until the panel shows ``node_id``; fail
    naming what the click's point hit if it never does."""
    from selenium.common.exceptions import TimeoutException
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    def shown(d):
        return d.find_element(By.ID, "panel").is_displayed() and d.find_element(By.ID, "panel-id").text == node_id

    try:
        WebDriverWait(driver, 5).until(shown)
    except TimeoutException:
        hit = driver.execute_script(
            "const r = arguments[0].getBoundingClientRect();"
            "const e = document.elementFromPoint(r.x + r.width / 2, r.y + r.height / 2);"
            "return [r.x, r.y, r.width, r.height, e ? e.outerHTML.slice(0, 120) : null,"
            " document.getElementById('panel').hidden, document.getElementById('panel-id').textContent]",
            mark,
        )
        pytest.fail(f"a click on {node_id} left the panel unshown: rect, what its centre hits, hidden, id: {hit}")


def _panel(driver) -> dict[str, str]:
    from selenium.webdriver.common.by import By

    return {
        tr.get_attribute("data-field"): tr.find_element(By.TAG_NAME, "td").text
        for tr in driver.find_elements(By.CSS_SELECTOR, "#panel-fields tr")
    }


@pytest.mark.slow  # a browser
def test_the_page_runs_without_errors_loads_nothing_and_draws_every_node(browser, built):
    from selenium.webdriver.common.by import By

    _open(browser, built["path"])
    severe = [entry for entry in browser.get_log("browser") if entry["level"] == "SEVERE"]
    assert not severe, severe
    loaded = browser.execute_script("return performance.getEntriesByType('resource').map(e => e.name)")
    assert not [name for name in loaded if not name.startswith(("data:", "file:"))], loaded
    marks = browser.find_elements(By.CSS_SELECTOR, "#graph .node")
    assert len(marks) == len(built["json"]["nodes"])
    assert sorted(m.get_attribute("data-id") for m in marks) == sorted(n["node_id"] for n in built["json"]["nodes"])
    assert len(browser.find_elements(By.CSS_SELECTOR, "#graph .link")) == len(built["json"]["links"])
    assert built["path"].stat().st_size < 1_000_000


@pytest.mark.slow  # a browser
def test_a_click_on_a_node_shows_its_panel(browser, built):
    from selenium.webdriver.common.by import By

    _open(browser, built["path"])
    assert not browser.find_element(By.ID, "panel").is_displayed()
    nodes = built["json"]["nodes"]
    kinds = {}
    for n in nodes:
        kinds.setdefault(n["feature_type"], n)
    image = next(n for n in nodes if n["clerp"].startswith("image cell"))
    for node in [*kinds.values(), image]:
        mark = browser.find_element(By.CSS_SELECTOR, f'#graph .node[data-id="{node["node_id"]}"]')
        # Centred first, which scrolls the page: the panel's height as it changes from node to node must
        # not move a scrolled page under the pointer between the click's press and release.
        browser.execute_script("arguments[0].scrollIntoView({block: 'center', inline: 'center'})", mark)
        mark.click()
        _wait_for_panel(browser, mark, node["node_id"])
        shown = _panel(browser)
        assert shown["node_id"] == node["node_id"] and shown["position"] == str(node["ctx_idx"])
        assert shown["token"] == built["json"]["metadata"]["prompt_tokens"][node["ctx_idx"]]
        if node["feature_type"] == "cross layer transcoder":
            assert float(shown["activation"]) == pytest.approx(node["activation"], rel=1e-3)
            assert shown["feature"] == node["node_id"].split("_")[1]
    row, col = built["pruned"].cells[image["ctx_idx"]].tolist()
    assert _panel(browser)["cell"] == f"({row}, {col})"  # the last click: the image token's embedding
    obj = int(built["pruned"].objects[image["ctx_idx"]])
    assert _panel(browser)["object"] == (str(obj) if obj >= 0 else "none")
    # A click on the background unpins; a hover shows a node again.
    browser.find_element(By.ID, "graph").click()
    assert not browser.find_element(By.ID, "panel").is_displayed()
    from selenium.webdriver.common.action_chains import ActionChains

    logit = next(n for n in nodes if n["feature_type"] == "logit")
    ActionChains(browser).move_to_element(
        browser.find_element(By.CSS_SELECTOR, f'#graph .node[data-id="{logit["node_id"]}"]')
    ).perform()
    assert browser.find_element(By.ID, "panel-id").text == logit["node_id"]
    assert "Output" in _panel(browser)["clerp"]


@pytest.mark.slow  # a browser
def test_a_feature_with_a_card_shows_it(browser, built):
    from selenium.webdriver.common.by import By

    _open(browser, built["path"])
    cards = built["cards"]
    name = str(cards.card.values[0])
    layer, f = int(cards.layer[0]), int(cards.feature[0])
    node = next(n for n in built["json"]["nodes"] if n["node_id"].startswith(f"{layer}_{f}_"))
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support.ui import WebDriverWait

    # Pinned from the keyboard (each mark is a focusable button): the pointer the shared browser's
    # earlier tests left over some node plays no part; clicks are the panel test's.
    browser.find_element(By.CSS_SELECTOR, f'#graph .node[data-id="{node["node_id"]}"]').send_keys(Keys.ENTER)
    WebDriverWait(browser, 10).until(lambda d: d.find_element(By.ID, "panel-id").text == node["node_id"])
    assert browser.find_element(By.ID, "panel-card").is_displayed()
    card = {
        tr.get_attribute("data-field"): tr.find_element(By.TAG_NAME, "td").text
        for tr in browser.find_elements(By.CSS_SELECTOR, "#card-fields tr")
    }
    c = cards.sel(card=name)
    assert card["card"] == name
    assert card["top scenes"] == ", ".join(str(int(s)) for s in c.scene.values)
    shown = [float(v) for v in card["max activation"].split(", ")]
    assert shown == pytest.approx(c.max_activation.values.tolist(), rel=1e-3)
    assert float(card["ablated Δ log p"]) == pytest.approx(float(c.ablated), rel=1e-3, abs=1e-9)
    direct = browser.find_elements(By.CSS_SELECTOR, "#card-direct tr[data-field]")
    assert [tr.get_attribute("data-field") for tr in direct] == [str(int(n)) for n in cards["count"].values]
    # A feature without a card (or an error node) hides the card.
    other = next(n for n in built["json"]["nodes"] if n["feature_type"] == "mlp reconstruction error")
    browser.find_element(By.CSS_SELECTOR, f'#graph .node[data-id="{other["node_id"]}"]').click()
    assert not browser.find_element(By.ID, "panel-card").is_displayed()


def test_graph_page_refuses_what_it_cannot_draw_and_writes_nothing(built, tmp_path, monkeypatch):
    page = tmp_path / "page.html"
    data = built["json"]
    cases = [
        ((built["graph"], page), "prune it first"),  # the whole graph: hundreds of thousands of links
        (({"nodes": []}, page), "viewer JSON"),
        (({**data, "links": [{"source": "nope", "target": "nope", "weight": 1.0}]}, page), "does not join"),
        (({**data, "nodes": data["nodes"] + data["nodes"][:1]}, page), "appears twice"),
        (({**data, "nodes": [{**data["nodes"][0], "feature_type": "sae"}]}, page), "not a viewer node"),
        ((tmp_path / "missing.json", page), "is no file"),
        ((data, tmp_path), "is a folder"),
        ((data, page, "  "), "title must be a non-empty string"),
        ((data, page, None, {"L0F1": 1}), "feature_cards"),
        ((data, page, None, built["cards"].drop_vars("ablated")), "lacks ['ablated']"),
    ]
    for args, message in cases:
        with pytest.raises(InputError) as err:
            graph_page(*args)
        assert message in str(err.value), (message, str(err.value))
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(InputError, match="cannot be read as JSON"):
        graph_page(bad, page)
    monkeypatch.setattr(graph_page_module, "MAX_LINKS", 10)
    with pytest.raises(InputError, match="prune it harder"):
        graph_page(built["pruned"], page)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.json"]


def test_the_page_from_the_json_file_is_the_page_from_the_graph(built, tmp_path):
    (tmp_path / "graph.json").write_text(json.dumps(built["json"]))
    from_file = graph_page(tmp_path / "graph.json", tmp_path / "a.html", title="t")
    from_graph = graph_page(built["pruned"], tmp_path / "b.html", title="t")
    # but for the graph scores, which only a graph carries (the viewer JSON has no place for them)
    scores = graph_scores(built["pruned"])
    row = f"replacement {scores['replacement']:.4g}, completeness {scores['completeness']:.4g}"
    assert row in from_graph.read_text() and "replacement –, completeness –" in from_file.read_text()
    assert from_file.read_text() == from_graph.read_text().replace(row, "replacement –, completeness –")
