"""Has what the champion scores drifted from what it was tested on?

A version's reference is its own test split: the classes it predicted there, its top-1
confidence, and a few statistics of each image (brightness, contrast, sharpness, colour) read
from the image's bytes as predict-flow reads them. A scored batch is compared with it by
scipy's two-sample tests: chi-square on the predicted classes' shares, Kolmogorov-Smirnov on
confidence and on each image statistic. A test drifts when its p-value is below the level
(Bonferroni-corrected for the number of tests) *and* its effect is large enough: with
thousands of images, a p-value alone calls every trivial difference drift.
"""

from __future__ import annotations

import io
import math
from collections import Counter

import numpy as np
from PIL import Image
from pydantic import BaseModel

from training.config import DriftSpec

STATISTICS = ("brightness", "contrast", "sharpness", "red", "green", "blue")
THUMBNAIL = 32
"""Statistics are read at this side, so that an image's size does not change its sharpness."""


def image_statistics(data: bytes) -> tuple[float, ...]:
    """STATISTICS of one encoded image, each in [0, 1]; NaN for an unreadable one."""
    try:
        with Image.open(io.BytesIO(data)) as image:
            image.draft("RGB", (THUMBNAIL, THUMBNAIL))  # JPEG: decode at 1/2..1/8 size
            rgb = image.convert("RGB").resize((THUMBNAIL, THUMBNAIL), Image.Resampling.BILINEAR)
    except (OSError, ValueError, Image.DecompressionBombError):
        return (math.nan,) * len(STATISTICS)
    pixels = np.asarray(rgb, dtype=np.float32) / 255.0
    gray = pixels @ np.array([0.299, 0.587, 0.114], dtype=np.float32)
    edges = np.abs(np.diff(gray, axis=0)).mean() + np.abs(np.diff(gray, axis=1)).mean()
    red, green, blue = pixels.reshape(-1, 3).mean(axis=0)
    return tuple(round(float(v), 5) for v in
                 (gray.mean(), gray.std(), edges / 2, red, green, blue))


class Sample(BaseModel):
    """One side of a comparison: a test split, or a scored batch."""

    classes: dict[str, int]
    """predicted class -> images"""
    confidence: list[float]
    """top-1 probability of each scored image"""
    statistics: dict[str, list[float]]
    """STATISTICS name -> one value per readable image"""

    @classmethod
    def of(cls, labels: list[str], confidence: list[float], statistics: list[tuple[float, ...]]
           ) -> Sample:
        columns = np.array(statistics, dtype=np.float64).reshape(-1, len(STATISTICS))
        readable = ~np.isnan(columns).any(axis=1)
        return cls(classes=dict(sorted(Counter(labels).items())),
                   confidence=[round(c, 5) for c in confidence],
                   statistics={name: columns[readable, k].tolist()
                               for k, name in enumerate(STATISTICS)})


class Test(BaseModel):
    name: str
    """"classes", "confidence" or an image statistic"""
    method: str
    effect: float
    """Cramer's V (classes) or the Kolmogorov-Smirnov distance (the rest), 0..1"""
    p_value: float
    drifted: bool


class Drift(BaseModel):
    drifted: bool
    tests: list[Test]
    reference_images: int
    batch_images: int
    level: float
    """the p-value each test is held to (the spec's, Bonferroni-corrected)"""

    @property
    def drifted_tests(self) -> list[str]:
        return [t.name for t in self.tests if t.drifted]


def compare(reference: Sample, batch: Sample, spec: DriftSpec) -> Drift:
    from scipy.stats import chi2_contingency, ks_2samp

    found: list[tuple[str, str, float, float]] = []
    names = sorted(set(reference.classes) | set(batch.classes))
    table = np.array([[reference.classes.get(n, 0) for n in names],
                      [batch.classes.get(n, 0) for n in names]])
    if len(names) > 1 and table.sum(axis=1).all():
        chi2, p, _, _ = chi2_contingency(table)
        found.append(("classes", "chi-square", math.sqrt(chi2 / table.sum()), p))
    pairs = [("confidence", reference.confidence, batch.confidence)]
    pairs += [(n, reference.statistics.get(n, []), batch.statistics.get(n, []))
              for n in STATISTICS]
    for name, before, after in pairs:
        if len(before) and len(after):
            result = ks_2samp(before, after)
            found.append((name, "Kolmogorov-Smirnov", float(result.statistic),
                          float(result.pvalue)))
    level = spec.p_value / max(len(found), 1)
    tests = [Test(name=name, method=method, effect=round(effect, 6), p_value=float(p),
                  drifted=bool(p < level and effect >= spec.min_effect))
             for name, method, effect, p in found]
    return Drift(drifted=any(t.drifted for t in tests), tests=tests, level=level,
                 reference_images=len(reference.confidence), batch_images=len(batch.confidence))
