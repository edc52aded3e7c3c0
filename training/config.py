"""Typed configuration, one model per concern, shared by the flow and the training job file.

The job file itself (`TrainJob`) and the results the stages hand on are in training/handoff.py.

Every model forbids unknown fields so that a typo in `prefect.yaml` or `--param` fails
at validation instead of being silently ignored.
"""

from __future__ import annotations

import os
import re
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from training.catalogue import torchvision_dataset_names, torchvision_model_names

_KAGGLE_COMPETITION = re.compile(r"^kaggle:competitions/([a-z0-9][a-z0-9-]*)$")
_KAGGLE_DATASET = re.compile(r"^kaggle:datasets/([A-Za-z0-9_-]+)/([A-Za-z0-9][A-Za-z0-9_.-]*)$")
_TIMM_MODEL = re.compile(r"^timm:[A-Za-z0-9_.\-]+$")
_USER_MODEL = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]+):")
BUILTIN_DATASETS = ("digits",)


class Spec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Role(StrEnum):
    """What a training field is for, declared on the field; every rule below derives from it."""

    RECIPE = "recipe"
    """What the model learns: in the spec hash, searchable by a sweep, replayed by rerun."""
    BUDGET = "budget"
    """How long it learns (epochs): in the spec hash, but a sweep's budget, never searched."""
    LAUNCH = "launch"
    """Where and how the launch runs: outside the spec hash (the world size it gives counts on
    its own), never searched, never replayed by `trainflow rerun`."""
    MACHINE = "machine"
    """A launch field the train task sets for each machine: also left out of what one
    machine's launch on its own (evaluation, scoring) or the tracked parameters carry."""


