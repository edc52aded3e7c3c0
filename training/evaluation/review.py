"""The review of a challenger beside the champion, on the same test images: what a person
needs to decide whether it should replace the champion.

From the predictions the gate already has (the challenger's evaluation, the champion scored on
the challenger's test images), with no extra launch:
- per class: precision, recall and F1 of each, with bootstrap 95% intervals (the test images
  resampled with Poisson weights, the same resamples for both models), and McNemar's exact
  test on that class's images;
- calibration: the expected calibration error of each and a reliability diagram;
- each confusion matrix and their difference;
- the images the challenger now gets wrong that the champion got right, and the reverse.
Written as review.json, two PNG figures and review.html (figures and thumbnails inlined, so it
reads offline as one file). Plain numpy and scikit-learn; no Prefect, no MLflow.
"""

from __future__ import annotations

import base64
import csv
import html
import io
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from training.evaluation.plots import pyplot

BOOTSTRAP = 1000
CALIBRATION_BINS = 15
GALLERY = 24
THUMBNAIL = 96


@dataclass
class ModelAnswers:
    """One model's answers on the test images, in the test rows' order."""

    name: str  # "challenger v5", "champion v3"
    predicted: np.ndarray  # class index per image; -1: the image could not be scored
    confidence: np.ndarray  # the predicted class's probability (0 when not scored)


def read_challenger(predictions: Path, class_names: list[str]
                    ) -> tuple[list[str], np.ndarray, np.ndarray, np.ndarray]:
    """(paths, true class, predicted class, confidence) from the evaluation's predictions.csv."""
    index = {name: k for k, name in enumerate(class_names)}
    with open(predictions, newline="") as f:
        rows = list(csv.DictReader(f))
    return ([r["path"] for r in rows], np.array([index[r["label"]] for r in rows]),
            np.array([index[r["predicted"]] for r in rows]),
            np.array([float(r["probability"]) for r in rows]))


def read_served(predictions: Path, paths: list[str], class_names: list[str]
                ) -> tuple[np.ndarray, np.ndarray]:
    """(predicted class, confidence) for `paths` from a served model's scoring CSV; an image
    it could not read (or did not score) counts as wrong."""
    index = {name: k for k, name in enumerate(class_names)}
    with open(predictions, newline="") as f:
        by_path = {r["path"]: r for r in csv.DictReader(f)}
    predicted, confidence = [], []
    for path in paths:
        row = by_path.get(path) or {}
        predicted.append(index.get(row.get("label") or "", -1))
        confidence.append(float(row.get("probability") or 0.0))
    return np.array(predicted), np.array(confidence)


