"""The gate's policy as tables: figures in, decision and reason out (tasks/decision.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tasks.decision import beats_chance, decide, mcnemar_p_value, small_test_warning
from tasks.evaluate import Evaluation
from tasks.gate import SameImages
from training.config import RegistrySpec
from training.engine.events import ClassFigures

CHANCE = (True, "")


def champion(accuracy: float) -> SameImages:
    return SameImages(version="1", images=400, metrics={"accuracy": accuracy}, correct={},
                      cached=True)


@pytest.mark.parametrize(("spec", "value", "held", "p", "chance", "promoted", "reason"), [
    (RegistrySpec(promote=False), 0.99, None, None, CHANCE, False, "promotion disabled"),
    (RegistrySpec(), 0.60, None, None, (False, "accuracy 0.6 vs 0.6"), False,
     "no better than chance: accuracy 0.6 vs 0.6"),
    (RegistrySpec(), 0.60, None, None, CHANCE, True, "no champion yet"),
    (RegistrySpec(), 0.90, champion(0.90), 1.0, CHANCE, False, "does not beat champion v1"),
    (RegistrySpec(), 0.89, champion(0.90), 0.5, CHANCE, False, "does not beat champion v1"),
    (RegistrySpec(min_improvement=0.05), 0.92, champion(0.90), 0.001, CHANCE, False,
     "below registry.min_improvement 0.05"),
    (RegistrySpec(), 0.92, champion(0.90), 0.2, CHANCE, False, "not significant (McNemar p=0.2"),
    (RegistrySpec(significance=None), 0.92, champion(0.90), 0.2, CHANCE, True,
     "beats champion v1 (0.9000)"),
    (RegistrySpec(), 0.92, champion(0.90), None, CHANCE, True, "beats champion v1"),
    (RegistrySpec(), 0.95, champion(0.90), 0.001, CHANCE, True, "beats champion v1 (0.9000)"),
])
def test_the_gate_decides_from_figures(spec, value, held, p, chance, promoted, reason):
    decided, why = decide(spec, value, held, p, chance)
    assert decided is promoted and reason in why, why


@pytest.mark.parametrize(("ours", "theirs", "p"), [
    ({"a": 1, "b": 1}, {"a": 1, "b": 1}, 1.0),  # no disagreement
    ({str(i): 1 for i in range(10)}, {str(i): 0 for i in range(10)}, 2 / 2 ** 10),
    ({"a": 1, "b": 0}, {"a": 0, "b": 1}, 1.0),
])
def test_mcnemar_counts_only_the_images_the_two_disagree_on(ours, theirs, p):
    assert mcnemar_p_value(ours, theirs) == pytest.approx(p)


def evaluation(accuracy: float, supports: dict[str, int]) -> Evaluation:
    figures = ClassFigures(precision=0, recall=0, f1=0, support=0)
    return Evaluation(metrics={"accuracy": accuracy}, images=sum(supports.values()),
                      per_class={k: figures.model_copy(update={"support": n})
                                 for k, n in supports.items()},
                      output_dir=Path("."), predictions=Path("p.csv"))


@pytest.mark.parametrize(("accuracy", "supports", "level", "beats"), [
    (0.55, {"a": 50, "b": 50}, 0.05, False),  # 55 of 100 against 50%: luck is likely
    (0.70, {"a": 50, "b": 50}, 0.05, True),
    (0.80, {"a": 80, "b": 20}, None, False),  # no better than always saying "a"
    (0.81, {"a": 80, "b": 20}, None, True),
])
def test_a_model_must_beat_the_majority_class(accuracy, supports, level, beats):
    assert beats_chance(evaluation(accuracy, supports), level)[0] is beats


def test_a_class_with_few_test_images_is_warned_of():
    assert small_test_warning(evaluation(0.9, {"a": 30, "b": 30})) is None
    assert "only 12 images of class 'b'" in small_test_warning(evaluation(0.9, {"a": 30, "b": 12}))