class DatasetSpec(Spec):
    """Where the images come from and how their labels are read."""

    source: str = Field(
        description='"builtin:digits", "kaggle:competitions/<slug>", '
        '"kaggle:datasets/<owner>/<slug>", "torchvision:<Name>" (e.g. "torchvision:MNIST", '
        '"torchvision:EMNIST/balanced": its official test split is the test split), '
        '"hf:<name or local folder>" (a Hugging Face dataset; its test split, if any, is the '
        "test split) or a local folder path."
    )
    root: str | None = Field(
        None, description='torchvision sources: the folder torchvision\'s class reads and '
        'downloads into (default: <home>/datasets/torchvision); a copy there works offline.')
    image_column: str = Field("image", description="hf sources: the column of images.")
    label_column: str = Field(
        "label", description="hf sources: the column of labels (a ClassLabel names the classes).")
    labels: str = Field(
        "folders",
        description='"folders" (one sub-folder per class), "filename" (cat.12.jpg -> cat) '
        'or "csv:<relative path>" with columns file,label.',
    )
    subdir: str | None = Field(
        None, description='Folder inside the source that holds the images, e.g. "train".'
    )
    download_retries: int = Field(
        3, ge=0, le=20, description="Retries of an interrupted Kaggle download."
    )
    version: Literal["latest"] | int = Field(
        "latest", description='Kaggle datasets: "latest" (each run asks Kaggle for the current '
        "version and downloads a new one beside the old) or a version number that pins it.")

    @field_validator("source")
    @classmethod
    def _known_source(cls, source: str) -> str:
        source = source.strip()
        if not source:
            raise ValueError('dataset.source is empty. Example: "builtin:digits"')
        if source.startswith("builtin:"):
            name = source.removeprefix("builtin:")
            if name not in BUILTIN_DATASETS:
                raise ValueError(
                    f"unknown built-in dataset {name!r}; available: "
                    + ", ".join(f'"builtin:{n}"' for n in BUILTIN_DATASETS)
                )
        elif source.startswith("kaggle:"):
            if not (_KAGGLE_COMPETITION.match(source) or _KAGGLE_DATASET.match(source)):
                raise ValueError(
                    f"cannot read Kaggle source {source!r}. Examples: "
                    '"kaggle:competitions/dogs-vs-cats-redux-kernels-edition" or '
                    '"kaggle:datasets/<owner>/<slug>"'
                )
        elif source.startswith("torchvision:"):
            name = source.removeprefix("torchvision:").partition("/")[0]
            if name not in torchvision_dataset_names():
                raise ValueError(
                    f"unknown torchvision dataset {name!r} in {source!r}; use a class of "
                    'torchvision.datasets, e.g. "torchvision:MNIST" or "torchvision:CIFAR10"')
        elif source.startswith("hf:"):
            if not source.removeprefix("hf:").strip():
                raise ValueError('dataset.source "hf:" names no dataset; e.g. "hf:mnist" or '
                                 '"hf:/data/my-parquet-folder"')
        elif _SCHEME.match(source) and not Path(source).exists():
            scheme = _SCHEME.match(source).group(1)
            raise ValueError(
                f"unknown dataset source scheme {scheme!r} in {source!r}; use "
                '"builtin:digits", "kaggle:competitions/<slug>", "kaggle:datasets/<owner>/<slug>", '
                '"torchvision:<Name>", "hf:<name>" or a local folder path'
            )
        return source

    @model_validator(mode="after")
    def _fields_of_the_source(self) -> DatasetSpec:
        if self.root is not None and self.kind != "torchvision":
            raise ValueError(f"dataset.root is the folder of a torchvision source; {self.source!r} "
                             "is not one: leave root unset")
        if self.kind in ("torchvision", "hf") and (self.labels != "folders" or self.subdir):
            raise ValueError(f"{self.source!r} names its own labels and splits: leave "
                             "dataset.labels and dataset.subdir unset")
        if self.kind != "hf" and (self.image_column, self.label_column) != ("image", "label"):
            raise ValueError("dataset.image_column and label_column name the columns of an "
                             f'"hf:" source; {self.source!r} is not one: leave them unset')
        return self

    @model_validator(mode="after")
    def _version_pins_a_dataset(self) -> DatasetSpec:
        if self.version != "latest":
            if not _KAGGLE_DATASET.match(self.source):
                raise ValueError(f"dataset.version {self.version} pins a Kaggle dataset's version; "
                                 f"{self.source!r} has none: leave version \"latest\"")
            if self.version < 1:
                raise ValueError(f"dataset.version must be 1 or more, got {self.version}")
        return self

    @field_validator("labels")
    @classmethod
    def _known_layout(cls, labels: str) -> str:
        if labels in ("folders", "filename"):
            return labels
        if labels.startswith("csv:") and labels.removeprefix("csv:").strip():
            csv_path = labels.removeprefix("csv:")
            if Path(csv_path).is_absolute() or ".." in Path(csv_path).parts:
                raise ValueError(
                    f"dataset.labels {labels!r}: the CSV path must be relative to the source "
                    'folder, e.g. "csv:labels.csv"'
                )
            return labels
        raise ValueError(
            f'unknown label layout {labels!r}; use "folders", "filename" or "csv:<relative path>"'
        )

    @field_validator("subdir")
    @classmethod
    def _relative_subdir(cls, subdir: str | None) -> str | None:
        if subdir and (Path(subdir).is_absolute() or ".." in Path(subdir).parts):
            raise ValueError(f'dataset.subdir {subdir!r} must be a relative folder like "train"')
        return subdir or None

    @property
    def kind(self) -> Literal["builtin", "kaggle", "torchvision", "hf", "local"]:
        for scheme in ("builtin", "kaggle", "torchvision", "hf"):
            if self.source.startswith(f"{scheme}:"):
                return scheme
        return "local"

    @property
    def name(self) -> str:
        """What follows the scheme: "MNIST" of "torchvision:MNIST"."""
        return self.source.partition(":")[2] if self.kind != "local" else self.source

    @property
    def registered_name(self) -> str:
        """The registered model name a run on this dataset gets unless it names one: the last
        part of the source's name ("dogs-vs-cats" of a Kaggle competition, "flowers" of a
        folder /data/flowers), lower case, in the characters MLflow takes."""
        name = self.name.rstrip("/\\") if self.kind in ("local", "hf") else self.name
        last = re.split(r"[/\\]", name)[-1] if self.kind != "torchvision" else name.split("/")[0]
        cleaned = re.sub(r"[^a-z0-9_.-]+", "-", last.lower()).strip("-.")
        return cleaned or "model"

    @property
    def kaggle_ref(self) -> tuple[str, str]:
        """("competitions", slug) or ("datasets", "owner/slug")."""
        kind, _, ref = self.source.removeprefix("kaggle:").partition("/")
        return kind, ref


