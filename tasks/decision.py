"""The champion gate's policy: decisions from figures, no I/O.

Whether a challenger is promoted follows from numbers only: its test metric, the champion's on
the same images, McNemar's p-value over the images the two disagree on, and a binomial test
against always predicting the majority class. tasks/register.py gathers those figures and
writes the decision; the rules are here, and tested by tables (tests/test_decision.py).
"""

from __future__ import annotations

from pydantic import BaseModel

from tasks.evaluate import Evaluation
from tasks.gate import SameImages
from training.config import RegistrySpec

# Below this many test images in a class, a few images' difference is noise.
MIN_TEST_IMAGES_PER_CLASS = 30


class Registration(BaseModel):
    model_name: str
    version: str
    aliases: list[str]
    promoted: bool
    reason: str
    metric: str
    value: float
    champion_version: str | None = None
    """The champion this version was compared with (None: there was none)."""
    champion_value: float | None = None
    """The champion's metric on this version's test images."""
    compared_images: int | None = None
    p_value: float | None = None
    warning: str | None = None
    awaiting_approval: bool = False
    """Passed the gate with registry.approval=manual: the flow asks a person."""

    def description(self) -> str:
        """One sentence for the version's page, e.g. `v2: 0.7120 vs champion v1 0.3090 on the
        same 450 test images (McNemar p=1e-09): promoted, ...`."""
        text = f"v{self.version}: test_{self.metric} {self.value:.4f}"
        if self.champion_version is not None and self.champion_value is not None:
            text += (f" vs champion v{self.champion_version} {self.champion_value:.4f} on the "
                     f"same {self.compared_images} test images")
            if self.p_value is not None:
                text += f" (McNemar p={self.p_value:.2g})"
        outcome = ("passed the gate, waiting for approval" if self.awaiting_approval
                   else "promoted" if self.promoted else "not promoted")
        warning = f" Warning: {self.warning}." if self.warning else ""
        return f"{text}: {outcome}, {self.reason}.{warning}"


def mcnemar_p_value(ours: dict[str, int], theirs: dict[str, int]) -> float:
    """Exact McNemar test on two models' correctness (path -> 1 if right) over the test images
    both were scored on: the review's test (training.evaluation.review.mcnemar)."""
    import numpy as np

    from training.evaluation.review import mcnemar

    common = sorted(ours.keys() & theirs.keys())
    return mcnemar(np.array([bool(ours[p]) for p in common], dtype=bool),
                   np.array([bool(theirs[p]) for p in common], dtype=bool))


def beats_chance(evaluation: Evaluation, level: float | None) -> tuple[bool, str]:
    """Does the model beat always predicting the test split's majority class?

    By its accuracy, and (at `level`) by a one-sided binomial test, so that a model that is
    right by luck on a small test split is not taken for one that learned.
    """
    from scipy.stats import binomtest

    n = evaluation.images
    majority = max(c.support for c in evaluation.per_class.values()) / n
    correct = round(evaluation.metrics["accuracy"] * n)
    p = float(binomtest(correct, n, majority, alternative="greater").pvalue)
    ok = correct / n > majority and (level is None or p < level)
    return ok, (f"test accuracy {correct / n:.4f} against {majority:.4f} for always predicting "
                f"the majority class (binomial p={p:.3g})")


def small_test_warning(evaluation: Evaluation) -> str | None:
    smallest, name = min((c.support, k) for k, c in evaluation.per_class.items())
    if smallest >= MIN_TEST_IMAGES_PER_CLASS:
        return None
    return (f"the test split has only {smallest} images of class {name!r}: differences of a "
            "few images between models cannot be told from noise; raise split.test_fraction "
            "or add images")


def decide(spec: RegistrySpec, value: float, champion: SameImages | None,
           p_value: float | None, chance: tuple[bool, str]) -> tuple[bool, str]:
    if not spec.promote:
        return False, "promotion disabled (registry.promote=false)"
    beats, versus = chance
    if not beats:
        return False, f"no better than chance: {versus}"
    if champion is None:
        return True, "no champion yet"
    best = champion.metrics[spec.metric]
    gain = value - best
    if gain <= 0:
        return False, f"does not beat champion v{champion.version} ({best:.4f})"
    if gain < spec.min_improvement:
        return False, (f"gain {gain:+.4f} over v{champion.version} ({best:.4f}) is below "
                       f"registry.min_improvement {spec.min_improvement:g}")
    if spec.significance is not None and p_value is not None and p_value >= spec.significance:
        return False, (f"gain {gain:+.4f} over v{champion.version} is not significant "
                       f"(McNemar p={p_value:.3g} >= {spec.significance:g}): it may be noise")
    return True, f"beats champion v{champion.version} ({best:.4f})"

