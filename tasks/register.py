"""register_model: log the model to MLflow, register a version, and run the champion gate."""

from __future__ import annotations

import contextlib
import csv
import importlib.metadata
import importlib.util
import json
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

import mlflow
from mlflow import MlflowClient
from mlflow.exceptions import MlflowException
from prefect import task
from prefect.input import RunInput
from pydantic import BaseModel, Field

import trainflow_serving
from tasks import MLFLOW_RETRIES, run_logger
from tasks.evaluate import Evaluation
from tasks.gate import SameImages, champion_class_names, one_decision_at_a_time, score_champion
from tasks.lineage import CHALLENGER, CHAMPION, FLOW_RUN_ID, champion_version, metric_tag
from tasks.tracking import fluent_mlflow
from trainflow_serving import DESCRIPTION_ARTIFACT, WEIGHTS_ARTIFACT
from trainflow_serving.model_names import TIMM, is_user_model
from training.config import RegistrySpec
from training.data.rows import image_bytes
from training.data.split import read_manifest
from training.handoff import TrainResult
from training.storage import tracking_uri

if TYPE_CHECKING:
    from mlflow.models.model import ModelInfo

SERVING_PACKAGES = ("safetensors", "pillow", "numpy", "pandas")


def serving_packages(model_name: str) -> tuple[str, ...]:
    """What the served model imports besides torch: timm's models need timm."""
    return SERVING_PACKAGES + (("timm",) if model_name.startswith(TIMM) else ())
SERVING_DIR = Path(trainflow_serving.__file__).parent
SERVED_MODEL = SERVING_DIR / "pyfunc_model.py"
METRIC = "trainflow.metric"
PREDICTIONS_RUN_ID = "trainflow.predictions_run_id"
PROMOTION = "trainflow.promotion"
PROMOTION_REASON = "trainflow.promotion_reason"
CHAMPION_VALUE = "trainflow.champion_value_at_decision"
"""The champion's metric on the challenger's test images, at the decision."""
COMPARED_WITH = "trainflow.compared_with_version"
COMPARED_IMAGES = "trainflow.compared_images"
MCNEMAR_P_VALUE = "trainflow.mcnemar_p_value"
DECIDED_AT = "trainflow.decided_at"
"""When the gate decided (Unix seconds): decisions replay in this order."""
APPROVAL = "trainflow.approval"
"""auto, or a person's answer: approved / rejected / no answer, with their comment"""
TEST_METRICS = "trainflow.test_metrics"
# Below this many test images in a class, a few images' difference is noise.
MIN_TEST_IMAGES_PER_CLASS = 30


CARD_MARKER = "\n\n---\n"
"""Between the gate's sentence and the model card in a version's description."""


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


def code_paths(model_name: str) -> list[str]:
    """What the served model imports: the serving package, and a user's `<module>:<callable>`
    network's top-level package (or module file), so it loads where that code is absent."""
    paths = [str(SERVING_DIR)]
    if is_user_model(model_name):
        top = model_name.partition(":")[0].split(".")[0]
        spec = importlib.util.find_spec(top)
        if spec is None or spec.origin is None and not spec.submodule_search_locations:
            raise RuntimeError(f"the module of training.model {model_name} is not importable "
                               "here, so it cannot travel with the registered model")
        locations = list(spec.submodule_search_locations or [])
        paths.append(locations[0] if locations else spec.origin)
    return paths