def _per_class(hits: np.ndarray, predicted: np.ndarray, actual: np.ndarray
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Precision, recall and F1 per class from per-class counts (..., K): right answers,
    answers of that class, and images of that class (an unscored image counts as a wrong
    answer of no class). 0 where undefined, as scikit-learn's zero_division=0."""
    with np.errstate(divide="ignore", invalid="ignore"):
        precision = np.where(predicted > 0, hits / predicted, 0.0)
        recall = np.where(actual > 0, hits / actual, 0.0)
        f1 = np.where(precision + recall > 0, 2 * precision * recall / (precision + recall), 0.0)
    return precision, recall, f1


def _class_counts(truth: np.ndarray, predicted: np.ndarray, k: int, weights: np.ndarray
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per-class counts for each row of `weights` (bootstrap counts per image): three (B, K)
    products with one-hot columns, so memory grows with the classes, not their square."""
    from scipy.sparse import csr_matrix

    def onehot(classes: np.ndarray) -> csr_matrix:
        rows = np.flatnonzero(classes >= 0)
        return csr_matrix((np.ones(len(rows)), (rows, classes[rows])), shape=(len(classes), k))

    hits = np.where(predicted == truth, truth, -1)
    return tuple(np.asarray((onehot(c).T @ weights.T).T)
                 for c in (hits, predicted, truth))


def calibration(correct: np.ndarray, confidence: np.ndarray, bins: int = CALIBRATION_BINS
                ) -> dict:
    """Expected calibration error (top-label, equal-width bins) and the diagram's bins."""
    edges = np.linspace(0, 1, bins + 1)
    which = np.clip(np.digitize(confidence, edges[1:-1]), 0, bins - 1)
    rows, ece = [], 0.0
    for b in range(bins):
        mask = which == b
        if not mask.any():
            continue
        accuracy, mean_confidence = float(correct[mask].mean()), float(confidence[mask].mean())
        ece += mask.mean() * abs(accuracy - mean_confidence)
        rows.append({"low": float(edges[b]), "high": float(edges[b + 1]),
                     "images": int(mask.sum()), "accuracy": accuracy,
                     "confidence": mean_confidence})
    return {"ece": float(ece), "bins": rows}


def mcnemar(ours: np.ndarray, theirs: np.ndarray) -> float:
    """Exact McNemar test on two models' correctness over the same images."""
    from scipy.stats import binomtest

    only_ours, only_theirs = int((ours & ~theirs).sum()), int((theirs & ~ours).sum())
    if only_ours + only_theirs == 0:
        return 1.0
    return float(binomtest(only_ours, only_ours + only_theirs, 0.5).pvalue)


def compare(truth: np.ndarray, models: list[ModelAnswers], class_names: list[str],
            bootstrap: int = BOOTSTRAP, seed: int = 0) -> dict:
    """The review's figures (JSON-ready): models[0] is the challenger, models[1] (if any) the
    champion it is compared with."""
    from sklearn.metrics import confusion_matrix

    k, n = len(class_names), len(truth)
    weights = np.random.default_rng(seed).poisson(1.0, size=(bootstrap, n)).astype(np.float32)
    figures: dict = {"images": int(n), "class_names": class_names, "bootstrap": bootstrap,
                     "models": []}
    correct = [model.predicted == truth for model in models]
    for model, right in zip(models, correct, strict=True):
        point = [m[0] for m in _per_class(*_class_counts(truth, model.predicted, k,
                                                          np.ones((1, n))))]
        resampled = _per_class(*_class_counts(truth, model.predicted, k, weights))
        per_class = {}
        for c, name in enumerate(class_names):
            per_class[name] = {metric: {"value": float(point[m][c]),
                                        "low": float(np.percentile(resampled[m][:, c], 2.5)),
                                        "high": float(np.percentile(resampled[m][:, c], 97.5))}
                               for m, metric in enumerate(("precision", "recall", "f1"))}
            per_class[name]["support"] = int((truth == c).sum())
        accuracy = right.astype(np.float32)
        resampled_accuracy = (weights @ accuracy) / np.maximum(weights.sum(axis=1), 1)
        figures["models"].append({
            "name": model.name,
            "accuracy": {"value": float(accuracy.mean()),
                         "low": float(np.percentile(resampled_accuracy, 2.5)),
                         "high": float(np.percentile(resampled_accuracy, 97.5))},
            "per_class": per_class,
            "calibration": calibration(right, model.confidence),
            "confusion": confusion_matrix(truth, model.predicted, labels=list(range(k))
                                          ).tolist(),
            "unscored": int((model.predicted < 0).sum())})
    if len(models) == 2:
        ours, theirs = correct
        figures["per_class_mcnemar"] = {name: mcnemar(ours[truth == c], theirs[truth == c])
                                        for c, name in enumerate(class_names)}
        figures["mcnemar"] = mcnemar(ours, theirs)
        figures["now_wrong"] = [int(i) for i in np.flatnonzero(~ours & theirs)]
        figures["now_right"] = [int(i) for i in np.flatnonzero(ours & ~theirs)]
    else:
        figures["wrong"] = [int(i) for i in np.flatnonzero(~correct[0])]
    return figures


def reliability_png(figures: dict, path: Path) -> Path:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(5, 4.5))
    ax.plot([0, 1], [0, 1], color="grey", linestyle="--", linewidth=1, label="perfect")
    for model, marker in zip(figures["models"], ("o", "s"), strict=False):
        bins = model["calibration"]["bins"]
        ax.plot([b["confidence"] for b in bins], [b["accuracy"] for b in bins], marker=marker,
                label=f"{model['name']} (ECE {model['calibration']['ece']:.3f})")
    ax.set(xlabel="confidence (top class)", ylabel="accuracy", xlim=(0, 1), ylim=(0, 1.02),
           title="Reliability")
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def confusion_png(figures: dict, path: Path) -> Path:
    plt = pyplot()
    names, models = figures["class_names"], figures["models"]
    matrices = [np.array(m["confusion"]) for m in models]
    panels = [(m["name"], x, "Blues") for m, x in zip(models, matrices, strict=True)]
    if len(matrices) == 2:
        panels.append(("challenger - champion", matrices[0] - matrices[1], "RdBu"))
    size = min(4 + 0.35 * len(names), 12)
    fig, axes = plt.subplots(1, len(panels), figsize=(size * len(panels), size), squeeze=False)
    for ax, (title, matrix, cmap) in zip(axes[0], panels, strict=True):
        limit = max(1, int(np.abs(matrix).max()))
        ax.imshow(matrix, cmap=cmap, vmin=-limit if cmap == "RdBu" else 0, vmax=limit)
        if len(names) <= 20:
            for (i, j), value in np.ndenumerate(matrix):
                if value:  # white on the dark cells
                    ax.text(j, i, str(value), ha="center", va="center", fontsize=7,
                            color="white" if abs(value) > 0.6 * limit else "black")
        ax.set(title=title, xlabel="predicted", ylabel="true")
        if len(names) <= 50:  # beyond, names are unreadable and drawing them takes seconds
            ax.set(xticks=range(len(names)), yticks=range(len(names)))
            ax.set_xticklabels(names, rotation=90, fontsize=7)
            ax.set_yticklabels(names, fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


STYLE = f"""<style>
body {{ font-family: system-ui, sans-serif; margin: 2em; color: #222; }}
table {{ border-collapse: collapse; margin: 1em 0; }}
td, th {{ border: 1px solid #ccc; padding: 4px 8px; text-align: right; }}
td:first-child {{ text-align: left; }} .up {{ color: #060; }} .down {{ color: #a00; }}
.decision {{ font-size: 1.2em; padding: .6em; background: #f3f3f3; border-left: 4px solid #444; }}
.gallery {{ display: flex; flex-wrap: wrap; gap: 8px; }}
figure.g {{ width: 150px; margin: 0; font-size: 11px; }}
figure.g img {{ width: {THUMBNAIL}px; height: {THUMBNAIL}px; object-fit: contain;
  image-rendering: pixelated; background: #eee; }}
</style>"""


def _data_uri(path: Path) -> str:
    return "data:image/png;base64," + base64.b64encode(path.read_bytes()).decode()


def _thumbnail(file: Path) -> str:
    from PIL import Image

    try:
        with Image.open(file) as image:
            image = image.convert("RGB")
            image.thumbnail((THUMBNAIL, THUMBNAIL))
            buffer = io.BytesIO()
            image.save(buffer, "PNG")
    except OSError:
        return ""
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def _interval(figure: dict, digits: int = 3) -> str:
    return (f"{figure['value']:.{digits}f} <small>[{figure['low']:.{digits}f}, "
            f"{figure['high']:.{digits}f}]</small>")


def _gallery(title: str, indices: list[int], paths: list[str], root: Path, truth: np.ndarray,
             models: list[ModelAnswers], names: list[str]) -> str:
    def said(model: ModelAnswers, i: int) -> str:
        label = names[model.predicted[i]] if model.predicted[i] >= 0 else "unreadable"
        return f"{html.escape(model.name)}: {html.escape(label)} ({model.confidence[i]:.2f})"

    cards = []
    # The winner's most confident answers first: the clearest changes.
    winner = models[1] if len(models) == 2 and title.startswith("Now wrong") else models[0]
    for i in sorted(indices, key=lambda i: -winner.confidence[i])[:GALLERY]:
        captions = "<br>".join(said(m, i) for m in models)
        cards.append(f'<figure class="g"><img src="{_thumbnail(root / paths[i])}" '
                     f'alt="{html.escape(paths[i])}"><figcaption>true: '
                     f"<b>{html.escape(names[truth[i]])}</b><br>{captions}<br>"
                     f"<small>{html.escape(paths[i])}</small></figcaption></figure>")
    more = f" (the first {GALLERY} of {len(indices)})" if len(indices) > GALLERY else ""
    return (f'<h2>{html.escape(title)}: {len(indices)}{more}</h2><div class="gallery">'
            + "".join(cards) + "</div>")


def audit_section(audit_file: Path | None, root: Path) -> str:
    """The data audit's findings with thumbnails: duplicate groups (across splits first),
    likely wrong labels, outliers; GALLERY of each at most."""
    if audit_file is None or not audit_file.is_file():
        return ""
    audit = json.loads(audit_file.read_text())
    found = audit["findings"]

    def card(f: dict) -> str:
        said = (f"labelled <b>{html.escape(f['label'])}</b>"
                + (f", looks like <b>{html.escape(f['suggested'])}</b>" if f["suggested"] else ""))
        return (f'<figure class="g"><img src="{_thumbnail(root / f["path"])}" '
                f'alt="{html.escape(f["path"])}"><figcaption>{said} ({html.escape(f["side"])})'
                f"<br>{html.escape(f['reason'])}<br><small>{html.escape(f['path'])}</small>"
                "</figcaption></figure>")

    groups: dict[int, list[dict]] = {}
    for f in found:
        if f["kind"] in ("leak", "duplicate"):
            groups.setdefault(f["group"], []).append(f)
    ordered = sorted(groups.values(), key=lambda g: (g[0]["kind"] != "leak", g[0]["group"]))
    parts = [f"<h2>Data audit</h2><p>{audit['images']} images audited; "
             f"{len(groups)} duplicate groups, {len(audit['quarantined'])} copies quarantined "
             f"(policy: {html.escape(json.dumps(audit['policy']))}). audit.json lists every "
             "finding.</p>"]
    for group in ordered[:GALLERY]:
        title = ("Across splits" if group[0]["kind"] == "leak" else "Duplicates")
        parts.append(f"<h3>{title}: group {group[0]['group']}</h3><div class=\"gallery\">"
                     + "".join(card(f) for f in group) + "</div>")
    for kind, title in (("label_issue", "Likely wrong labels"), ("outlier", "Outliers")):
        rows = [f for f in found if f["kind"] == kind]
        if rows:
            more = f" (the first {GALLERY})" if len(rows) > GALLERY else ""
            parts.append(f"<h3>{title}: {len(rows)}{more}</h3><div class=\"gallery\">"
                         + "".join(card(f) for f in rows[:GALLERY]) + "</div>")
    return "".join(parts)


def write_review(out: Path, decision: str, figures: dict, paths: list[str], root: Path,
                 truth: np.ndarray, models: list[ModelAnswers], audit: Path | None = None
                 ) -> Path:
    """review.json, reliability.png, confusion.png and review.html in `out`; the HTML's path.
    With `audit` (the split's audit.json), the page ends with the data audit's findings."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "review.json").write_text(json.dumps({"decision": decision, **figures}, indent=1))
    reliability, confusion = reliability_png(figures, out / "reliability.png"), confusion_png(
        figures, out / "confusion.png")
    names, stats = figures["class_names"], figures["models"]
    head = "".join(f"<th>{html.escape(m['name'])} F1</th>" for m in stats)
    head += ("<th>F1 change</th><th>McNemar p</th>" if len(stats) == 2 else "")
    rows = []
    for name in names:
        cells = "".join(f"<td>{_interval(m['per_class'][name]['f1'])}</td>" for m in stats)
        if len(stats) == 2:
            change = (stats[0]["per_class"][name]["f1"]["value"]
                      - stats[1]["per_class"][name]["f1"]["value"])
            p = figures["per_class_mcnemar"][name]
            cells += (f'<td class="{"up" if change > 0 else "down" if change < 0 else ""}">'
                      f"{change:+.3f}</td><td>{p:.3g}{' *' if p < 0.05 else ''}</td>")
        support = stats[0]["per_class"][name]["support"]
        rows.append(f"<tr><td>{html.escape(name)}</td><td>{support}</td>{cells}</tr>")
    detail = "".join(
        f"<tr><td>{html.escape(m['name'])}</td><td>{_interval(m['accuracy'])}</td>"
        f"<td>{m['calibration']['ece']:.4f}</td><td>{m['unscored']}</td></tr>" for m in stats)
    if len(models) == 2:
        galleries = (_gallery("Now wrong (the champion was right)", figures["now_wrong"], paths,
                              root, truth, models, names)
                     + _gallery("Now right (the champion was wrong)", figures["now_right"],
                                paths, root, truth, models, names))
    else:
        galleries = _gallery("Wrong", figures["wrong"], paths, root, truth, models, names)
    page = f"""<!doctype html>
<html><head><meta charset="utf-8"><title>Review: {html.escape(stats[0]['name'])}</title>
{STYLE}</head><body>
<p class="decision">{html.escape(decision)}</p>
<p>{figures['images']} test images, the same for every model; intervals are bootstrap 95%
({figures['bootstrap']} resamples){'; McNemar p on each class' + chr(39) + 's images, * below 0.05'
if len(stats) == 2 else ''}.</p>
<table><tr><th>model</th><th>accuracy</th><th>ECE</th><th>not scored</th></tr>{detail}</table>
<h2>Per class</h2>
<table><tr><th>class</th><th>images</th>{head}</tr>{''.join(rows)}</table>
<h2>Calibration</h2><img src="{_data_uri(reliability)}" alt="reliability diagram">
<h2>Confusion</h2><img src="{_data_uri(confusion)}" alt="confusion matrices"
 style="max-width: 100%">
{galleries}
{audit_section(audit, root)}
</body></html>
"""
    (out / "review.html").write_text(page)
    return out / "review.html"


def summary_markdown(decision: str, figures: dict) -> str:
    """The report's top lines for a Prefect artifact or the approval form."""
    stats = figures["models"]
    lines = [f"**{decision}**", ""]
    lines += [f"- {m['name']}: accuracy {m['accuracy']['value']:.4f} "
              f"[{m['accuracy']['low']:.4f}, {m['accuracy']['high']:.4f}], ECE "
              f"{m['calibration']['ece']:.4f}" for m in stats]
    if len(stats) == 2:
        lines.append(f"- now wrong {len(figures['now_wrong'])}, now right "
                     f"{len(figures['now_right'])} of {figures['images']} test images "
                     f"(McNemar p={figures['mcnemar']:.3g})")
        changes = sorted((stats[0]["per_class"][n]["f1"]["value"]
                           - stats[1]["per_class"][n]["f1"]["value"], n)
                          for n in figures["class_names"])
        moved = [f"{n} {d:+.3f}" + (" (p<0.05)" if figures["per_class_mcnemar"][n] < 0.05 else "")
                 for d, n in (changes[:3] + changes[-3:]) if d]
        if moved:
            lines.append(f"- F1 moved most: {', '.join(dict.fromkeys(moved))}")
    return "\n".join(lines)