class AuditSpec(Spec):
    """The data audit run with every split (training/data/audit.py): duplicates, likely wrong
    labels and outliers, and duplicate groups kept on one side of the split."""

    enabled: bool = Field(True, description="Audit the images on every run; false skips it.")
    leakage: Literal["report", "quarantine"] = Field(
        "report", description="A duplicate group already on both sides of the split (placed "
        "before the audit, or given split that way): report it, or quarantine its train and val "
        "copies (left out of training and recorded in audit.json).")
    labels_from: Literal["thumbnails", "backbone"] = Field(
        "thumbnails", description="What the label check classifies: 8x8 thumbnails (cheap; "
        "right for digits and simple shapes, most photos are left unchecked), or the starting "
        "backbone of a fine-tune (a forward pass over every image: on 2 CPU cores about as long "
        "as half an epoch of training).")
    max_label_issue_share: float = Field(
        0.05, ge=0, le=1, description="Warn when more than this share of the images look "
        "mislabelled.")


class SplitSpec(Spec):
    """Stratified, seeded train/val/test split."""

    val_fraction: float = Field(0.1, gt=0, lt=1, description="Share of each class for validation.")
    test_fraction: float = Field(0.1, gt=0, lt=1, description="Share of each class for testing.")
    seed: int = Field(42, description="Seed of the per-file hash that assigns splits.")
    respect_given: bool = Field(
        True, description="A folder that comes split (train/ and test/, optionally val/ or "
        "valid/, each with one folder per class) keeps its splits: the given test set is the "
        "test set, and without a val folder val is carved from train (val_fraction of it). "
        "False: all its images are split as any other folder's.")

    @model_validator(mode="after")
    def _fractions_leave_training_data(self) -> SplitSpec:
        if self.val_fraction + self.test_fraction >= 1:
            raise ValueError(
                f"split.val_fraction + split.test_fraction = "
                f"{self.val_fraction + self.test_fraction:g} leaves no training data; "
                "they must sum below 1, e.g. val_fraction=0.1, test_fraction=0.1"
            )
        return self


def default_lr(model: str) -> float:
    """The peak learning rate a spec gets when it names none: basicnet, small and shallow, is
    short of steps on small data and gains from a higher rate than deeper networks tolerate
    from scratch (bench/RESULTS.md, the demo's recipe)."""
    return 1e-2 if model == "basicnet" else 5e-3


FINE_TUNING = {"image_size": 224, "fit": "crop", "augment": "crop_flip", "optimizer": "adamw",
               "lr": 1e-3, "backbone_lr_factor": 0.1}
"""The recipe's defaults when training starts from pretrained weights or a weights file: the
ImageNet habits the weights were made with (224 px, aspect kept, random resized crops and
flips) and a fine-tune's rates (bench/RESULTS.md, "Fine-tuning real weights")."""
FROM_SCRATCH = {"image_size": 28, "fit": "squash", "augment": "none", "optimizer": "adam",
                "backbone_lr_factor": 1.0}


def fine_tuning(fields: dict[str, Any]) -> bool:
    return bool(fields.get("pretrained") or fields.get("weights"))


def recipe_default(name: str):
    """A default that follows the starting weights: FINE_TUNING's with pretrained weights or a
    weights file, else FROM_SCRATCH's."""
    def factory(fields: dict[str, Any]):
        if name == "lr" and not fine_tuning(fields):
            return default_lr(fields.get("model", "basicnet"))
        return (FINE_TUNING if fine_tuning(fields) else FROM_SCRATCH)[name]
    return factory