def log_model(trained: TrainResult, run_id: str) -> ModelInfo:
    """Log the model from code (trainflow_serving/pyfunc_model.py), nothing of ours pickled.

    Weights go as a safetensors artifact, the model's description as JSON, and the
    trainflow_serving package as its only code, so the served model decodes, resizes and
    normalises with training's own functions.
    """
    import pandas as pd
    from mlflow.models import ModelSignature
    from mlflow.types import ColSpec, Schema

    names = trained.class_names
    description = {"model": trained.job.training.model, "class_names": names,
                   "preprocessing": trained.preprocessing.model_dump()}
    signature = ModelSignature(
        inputs=Schema([ColSpec("binary", "image")]),
        outputs=Schema([ColSpec("string", "label", required=False),
                        ColSpec("double", "probability", required=False),
                        *[ColSpec("double", f"probability_{c}", required=False) for c in names],
                        ColSpec("string", "error", required=False)]))
    example_file = next(trained.job.split.root / path for path, _, split in
                        read_manifest(trained.job.split.manifest) if split == "test")
    with tempfile.TemporaryDirectory() as tmp, \
            mlflow.start_run(run_id=run_id, nested=mlflow.active_run() is not None):
        description_file = Path(tmp) / "description.json"
        description_file.write_text(json.dumps(description, indent=2))
        model_info = mlflow.pyfunc.log_model(
            name="model", python_model=str(SERVED_MODEL),
            code_paths=code_paths(trained.job.training.model),
            artifacts={WEIGHTS_ARTIFACT: str(trained.weights),
                       DESCRIPTION_ARTIFACT: str(description_file)},
            signature=signature, metadata=description,
            input_example=pd.DataFrame({"image": [image_bytes(example_file)]}),
            # Explicit requirements: inferring them starts a subprocess that imports the model.
            # The exact versions that trained it, so a serving host gets the same.
            pip_requirements=[f"mlflow=={mlflow.__version__}",
                              *(f"{name}=={importlib.metadata.version(name).split('+')[0]}"
                                for name in ("torch", "torchvision",
                                             *serving_packages(trained.job.training.model)))],
        )
    return model_info


def correctness(predictions: Path) -> dict[str, int]:
    """path -> 1 if right, from the evaluation's predictions.csv."""
    with open(predictions, newline="") as f:
        return {row["path"]: int(row["correct"]) for row in csv.DictReader(f)}


def mcnemar_p_value(ours: dict[str, int], theirs: dict[str, int]) -> float:
    """Exact McNemar test on two models' correctness over the same test images."""
    from scipy.stats import binomtest

    common = ours.keys() & theirs.keys()
    only_ours = sum(1 for p in common if ours[p] and not theirs[p])
    only_theirs = sum(1 for p in common if theirs[p] and not ours[p])
    if only_ours + only_theirs == 0:
        return 1.0
    return float(binomtest(only_ours, only_ours + only_theirs, 0.5).pvalue)


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


def judge(trained: TrainResult, evaluation: Evaluation, registry: RegistrySpec, version: str,
          champion, logger) -> Registration:
    """The gate's decision against `champion` (the current one, or None), on the same images."""
    metric, value = registry.metric, evaluation.metrics[registry.metric]
    warning = small_test_warning(evaluation)
    common = {"model_name": registry.model_name, "version": version, "aliases": [],
              "metric": metric, "value": value, "warning": warning}
    if champion is not None and registry.promote:
        theirs = champion_class_names(registry.model_name, champion.version)
        if theirs != trained.class_names:
            # Scores over different label sets measure different tasks: never compared blindly.
            return Registration(**common, promoted=False, champion_version=str(champion.version),
                                reason=f"champion v{champion.version} predicts the classes "
                                f"{theirs}, this data has {trained.class_names}: not compared, "
                                "so not promoted automatically; make it champion by hand with "
                                f"`trainflow champion {registry.model_name} {version}`")
    same = (score_champion(champion, trained.job.split, trained.job.training, logger)
            if champion and registry.promote else None)
    p_value = None
    if same is not None and registry.significance is not None:
        p_value = mcnemar_p_value(correctness(evaluation.predictions), same.correct)
    promoted, reason = decide(registry, value, same, p_value,
                              beats_chance(evaluation, registry.significance))
    manual = promoted and registry.approval == "manual"
    return Registration(**common, promoted=promoted and not manual, awaiting_approval=manual,
                        reason=reason, p_value=p_value,
                        champion_version=same.version if same else None,
                        champion_value=same.metrics[metric] if same else None,
                        compared_images=same.images if same else None)


