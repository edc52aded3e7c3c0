"""The tail train-flow and sweep-flow share: a trained model's version registered behind the
gate, its drift reference, its review beside the champion, and a person's approval when the
registry asks for one. Only composes tasks."""

from __future__ import annotations

from tasks.approval import apply_approval, ask_for_approval
from tasks.decision import Registration
from tasks.drift import record_drift_reference
from tasks.evaluate import Evaluation
from tasks.register import register_model
from tasks.review import Review, review_version
from training.config import RegistrySpec
from training.data.sources import DatasetRef
from training.handoff import SplitResult, TrainResult


def register_and_review(source: DatasetRef, data: SplitResult, trained: TrainResult,  # noqa: PLR0913
                        evaluation: Evaluation, registry: RegistrySpec, run_id: str,
                        lineage: dict[str, str]) -> tuple[Registration, Review]:
    registration = register_model(trained, evaluation, registry, run_id, lineage)
    record_drift_reference(data, evaluation, run_id)
    review = review_version(source, data, trained, evaluation, registration, run_id, lineage)
    if registration.awaiting_approval:
        answer = ask_for_approval(registration, registry.approval_timeout_s, review.summary,
                                  review.url)
        registration = apply_approval(registration, answer)
    return registration, review
