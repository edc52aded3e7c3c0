"""sweep-flow's parameters: the search space over the training spec, and the study's budget."""

from __future__ import annotations

from pydantic import Field, field_validator, model_validator

from training.config import SEARCHABLE, Spec, TrainingSpec


class Distribution(Spec):
    """One searched field: exactly one of log_uniform, uniform, int_range or choice."""

    log_uniform: tuple[float, float] | None = Field(None, description="[low, high], low > 0")
    uniform: tuple[float, float] | None = Field(None, description="[low, high]")
    int_range: tuple[int, int] | None = Field(None, description="[low, high], both included")
    choice: list[str | int | float | bool | None] | None = Field(None, min_length=1)

    @model_validator(mode="after")
    def _exactly_one(self) -> Distribution:
        given = [k for k in ("log_uniform", "uniform", "int_range", "choice")
                 if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError('give exactly one of log_uniform, uniform, int_range or choice, '
                             'e.g. {"log_uniform": [1e-4, 1e-1]} or {"choice": [32, 64]}')
        low_high = self.log_uniform or self.uniform or self.int_range
        if low_high is not None and not low_high[0] < low_high[1]:
            raise ValueError(f"the range {list(low_high)} must be [low, high] with low < high")
        if self.log_uniform is not None and self.log_uniform[0] <= 0:
            raise ValueError(f"log_uniform needs low > 0, got {self.log_uniform[0]}")
        return self


class SweepSpec(Spec):
    """A hyperparameter search over the training spec (sweep-flow)."""

    search_space: dict[str, Distribution] = Field(
        description='Training fields to vary, e.g. {"lr": {"log_uniform": [1e-4, 1e-1]}, '
        '"batch_size": {"choice": [32, 64]}}.')
    n_trials: int = Field(8, ge=1, le=10_000, description="Trials in the study, all runs together.")
    max_concurrency: int = Field(1, ge=1, description="Trials at once (each gets its own GPUs).")
    budget_s: float | None = Field(None, gt=0, description="Start no new trial after this long.")
    pruning_startup_trials: int = Field(
        2, ge=0, description="Complete trials before any trial is pruned: the median of one "
        "trial is that trial's luck.")
    pruning_warmup_epochs: int = Field(
        1, ge=0, description="Epochs every trial trains before it may be pruned; a high "
        "learning rate often looks worst after its first epoch.")

    @field_validator("search_space")
    @classmethod
    def _known_fields(cls, space: dict[str, Distribution]) -> dict[str, Distribution]:
        return check_search_space(space)

    def base_trial(self, base: TrainingSpec) -> dict:
        """The base spec's own values that lie in the space: tried first, so that a sweep
        never ends below not sweeping (on validation accuracy)."""
        def inside(value, dist: Distribution) -> bool:
            if dist.choice is not None:
                return value in dist.choice
            low, high = dist.log_uniform or dist.uniform or dist.int_range
            return isinstance(value, int | float) and low <= value <= high

        values = {name: getattr(base, name) for name in self.search_space}
        return {k: v for k, v in values.items() if inside(v, self.search_space[k])}


def check_search_space(space: dict[str, Distribution]) -> dict[str, Distribution]:
    """The search space's rule, shared by SweepSpec and the CLI's typed arguments: searchable
    training fields only, and choices each field accepts."""
    if not space:
        raise ValueError('search_space is empty; e.g. {"lr": {"log_uniform": [1e-4, 1e-1]}}')
    unknown = sorted(set(space) - SEARCHABLE)
    if unknown:
        raise ValueError(f"search_space names {unknown}, which are not searchable training "
                         f"fields; use some of: {', '.join(sorted(SEARCHABLE))}")
    for name, dist in space.items():
        for value in dist.choice or []:
            try:
                TrainingSpec(**{name: value})
            except ValueError as e:
                raise ValueError(f"search_space.{name}: choice {value!r} is not a valid "
                                 f"training.{name}: {e}") from None
    return space