def record(client: MlflowClient, registration: Registration, approval: str) -> Registration:
    """The decision on the version (tags and description), then the aliases it earned."""
    r = registration
    tags = {PROMOTION: "promoted" if r.promoted else "not promoted", PROMOTION_REASON: r.reason,
            APPROVAL: approval, DECIDED_AT: repr(time.time())}
    if r.champion_version is not None:
        tags[COMPARED_WITH] = r.champion_version
    if r.champion_value is not None:
        tags[CHAMPION_VALUE] = repr(r.champion_value)
        tags[COMPARED_IMAGES] = str(r.compared_images)
    if r.p_value is not None:
        tags[MCNEMAR_P_VALUE] = repr(r.p_value)
    for key, tag in tags.items():
        client.set_model_version_tag(r.model_name, r.version, key, tag)
    # The model card below the sentence (tasks/review.py) stays when the decision changes.
    old = client.get_model_version(r.model_name, r.version).description or ""
    card = old[old.index(CARD_MARKER):] if CARD_MARKER in old else ""
    client.update_model_version(r.model_name, r.version, description=r.description() + card)
    if r.promoted:
        client.set_registered_model_alias(r.model_name, CHAMPION, r.version)
    aliases = client.get_model_version(r.model_name, r.version).aliases
    return r.model_copy(update={"aliases": sorted(aliases)})


@task(**MLFLOW_RETRIES)
def register_model(trained: TrainResult, evaluation: Evaluation, registry: RegistrySpec,
                   mlflow_run_id: str, lineage: dict[str, str]) -> Registration:
    """Register a version (once per flow run); move `champion` only for a better model."""
    # Logging the model, registering it and loading the champion go through MLflow's fluent
    # API and models:/ URIs, which read the global tracking URI.
    with fluent_mlflow(tracking_uri()):
        return _register(trained, evaluation, registry, mlflow_run_id, lineage)


def _register(trained: TrainResult, evaluation: Evaluation, registry: RegistrySpec,
              mlflow_run_id: str, lineage: dict[str, str]) -> Registration:
    logger = run_logger()
    client = MlflowClient(tracking_uri())
    name, metric = registry.model_name, registry.metric
    value = evaluation.metrics[metric]
    with contextlib.suppress(MlflowException):  # it exists already
        client.create_registered_model(name)
    found = client.search_model_versions(
        f"name='{name}' and tags.`{FLOW_RUN_ID}`='{lineage[FLOW_RUN_ID]}'")
    if found:  # a retried task: the version exists, only the gate may be missing
        version = found[0]
        logger.info("version %s already registered for this flow run", version.version)
    else:
        tags = {**lineage, METRIC: metric, PREDICTIONS_RUN_ID: mlflow_run_id,
                metric_tag(metric): repr(value), TEST_METRICS: json.dumps(evaluation.metrics)}
        model = log_model(trained, mlflow_run_id)
        # What mlflow.register_model does for a models:/ URI, without the two lines it prints
        # to stderr ("... already exists", "Created version N"), which the summary says.
        version = client.create_model_version(name, model.model_uri, tags=tags,
                                              model_id=model.model_id)
    with one_decision_at_a_time(name):
        if PROMOTION in version.tags:  # decided by an earlier attempt: never judged again
            registration = recorded(version, registry, value, small_test_warning(evaluation))
        else:
            registration = judge(trained, evaluation, registry, str(version.version),
                                 champion_version(client, name), logger)
            registration = record(client, registration, "auto" if registry.approval == "auto"
                                  else "waiting" if registration.awaiting_approval
                                  else "not asked")
        client.set_registered_model_alias(name, CHALLENGER, version.version)
    # The description ends with the warning, if any: one line, at the level it deserves.
    (logger.warning if registration.warning else logger.info)("%s", registration.description())
    return registration.model_copy(update={"aliases": sorted(
        client.get_model_version(name, registration.version).aliases)})


def recorded(version, registry: RegistrySpec, value: float, warning: str | None
             ) -> Registration:
    """The decision an earlier attempt recorded on `version` (a retried task)."""
    tags = version.tags

    def number(key: str, kind=float):
        return kind(float(tags[key])) if key in tags else None

    return Registration(model_name=registry.model_name, version=str(version.version),
                        aliases=[], promoted=tags[PROMOTION] == "promoted",
                        reason=tags.get(PROMOTION_REASON, ""), metric=registry.metric,
                        value=value, champion_version=tags.get(COMPARED_WITH),
                        champion_value=number(CHAMPION_VALUE),
                        compared_images=number(COMPARED_IMAGES, int),
                        p_value=number(MCNEMAR_P_VALUE), warning=warning,
                        awaiting_approval=tags.get(APPROVAL) == "waiting")


