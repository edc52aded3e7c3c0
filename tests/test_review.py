"""The review report's figures and page (training/evaluation/review.py), against scikit-learn,
scipy and hand counts, on real image files."""

from __future__ import annotations

import base64
import io
import re

import numpy as np
import pytest
from PIL import Image
from scipy.stats import binomtest
from sklearn.metrics import f1_score

from tests.imagegen import write_folder_layout
from training.evaluation.review import ModelAnswers, compare, summary_markdown, write_review

NAMES = ["cat", "dog", "fox"]


@pytest.fixture
def answers():
    """90 test images, 30 per class; the challenger and the champion wrong on different ones,
    and one image the champion could not read."""
    truth = np.repeat([0, 1, 2], 30)
    challenger, champion = truth.copy(), truth.copy()
    challenger[[0, 1, 2, 31, 62]] = [1, 1, 2, 0, 0]
    champion[[5, 6, 31, 32, 33, 34, 60]] = [2, 1, 2, 2, 0, 0, 1]
    champion[70] = -1
    return truth, [ModelAnswers("challenger v2", challenger, np.full(90, 0.9)),
                   ModelAnswers("champion v1", champion, np.linspace(0.4, 1.0, 90))]


def test_the_figures_match_scikit_learn_scipy_and_a_hand_count(answers):
    truth, models = answers
    figures = compare(truth, models, NAMES, bootstrap=400)
    for model, stats in zip(models, figures["models"], strict=True):
        expected = f1_score(truth, model.predicted, labels=[0, 1, 2], average=None,
                            zero_division=0)
        for name, f1 in zip(NAMES, expected, strict=True):
            interval = stats["per_class"][name]["f1"]
            assert interval["value"] == pytest.approx(f1)
            assert interval["low"] <= f1 <= interval["high"] and interval["low"] < interval["high"]
        assert stats["accuracy"]["value"] == pytest.approx((model.predicted == truth).mean())
    assert figures["models"][1]["unscored"] == 1
    # Wrong now and right before, and the reverse, by hand.
    assert figures["now_wrong"] == [0, 1, 2, 62]
    assert figures["now_right"] == [5, 6, 32, 33, 34, 60, 70]
    # The dog class's images: the challenger alone right on 3, the champion alone on none.
    assert figures["per_class_mcnemar"]["dog"] == pytest.approx(binomtest(3, 3, 0.5).pvalue)
    assert figures["per_class_mcnemar"]["cat"] == pytest.approx(binomtest(2, 5, 0.5).pvalue)
    # Always 0.9 sure, right on 85 of 90: the calibration error is |85/90 - 0.9|.
    assert figures["models"][0]["calibration"]["ece"] == pytest.approx(abs(85 / 90 - 0.9))


def test_a_larger_test_set_gives_narrower_intervals():
    rng = np.random.default_rng(1)
    widths = []
    for n in (60, 6000):
        truth = rng.integers(0, 3, n)
        predicted = np.where(rng.random(n) < 0.8, truth, (truth + 1) % 3)
        stats = compare(truth, [ModelAnswers("m", predicted, np.full(n, 0.8))], NAMES,
                        bootstrap=300)["models"][0]["accuracy"]
        widths.append(stats["high"] - stats["low"])
    assert widths[1] < widths[0] / 5


def _pngs(page: str) -> list[Image.Image]:
    return [Image.open(io.BytesIO(base64.b64decode(data)))
            for data in re.findall(r'src="data:image/png;base64,([^"]+)"', page)]


def test_the_page_shows_the_decision_both_models_the_figures_and_the_changed_images(
        answers, tmp_path):
    truth, models = answers
    write_folder_layout(tmp_path / "data", {"cat": 30, "dog": 30, "fox": 30})
    paths = [f"{name}/{p.name}" for name in NAMES
             for p in sorted((tmp_path / "data" / name).iterdir())]
    figures = compare(truth, models, NAMES, bootstrap=200)
    decision = "v2: test_accuracy 0.9444 vs champion v1 0.9111: promoted, beats champion v1"
    page = write_review(tmp_path / "review", decision, figures, paths, tmp_path / "data",
                        truth, models).read_text()
    assert decision in page and "challenger v2" in page and "champion v1" in page
    assert "Now wrong (the champion was right): 4" in page
    assert "Now right (the champion was wrong): 7" in page
    pictures = _pngs(page)
    # Two figures, then a thumbnail for each changed image.
    assert len(pictures) == 2 + 4 + 7
    assert all(max(p.size) <= 96 for p in pictures[2:])
    assert pictures[0].size[0] > 300 and pictures[1].size[0] > 300
    for name in ("review.json", "reliability.png", "confusion.png"):
        assert (tmp_path / "review" / name).stat().st_size > 0
    assert paths[62] in page and "unreadable" in page  # the champion's unscored image
    summary = summary_markdown(decision, figures)
    assert summary.startswith(f"**{decision}**") and "now wrong 4, now right 7" in summary


def test_without_a_champion_the_page_shows_the_challenger_and_its_mistakes(answers, tmp_path):
    truth, models = answers
    write_folder_layout(tmp_path / "data", {"cat": 30, "dog": 30, "fox": 30})
    paths = [f"{name}/{p.name}" for name in NAMES
             for p in sorted((tmp_path / "data" / name).iterdir())]
    figures = compare(truth, models[:1], NAMES, bootstrap=100)
    page = write_review(tmp_path / "review", "v1: no champion yet", figures, paths,
                        tmp_path / "data", truth, models[:1]).read_text()
    assert "Wrong: 5" in page and "champion" not in page.replace("no champion yet", "")
    assert len(_pngs(page)) == 2 + 5


def test_the_page_renders_in_headless_chromium_with_its_diagram_and_gallery(answers, tmp_path):
    """A screenshot of the page as a browser draws it (Debian's chromium-headless-shell, which
    `make test` installs): the reliability diagram's two lines and the changed images'
    thumbnails are on the screen, not only in the file."""
    import shutil
    import subprocess

    browser = shutil.which("chromium-headless-shell") or shutil.which("chromium")
    assert browser, "no headless Chromium: `make test` installs Debian's chromium-headless-shell"
    truth, models = answers
    write_folder_layout(tmp_path / "data", {"cat": 30, "dog": 30, "fox": 30}, size=48)
    paths = [f"{name}/{p.name}" for name in NAMES
             for p in sorted((tmp_path / "data" / name).iterdir())]
    page = write_review(tmp_path / "review", "v2: promoted", compare(truth, models, NAMES),
                        paths, tmp_path / "data", truth, models)
    shot = tmp_path / "shot.png"
    done = subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu",
                           "--hide-scrollbars", f"--screenshot={shot}",
                           "--window-size=1100,2400", page.as_uri()],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and shot.is_file(), done.stderr[-2000:]
    pixels = np.asarray(Image.open(shot).convert("RGB")).reshape(-1, 3)

    def count(rgb) -> int:
        return int((pixels == np.array(rgb)).all(axis=1).sum())

    # matplotlib's first two line colours: the challenger's and the champion's curves.
    assert count((0x1F, 0x77, 0xB4)) > 60 and count((0xFF, 0x7F, 0x0E)) > 60
    # The first changed image's background colour, drawn at its thumbnail's size.
    with Image.open(tmp_path / "data" / paths[0]) as first:
        background = first.convert("RGB").getpixel((0, 0))
    assert count(background) > 1500, count(background)
