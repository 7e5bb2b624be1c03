"""`rlvr report`: the data behind the page, the PNG, and the page itself in headless Chromium."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from rlvr.cli import main
from rlvr.config import load_config
from rlvr.log.sinks import read_jsonl
from rlvr.report import build_data, write_html, write_png
from rlvr.train.loop import train
from tests.test_train import overrides


@pytest.fixture(scope="module")
def run_dir(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Three steps of the tiny model, with truncated completions masked (8 new tokens rarely end
    on EOS) and held-out pass@k every step; the loop writes the report at the end."""
    out = tmp_path_factory.mktemp("report")
    train(load_config(None, [*overrides(tiny_dir, out, "reported"), "train.steps=3", "algo.mask_truncated=true",
                             "train.eval_every=1", "train.eval_samples=2"]), quiet=True)
    return out / "reported"


def page_data(html: Path) -> dict[str, Any]:
    text = html.read_text()
    start = text.index('<script id="report-data" type="application/json">') + len(
        '<script id="report-data" type="application/json">')
    return json.loads(text[start : text.index("</script>", start)])


def test_training_ends_with_the_report_and_the_png(run_dir: Path) -> None:
    assert (run_dir / "report.html").stat().st_size > 10_000
    assert (run_dir / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    data = page_data(run_dir / "report.html")
    titles = [p["title"] for p in data["panels"]]
    for title in ("Reward", "Accuracy and held-out pass@k", "Response length (tokens)", "Token entropy",
                  "Clip fractions", "Zero-std groups, truncation, masking", "Throughput (tokens/s)"):
        assert title in titles
    accuracy = next(p for p in data["panels"] if p["title"].startswith("Accuracy"))
    assert {"accuracy", "eval/accuracy", "eval/pass@1", "eval/pass@2"} <= set(accuracy["keys"])
    # the evaluation before training is step 0; every step has a row
    assert [r["step"] for r in data["metrics"]] == [0, 1, 2, 3]
    assert sorted(map(int, data["rollouts"])) == [1, 2, 3]
    group = data["rollouts"]["3"][0]
    assert len(group["samples"]) == 4 and group["prompt"]
    masked = [s for g in data["rollouts"]["3"] for s in g["samples"] if s["masked"]]
    assert masked, "truncated completions under algo.mask_truncated must be marked"
    for s in masked:
        assert s["finish_reason"] == "length" and s["masked"] == [[0, len(s["completion"]), "truncated"]]
    assert "[algo]" in data["config_text"]


def test_pass_at_k_during_training_is_monotone_and_pass_at_1_is_sampled_accuracy(run_dir: Path) -> None:
    rows = read_jsonl(run_dir / "metrics.jsonl")
    for r in rows:
        assert 0 <= r["eval/pass@1"] <= r["eval/pass@2"] <= 1


def test_rollout_browser_keeps_first_and_last_steps_when_capped(tmp_path: Path) -> None:
    rows = [{"step": s, "prompt_id": "p", "prompt": "q", "completion": f"c{s}", "reward": 0.0} for s in range(1, 11)]
    (tmp_path / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "metrics.jsonl").write_text("")
    data = build_data(tmp_path, max_steps=4)
    assert sorted(data["rollouts"]) == [1, 4, 7, 10]
    assert "4 of the 10 logged steps" in data["rollout_note"]


def test_a_half_written_last_line_is_ignored_and_a_broken_one_is_named(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "reward": 0.5}\n{"step": 2, "rew')
    assert read_jsonl(path) == [{"step": 1, "reward": 0.5}]
    path.write_text('{"step": 1}\n{broken\n{"step": 3}\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl:2"):
        read_jsonl(path)


def hostile_run(tmp_path: Path) -> Path:
    """A run whose completions try to end the page's <script> element."""
    metrics = [{"step": 1, "reward": 0.5, "entropy": 1.0}, {"step": 2, "reward": 0.7, "entropy": None},
               {"step": 3, "reward": 0.6, "entropy": 0.8}]  # None: a non-finite value, drawn as a gap
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in metrics))
    rows = [{"step": 1, "prompt_id": "p0", "prompt": "<b>bold?</b>", "reward": r, "advantage": a,
             "completion": text, "finish_reason": "stop", "completion_tokens": 5, "masked": []}
            for r, a, text in [(1.0, 1.0, "</script><script>document.title='owned'</script>"),
                               (0.0, -1.0, "<!-- <img src=x onerror=alert(1)>")]]
    (tmp_path / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return tmp_path


def test_completions_cannot_end_the_data_script(tmp_path: Path) -> None:
    html = write_html(hostile_run(tmp_path)).read_text()
    data_section = html[html.index('id="report-data"') : html.index("</script>", html.index('id="report-data"'))]
    assert "<" not in data_section.removeprefix('id="report-data" type="application/json">')
    assert page_data(tmp_path / "report.html")["rollouts"]["1"][0]["samples"][0]["completion"].startswith("</script>")


def test_cli_writes_both_files_and_rejects_a_non_run(run_dir: Path, tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "r.html"
    assert main(["report", str(run_dir), "--out", str(out), "--max-steps", "2"]) == 0
    assert sorted(map(int, page_data(out)["rollouts"])) == [1, 3]
    assert main(["report", str(tmp_path / "nothing")]) == 2
    assert "not a run directory" in capsys.readouterr().err


def test_png_needs_metrics(tmp_path: Path) -> None:
    (tmp_path / "metrics.jsonl").write_text("")
    with pytest.raises(ValueError, match="no metrics"):
        write_png(tmp_path)


# --- in a real browser -----------------------------------------------------------------------

def _find(*names: str) -> str | None:
    return next((p for p in map(shutil.which, names) if p), None)


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    chromium = _find("chromium", "chromium-browser", "google-chrome")
    driver_path = _find("chromedriver")
    if not chromium or not driver_path:
        message = "headless Chromium and chromedriver are needed (make setup installs chromium and chromium-driver)"
        if os.environ.get("RLVR_REQUIRE_BROWSER"):
            pytest.fail(message)
        pytest.skip(message)
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1400,1800"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(driver_path), options=options)
    yield driver
    driver.quit()


def open_page(browser: Any, html: Path) -> list[dict[str, Any]]:
    """Load the page and return its console errors (everything logged at SEVERE)."""
    browser.get(html.resolve().as_uri())
    assert browser.execute_script("return document.body.dataset.rendered") == "true", "the page script did not finish"
    return [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]


def test_report_renders_in_headless_chromium(browser: Any, run_dir: Path) -> None:
    from selenium.webdriver.common.by import By

    html = run_dir / "report.html"
    assert open_page(browser, html) == []
    js = browser.execute_script
    # every panel drew its lines: a path with points for each series that has data
    charts = browser.find_elements(By.CSS_SELECTOR, "#panels .chart")
    assert len(charts) >= 7
    drawn = js("return [...document.querySelectorAll('#panels path.series')].filter(p => p.getAttribute('d')"
               ".includes('L')).length")
    assert drawn >= 7
    # the browser shows the last step, every group, and the masked completions marked
    assert browser.find_element(By.ID, "step").get_attribute("value") == "3"
    groups = browser.find_elements(By.CSS_SELECTOR, "#groups .group")
    assert len(groups) == 4
    assert len(browser.find_elements(By.CSS_SELECTOR, "#groups tr.sample")) == 16
    marks = browser.find_elements(By.CSS_SELECTOR, "mark.masked")
    assert marks and "truncated" in marks[0].get_attribute("title")
    # stepping back shows step 2's groups; the prompt filter hides non-matching ones
    first_prompt = groups[0].find_element(By.CSS_SELECTOR, ".prompt").text
    browser.find_element(By.ID, "prev").click()
    assert browser.find_element(By.ID, "step").get_attribute("value") == "2"
    box = browser.find_element(By.ID, "filter")
    box.send_keys("no prompt contains this")
    assert browser.find_elements(By.CSS_SELECTOR, "#groups .group") == []
    assert "0 of 4 groups shown" in browser.find_element(By.ID, "rollout-note").text
    assert first_prompt
    # hovering a chart shows the step readout
    from selenium.webdriver.common.action_chains import ActionChains

    ActionChains(browser).move_to_element(charts[0].find_element(By.TAG_NAME, "svg")).perform()
    assert "step" in charts[0].find_element(By.CLASS_NAME, "tip").text
    assert open_page(browser, html) == []  # still nothing logged
    shot = Path(os.environ.get("RLVR_SCREENSHOT_DIR", run_dir)) / "report-screenshot.png"
    shot.parent.mkdir(parents=True, exist_ok=True)
    assert browser.save_screenshot(str(shot)) and shot.stat().st_size > 10_000


def test_hostile_completions_are_shown_as_text(browser: Any, tmp_path: Path) -> None:
    from selenium.webdriver.common.by import By

    html = write_html(hostile_run(tmp_path))
    assert open_page(browser, html) == []
    assert browser.title.startswith("rlvr report")  # the injected script did not run
    cells = [c.text for c in browser.find_elements(By.CSS_SELECTOR, "td.text")]
    assert cells[0].startswith("</script><script>") and cells[1].startswith("<!-- <img")
    assert browser.find_elements(By.CSS_SELECTOR, "#groups img") == []


def test_episode_metrics_get_their_own_panels(tmp_path: Path) -> None:
    rows = [{"step": s, "reward": 0.1 * s, "env/turns": 2.0, "env/tool_calls": 1.0 + s, "env/tool_error_rate": 0.5,
             "env/ending/done": 0.25, "env/ending/max_turns": 0.75} for s in (1, 2)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = build_data(tmp_path)
    panels = {p["title"]: p["keys"] for p in data["panels"]}
    assert panels["Episodes: turns and tool use"] == ["env/turns", "env/tool_calls"]
    assert panels["Episodes: tool errors and endings"] == ["env/tool_error_rate", "env/ending/done",
                                                           "env/ending/max_turns"]