class Approval(RunInput):
    """A person's answer to a challenger that passed the gate (registry.approval=manual)."""

    approve: bool = Field(description="Make this version champion?")
    comment: str = Field("", description="Why; recorded on the version.")


# The server fails a pause whose own timeout has passed, racing our "no answer" ending; its
# timeout outlives our wait by this much, so only a flow process that died leaves it to the server.
SERVER_PAUSE_GRACE_S = 600


def ask_for_approval(registration: Registration, timeout_s: int, summary: str = "",
                     review_url: str = "") -> Approval | None:
    """Pause the flow run until a person answers in the Prefect UI (None: no answer in time).

    Called from the flow itself: only a flow run can be paused, not a task. This is Prefect's
    `pause_flow_run(wait_for_input=...)`, except that we end the wait ourselves: with one timeout
    for both, the server's pause expiry can fail the run just as we resume it to record "no answer".
    """
    from prefect.client.orchestration import get_client
    from prefect.input.actions import read_flow_run_input
    from prefect.input.run_input import keyset_from_paused_state
    from prefect.runtime import flow_run
    from prefect.states import Paused, Running

    run_logger().info("%s v%s passed the gate; waiting up to %d s for a person to approve or "
                      "reject it (Prefect UI: this flow run, Resume)", registration.model_name,
                      registration.version, timeout_s)
    run_id = flow_run.get_id()
    paused = Paused(timeout_seconds=timeout_s + SERVER_PAUSE_GRACE_S, reschedule=False,
                    pause_key=f"approve-v{registration.version}",
                    # What a notification of the pause says (commands/notify.py)
                    message=registration.description()
                    + (f" Review: {review_url}" if review_url else ""))
    keyset = keyset_from_paused_state(paused)
    paused.state_details.run_input_keyset = keyset
    with get_client(sync_client=True) as client:
        result = client.set_flow_run_state(run_id, paused)
        if not (result.state and result.state.is_paused()):
            raise RuntimeError(f"Prefect refused to pause the run for approval: {result.details}")
        # The form the UI shows, under the review's top lines and link
        described = summary or registration.description()
        if review_url:
            described += f"\n\n[The review report]({review_url})"
        Approval.with_initial_data(description=described).save(keyset)
        deadline, poll_s = time.monotonic() + timeout_s, min(10, max(1, timeout_s // 4))
        while True:
            state = client.read_flow_run(run_id).state
            if state is not None and state.is_running():
                return Approval.load(keyset)
            if time.monotonic() >= deadline:
                break
            time.sleep(poll_s)
        client.set_flow_run_state(run_id, Running(), force=True)
    late = read_flow_run_input(keyset["response"])  # an answer given as the wait ended
    return Approval(**late) if late else None


@task
def apply_approval(registration: Registration, answer: Approval | None) -> Registration:
    """Promote on a person's yes, if the champion it was compared with is still champion."""
    client = MlflowClient(tracking_uri())
    r = registration.model_copy(update={"awaiting_approval": False})
    with one_decision_at_a_time(r.model_name):
        current = champion_version(client, r.model_name)
        now = str(current.version) if current is not None else None
        if answer is None:
            r = r.model_copy(update={"reason": f"{r.reason}; no answer to the approval request "
                                     "in time, so not promoted"})
            approval = "no answer"
        elif not answer.approve:
            r = r.model_copy(update={"reason": f"{r.reason}; rejected by a person"
                                     + (f": {answer.comment}" if answer.comment else "")})
            approval = "rejected"
        elif now != r.champion_version:
            r = r.model_copy(update={"reason": f"{r.reason}; approved, but the champion became "
                                     f"v{now} while waiting, so not promoted: run again to "
                                     "compare with it"})
            approval = "approved"
        else:
            r = r.model_copy(update={"promoted": True, "reason": f"{r.reason}; approved by a "
                                     "person" + (f": {answer.comment}" if answer.comment else "")})
            approval = "approved"
        if answer is not None and answer.comment:
            client.set_model_version_tag(r.model_name, r.version, "trainflow.approval_comment",
                                         answer.comment)
        r = record(client, r, approval)
        client.set_model_version_tag(r.model_name, r.version, "trainflow.approved_at",
                                     time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    run_logger().info("%s", r.description())
    return r