class TrainingSpec(Spec):
    """What to train and how, including how `accelerate launch` is called."""

    model: Annotated[str, Role.RECIPE] = Field(
        "basicnet",
        description='"basicnet", "resnet18", "vgg16" or any torchvision classification model, '
        '"timm:<name>" from timm\'s catalogue (pip install "trainflow[timm]"), '
        'or your own network as "<module>:<callable>" (e.g. "mypkg.nets:build"): importable '
        "where the ranks run, called with num_classes=, returning a torch.nn.Module; its "
        "module travels with the registered model.",
    )
    pretrained: Annotated[bool, Role.RECIPE] = Field(
        False, description="Start from the model's published weights: torchvision's from the "
        "torch cache, timm's from the Hugging Face cache (a local file: training.weights). For "
        "your own \"<module>:<callable>\": the callable returns pretrained weights; unset, the "
        "preflight finds that out (two builds under two seeds come out identical) and says so. "
        "Either way the fine-tuning defaults follow.")
    weights: Annotated[str | None, Role.RECIPE] = Field(
        None, description="A weights file to start from, for any model: safetensors, or a "
        "state dict saved with torch.save (read without unpickling code). The head is new "
        "when the file's has another class count; inputs are normalised as training.normalization "
        "says (ImageNet's statistics unless the model declares its own).")
    image_size: Annotated[int, Role.RECIPE] = Field(
        default_factory=recipe_default("image_size"), ge=8, le=1024,
        description="Square input size in pixels. Default: 224 with pretrained weights or a "
        "weights file (the ImageNet habit; a pretrained network of your own that declares "
        "pretrained_cfg[\"input_size\"] gets that), else 28. The preflight passes one image of "
        "this size through the network and names the smallest it takes when it cannot.")
    fit: Annotated[Literal["crop", "squash"], Role.RECIPE] = Field(
        default_factory=recipe_default("fit"),
        description="How an image becomes a square. crop: its aspect kept, the shorter side "
        "resized to 8/7 of image_size (256 for 224) and the centre cut out, at evaluation and "
        "serving (training crops from the same resize); the default with pretrained weights or "
        "a weights file, which were trained so. squash: the whole image resized to the square; "
        "the default from scratch (digits, icons).")
    epochs: Annotated[int, Role.BUDGET] = Field(2, ge=1, le=10_000)
    batch_size: Annotated[int, Role.RECIPE] = Field(
        16, ge=1, le=65_536, description="Images per optimizer step on each process (the "
        "effective batch is this x processes x gradient_accumulation_steps). Small models on "
        "small data are short of optimizer steps, not epochs.")
    lr: Annotated[float, Role.RECIPE] = Field(
        default_factory=recipe_default("lr"), gt=0, le=10,
        description="Peak learning rate (of the head, with backbone_lr_factor). Default: 0.01 "
        "for basicnet, 0.005 for other models, for training from scratch with the onecycle "
        "schedule; fine-tuning (pretrained weights or a weights file): 0.001 for the new head "
        "with adamw, the backbone at backbone_lr_factor 0.1 of it.")
    optimizer: Annotated[Literal["adam", "adamw", "sgd"], Role.RECIPE] = Field(
        default_factory=recipe_default("optimizer"), description='"adam", "adamw" or "sgd" '
        "(momentum 0.9). Default: adam from scratch, adamw when fine-tuning.")
    weight_decay: Annotated[float, Role.RECIPE] = Field(0.0, ge=0)
    augment: Annotated[Literal["none", "crop", "crop_flip", "trivialaugment", "randaugment"],
                       Role.RECIPE] = Field(
        default_factory=recipe_default("augment"),
        description="none: resize only; right for digits, text and short trainings (the "
        "default from scratch). crop: a random resized crop of crop_min_scale-100% of the "
        "image; for objects that move and change size in the frame. crop_flip: crop plus a "
        "left-right flip; for natural photos where a mirror image is the same class (cats, "
        "dogs), never for digits or text; the default when fine-tuning. trivialaugment, "
        "randaugment: crop_flip plus torchvision's TrivialAugmentWide or RandAugment, for "
        "longer trainings. Applied per image on the device, to the decoded uint8 images.",
    )
    normalization: Annotated[Literal["auto", "imagenet", "inception"], Role.RECIPE] = Field(
        "auto", description="The input statistics the weights expect. imagenet: torchvision's "
        "mean and std; inception: [-1, 1] (mean 0.5, std 0.5: Inception, TensorFlow's "
        "EfficientNet-Lite, many timm weights). auto: the weights' own (timm's pretrained_cfg, "
        "or a user module's `pretrained_cfg = {\"mean\": ..., \"std\": ...}`), else imagenet "
        "for pretrained weights and weights files, and 0.5 +- 0.5 from scratch.")
    crop_min_scale: Annotated[float, Role.RECIPE] = Field(
        0.7, gt=0, le=1,
        description="The smallest share of the image's area a random crop keeps (torchvision's "
        "RandomResizedCrop scale=(crop_min_scale, 1)). Heavy crops (ImageNet's 0.08, or 0.35) "
        "cost short trainings accuracy, from scratch and fine-tuning alike.")
    lr_schedule: Annotated[Literal["constant", "cosine", "onecycle", "step"], Role.RECIPE] = Field(
        "onecycle",
        description="Per-step learning rate, from torch's schedulers: onecycle (OneCycleLR: up "
        "from 10% of lr over 30% of training, or warmup_epochs, then down to about 0); "
        "constant; cosine (CosineAnnealingLR, down to 0 at the end); step (x0.1 after each "
        "third of training); the last three after a LinearLR warm-up when warmup_epochs > 0.",
    )
    warmup_epochs: Annotated[float, Role.RECIPE] = Field(
        0.0, ge=0, description="Linear warm-up from 10% of lr over this many epochs (0: none)."
    )
    early_stopping_patience: Annotated[int | None, Role.RECIPE] = Field(
        None, ge=1, description="Stop after this many epochs without a validation accuracy gain "
        "of more than early_stopping_min_delta (None: run every epoch). The best epoch is kept."
    )
    early_stopping_min_delta: Annotated[float, Role.RECIPE] = Field(
        0.0, ge=0, description="The validation accuracy gain that counts as an improvement."
    )
    gradient_accumulation_steps: Annotated[int, Role.RECIPE] = Field(
        1, ge=1, le=1024, description="Batches per optimizer step: the effective batch is "
        "batch_size x processes x this."
    )
    class_weights: Annotated[Literal["none", "balanced"], Role.RECIPE] = Field(
        "none", description="balanced: each class's share of the training loss weighted by "
        "n / (classes x its train images), as scikit-learn's class_weight=\"balanced\", so a "
        "rare class counts as much as a common one; none: every image alike.")
    label_smoothing: Annotated[float, Role.RECIPE] = Field(
        0.1, ge=0, lt=1,
        description="Cross-entropy label smoothing (0.1 as torchvision's recipes).")
    channels_last: Annotated[bool, Role.RECIPE] = Field(
        True, description="NHWC memory layout for convolutions, faster on CPUs and on GPUs "
        "with tensor cores.")
    batchnorm: Annotated[Literal["auto", "train", "frozen", "sync"], Role.RECIPE] = Field(
        "auto", description="BatchNorm during training. train: each rank's own batch "
        "statistics. sync: statistics over every rank's batch (torch's SyncBatchNorm; CUDA "
        "only). frozen: the running statistics the weights came with, the layers in eval mode "
        "(their scale and shift still learn), as detectron2's FrozenBatchNorm. auto: sync with "
        "several CUDA processes; frozen when fine-tuning with fewer than "
        "32 images per rank (a few images' statistics are noise beside ImageNet's); else "
        "train. The choice is logged with the run's parameters (batchnorm_used).")
    compile: Annotated[bool, Role.RECIPE] = Field(
        False, description="torch.compile the model (slow first epoch).")
    loader_workers: Annotated[int | Literal["auto"], Role.RECIPE] = Field(
        "auto", description='DataLoader worker processes per rank. "auto": 0 on a machine '
        "without GPUs (measured: a worker competes with the ranks for cores), else the cores "
        "each GPU's rank can spare (cores per rank - 1, at most 4), so loading overlaps "
        "compute. Batches are pinned on a GPU.")
    freeze_backbone: Annotated[bool, Role.RECIPE] = Field(
        False, description="Train only the new classification head (with pretrained=true)."
    )
    backbone_lr_factor: Annotated[float, Role.RECIPE] = Field(
        default_factory=recipe_default("backbone_lr_factor"), gt=0, le=1,
        description="The backbone's learning rate is lr x this; the head's is lr. Default: 0.1 "
        "when fine-tuning (the pretrained layers move less than the new head), else 1.")
    freeze_epochs: Annotated[float, Role.RECIPE] = Field(
        0.0, ge=0,
        description="Train the head alone for this many epochs (fractions allowed) before "
        "every layer learns, as fastai's fine_tune: the new head's first, random gradients "
        "do not reach the pretrained layers. Needs pretrained weights or a weights file.")
    head: Annotated[str | None, Role.RECIPE] = Field(
        None, description="The classifier head's module name (e.g. \"fc\", "
        "\"classifier.1\"), replaced for the new classes and trained at the full lr. None: "
        "timm's get_classifier(), else the last nn.Linear of the network.")
    choose_epoch: Annotated[Literal["auto", "val_loss", "val_accuracy", "last"],
                            Role.RECIPE] = Field(
        "auto", description="Which epoch's weights are kept. auto: the best on the val figure "
        "of the metric the gate compares (registry.metric), and of epochs within the val "
        "split's binomial noise of each other the one with the lower val loss; the last epoch "
        "when the val split has fewer than choose_min_val_images images, where any choice is "
        "noise. val_loss: the lowest validation loss; val_accuracy: the highest accuracy, "
        "exact ties by loss; last: the last epoch.")
    choose_min_val_images: Annotated[int, Role.RECIPE] = Field(
        100, ge=0, description="With choose_epoch auto: the smallest val split the epoch is "
        "chosen on; below it the last epoch is kept, and the run says why.")
    num_processes: Annotated[int | Literal["auto"], Role.LAUNCH] = Field(
        "auto", description='Processes on this machine; "auto": the GPUs, or 2 on a CPU machine.'
    )
    mixed_precision: Annotated[Literal["no", "fp16", "bf16"], Role.RECIPE] = "no"
    seed: Annotated[int, Role.RECIPE] = 42
    num_machines: Annotated[int, Role.LAUNCH] = Field(
        1, ge=1, description="Machines to train on. Above 1, the train task starts one "
        "train-node flow run per machine through the work pool (docs/multi-machine.md).")
    machine_rank: Annotated[int, Role.MACHINE] = Field(
        0, ge=0, description="This machine's place; set per node by the "
                              "train task, by hand only for a bare `accelerate launch`.")
    main_process_ip: Annotated[str | None, Role.MACHINE] = Field(
        None, description="Address of machine 0 that the others join; None: machine 0 finds "
        "and reports its own.")
    main_process_port: Annotated[int | None, Role.MACHINE] = Field(
        None, ge=1, le=65535, description="None: a free port.")
    node_deployment: Annotated[str, Role.LAUNCH] = Field(
        "train-node/nodes", description="The deployment that runs one machine's launch.")
    node_work_queue: Annotated[str, Role.LAUNCH] = Field(
        "machine-{machine_rank}", description="Work queue of each node's run; one queue per "
        "machine (one worker each) places every node on its own machine. Without "
        "{machine_rank}, all nodes share one queue (e.g. Kubernetes, which places the pods).")
    rendezvous_timeout_s: Annotated[float, Role.LAUNCH] = Field(
        120, gt=0, description="How long the machines wait for each other to start and join.")
    max_restarts: Annotated[int, Role.LAUNCH] = Field(
        0, ge=0, description="Elastic restarts of every rank after a failure (torchrun's "
        "--max_restarts); each restart resumes from the last checkpoint.")
    accelerate_config_file: Annotated[str | None, Role.LAUNCH] = Field(
        None, description="An accelerate config file; replaces the launch options above."
    )
    timeout_s: Annotated[float | None, Role.LAUNCH] = Field(
        None, gt=0, description="Kill the launch after this long.")
    hang_timeout_s: Annotated[float, Role.LAUNCH] = Field(
        300, gt=0, description="Kill the launch when no rank made progress for this long."
    )
    preemption_grace_s: Annotated[float, Role.LAUNCH] = Field(
        25, gt=0, le=3600, description="After a SIGTERM (a spot notice, a Kubernetes "
        "eviction, the task being stopped), how long the ranks have to finish the step all of "
        "them agree on (every heartbeat_steps optimizer steps) and save there before they are "
        "killed. Keep it below the platform's own grace (Kubernetes: 30 s by default; torchrun "
        "waits 30 s).")
    heartbeat_steps: Annotated[int, Role.LAUNCH] = Field(
        10, ge=1, description="Each rank reports every N steps.")

    @field_validator("model")
    @classmethod
    def _known_model(cls, model: str) -> str:
        if (model == "basicnet" or model in torchvision_model_names() or _USER_MODEL.match(model)
                or _TIMM_MODEL.match(model)):
            return model
        raise ValueError(
            f"unknown model {model!r}; use \"basicnet\", \"resnet18\", \"vgg16\" or another "
            "name from torchvision.models.list_models(), \"timm:<name>\" from timm's catalogue, "
            'or your own network as "<module>:<callable>", e.g. "mypkg.nets:build"'
        )

    @field_validator("num_processes")
    @classmethod
    def _positive_processes(cls, n: int | str) -> int | str:
        if n != "auto" and n < 1:
            raise ValueError(f'training.num_processes must be at least 1 or "auto", got {n}')
        return n

    @field_validator("node_work_queue")
    @classmethod
    def _queue_template(cls, name: str) -> str:
        try:
            name.format(machine_rank=0)
        except (KeyError, IndexError, ValueError):
            raise ValueError(f"training.node_work_queue {name!r} may use only {{machine_rank}}, "
                             'e.g. "machine-{machine_rank}"') from None
        return name

    @property
    def starts_from_weights(self) -> bool:
        """A fine-tune: pretrained weights or a weights file (the recipe's defaults follow it)."""
        return bool(self.pretrained or self.weights)

    def workers_per_rank(self, on_gpu: bool, cores: int, ranks_here: int) -> int:
        """loader_workers with "auto" decided for a rank on this machine."""
        if self.loader_workers != "auto":
            return self.loader_workers
        if not on_gpu:
            return 0
        return max(0, min(4, cores // max(1, ranks_here) - 1))

    def node_queue(self, machine_rank: int) -> str:
        return self.node_work_queue.format(machine_rank=machine_rank)

    @model_validator(mode="after")
    def _consistent(self) -> TrainingSpec:
        if self.warmup_epochs >= self.epochs and self.warmup_epochs > 0:
            raise ValueError(f"training.warmup_epochs {self.warmup_epochs:g} must be below "
                             f"training.epochs {self.epochs}, e.g. warmup_epochs=1, epochs=10")
        if self.freeze_backbone and not self.starts_from_weights:
            raise ValueError("training.freeze_backbone needs pretrained weights to freeze: set "
                             "training.pretrained=true or training.weights, or "
                             "freeze_backbone=false")
        if self.pretrained and self.weights:
            raise ValueError("give training.pretrained=true (torchvision's weights) or "
                             "training.weights (a file), not both")
        if self.freeze_epochs and not self.starts_from_weights:
            raise ValueError("training.freeze_epochs trains a new head on pretrained weights: "
                             "set training.pretrained=true or training.weights, or "
                             "freeze_epochs=0")
        if self.freeze_epochs and self.freeze_epochs >= self.epochs:
            raise ValueError(f"training.freeze_epochs {self.freeze_epochs:g} leaves no epoch for "
                             f"every layer: keep it below training.epochs {self.epochs}, e.g. "
                             "freeze_epochs=1 with epochs=3")
        if self.freeze_backbone and self.model == "basicnet":
            raise ValueError('training.freeze_backbone needs a torchvision model, e.g. "resnet18"')
        return self

    @model_validator(mode="after")
    def _machine_rank_in_range(self) -> TrainingSpec:
        if self.machine_rank >= self.num_machines:
            raise ValueError(
                f"training.machine_rank {self.machine_rank} must be below "
                f"training.num_machines {self.num_machines}"
            )
        return self

    def on_this_machine(self) -> TrainingSpec:
        """The same spec for a launch on this machine alone (evaluation, scoring)."""
        fresh = {name: TrainingSpec.model_fields[name].default for name in PER_MACHINE}
        return self.model_copy(update={**fresh, "num_machines": 1})

    def resolved_num_processes(self, gpus: int | None = None) -> int:
        """Processes on this machine, with "auto" decided by the hardware that is here (`gpus`:
        its GPU count, asked of CUDA when not given)."""
        if self.num_processes != "auto":
            return self.num_processes
        if gpus is None:
            from training.hardware import cuda_gpu_count

            gpus = cuda_gpu_count()
        if gpus:
            return gpus
        return 2 if (os.cpu_count() or 1) >= 2 else 1


class RegistrySpec(Spec):
    """How the trained model is registered and when it becomes the champion."""

    model_name: str | None = Field(
        None, min_length=1, description="Registered model name. None: the dataset's own, so "
        "that each dataset's models are versions of one name and no other's: digits for "
        "builtin:digits, the folder's name for a folder, the competition's or dataset's slug "
        "for Kaggle, the table's name for torchvision and Hugging Face (lower case).")
    metric: Literal["accuracy", "macro_f1", "balanced_accuracy", "roc_auc"] = Field(
        "accuracy", description="Test metric the champion/challenger gate compares. With "
        "unbalanced classes use macro_f1 or balanced_accuracy (the mean of the classes' "
        "recalls): a model that ignores a rare class can win on accuracy.")
    min_improvement: float = Field(0.0, ge=0, description="Needed margin over the champion.")
    promote: bool = Field(True, description="False: register as challenger only.")
    significance: float | None = Field(
        0.05, gt=0, lt=1,
        description="A challenger is promoted only when McNemar's test on the test split "
        "says its gain over the champion is not noise at this level (None: any gain counts). "
        "Every model must also beat the majority-class predictor at this level (binomial test).",
    )
    approval: Literal["auto", "manual"] = Field(
        "auto", description="auto: a challenger that passes the gate becomes champion. manual: "
        "it waits for a person to approve or reject it in the Prefect UI (the paused flow "
        "run's form), and the answer and comment are recorded on the version.")
    approval_timeout_s: int = Field(
        86_400, ge=1, description="With approval=manual: no answer in this long leaves the "
        "version unpromoted, and the version says so.")


class RetrainSpec(Spec):
    """When new data starts a train-flow deployment's run (read by watch-data, not the run)."""

    min_new_images: int = Field(
        1, ge=1, description="New or changed labelled images, counted since the last retrain "
        "watch-data started, that make it emit trainflow.dataset.changed as due: the "
        "deployment's trigger on that event starts a run (prefect.yaml).")


class DriftSpec(Spec):
    """When predict-flow calls what it scored drifted from the champion's own test set."""

    check: bool = Field(True, description="Compare each batch with the champion's test set.")
    p_value: float = Field(
        0.01, gt=0, lt=1, description="A test is failed below this p-value, after "
        "Bonferroni's correction for the number of tests.")
    min_effect: float = Field(
        0.1, ge=0, le=1, description="And only when its effect is at least this large "
        "(Kolmogorov-Smirnov distance, or Cramer's V for the class shares), so that a large "
        "batch does not call a trivial difference drift.")
    statistics_images: int = Field(
        2000, ge=100, description="The image statistics are read from this many images of a "
        "batch at most, spread evenly over it (about 0.5 ms an image on a CPU core); class "
        "shares and confidence use every image.")


def fields_with(*roles: Role) -> frozenset[str]:
    """The TrainingSpec fields declared with one of `roles`."""
    return frozenset(name for name, info in TrainingSpec.model_fields.items()
                     if any(role in info.metadata for role in roles))


LAUNCH_ONLY = fields_with(Role.LAUNCH, Role.MACHINE)
PER_MACHINE = fields_with(Role.MACHINE)
SEARCHABLE = fields_with(Role.RECIPE)


BLOCKS: dict[str, type[Spec]] = {"dataset": DatasetSpec, "split": SplitSpec,
                                 "training": TrainingSpec, "registry": RegistrySpec,
                                 "audit": AuditSpec}
"""The flows' parameter blocks, by their public names."""


def as_fields(value: Any) -> Any:
    """A block as the fields it names: a model counts only the fields it was given."""
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json", exclude_unset=True)
    return value


def merge_blocks(base: dict[str, Any], run: dict[str, Any], blocks: tuple[str, ...]
                 ) -> dict[str, Any]:
    """`run` over `base`, one level deeper for the parameter blocks named in `blocks`."""
    merged = {**base, **run}
    for name in blocks:
        below, above = as_fields(base.get(name)), as_fields(run.get(name))
        if isinstance(below, dict) and isinstance(above, dict):
            merged[name] = {**below, **above}
        elif above is not None:
            merged[name] = above
    return merged


class InvalidParameters(ValueError):
    """Parameters a run cannot start with: one line per problem, each naming the field, the
    value and what to use instead."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("invalid parameters: " + "; ".join(problems))


def problems_of(error: ValidationError, block: str | None = None) -> list[str]:
    """Pydantic's errors as `block.field: message (got value)` lines, without its URL."""
    lines = []
    for err in error.errors():
        if err["type"] == "default_factory_not_called":  # a default that follows another field
            continue  # whose own error is listed
        where = ".".join(str(p) for p in ((block,) if block else ()) + tuple(err["loc"]))
        message = err["msg"].removeprefix("Value error, ")
        given = err.get("input")
        shown = "" if message.count(repr(given)) or isinstance(given, dict) else f" (got {given!r})"
        lines.append(f"{where or 'parameters'}: {message}{shown}")
    return lines


def validate_blocks(params: dict[str, Any]) -> dict[str, Spec]:
    """The parameter blocks validated, every problem of every block reported at once."""
    specs, problems = {}, []
    for name, model in BLOCKS.items():
        try:
            specs[name] = model.model_validate(as_fields(params.get(name)) or {})
        except ValidationError as e:
            problems += problems_of(e, name)
    if problems:
        raise InvalidParameters(problems)
    if specs["registry"].model_name is None:  # a default that follows another block
        specs["registry"] = specs["registry"].model_copy(
            update={"model_name": specs["dataset"].registered_name})
    return specs
