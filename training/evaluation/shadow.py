"""How often a challenger agrees with the champion on the same production images."""

from __future__ import annotations

import csv
from collections import Counter
from pathlib import Path

from pydantic import BaseModel

DIFFERENCES_HEADER = ["path", "champion", "champion_probability", "challenger",
                      "challenger_probability"]


class Agreement(BaseModel):
    images: int
    agreeing: int

    @property
    def share(self) -> float:
        return self.agreeing / self.images if self.images else 0.0


class Shadow(BaseModel):
    """One batch scored by both: only the champion's predictions were written."""

    champion: str
    challenger: str
    """the versions"""
    overall: Agreement
    per_class: dict[str, Agreement]
    """by the champion's label"""
    differences: Path
    """differences.csv: every image the two labelled differently"""


def _read(path: Path) -> dict[str, dict]:
    with open(path, newline="") as f:
        return {r["path"]: r for r in csv.DictReader(f)}


def agreement(champion: Path, challenger: Path, versions: tuple[str, str], out: Path) -> Shadow:
    """Compare two scorings (predictions.csv) of the same images; images either could not
    read are left out."""
    first, second = _read(champion), _read(challenger)
    images, agreeing, differences = Counter(), Counter(), []
    for path, mine in first.items():
        theirs = second.get(path)
        if theirs is None or mine["error"] or theirs["error"]:
            continue
        images[mine["label"]] += 1
        if mine["label"] == theirs["label"]:
            agreeing[mine["label"]] += 1
        else:
            differences.append([path, mine["label"], mine["probability"], theirs["label"],
                                theirs["probability"]])
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "w", newline="") as f:
        csv.writer(f, lineterminator="\n").writerows([DIFFERENCES_HEADER, *differences])
    return Shadow(champion=versions[0], challenger=versions[1],
                  overall=Agreement(images=sum(images.values()),
                                    agreeing=sum(agreeing.values())),
                  per_class={label: Agreement(images=n, agreeing=agreeing[label])
                             for label, n in sorted(images.items())},
                  differences=out)
