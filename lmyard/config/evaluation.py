"""The `eval` section, its registration gates and the approval of a promotion."""

from __future__ import annotations

from pydantic import Field, model_validator

from lmyard.config.base import _Section


class MetricGate(_Section):
    """One gate on a logged metric: its final value must be at most `max`, or at least `min` (one of them)."""

    metric: str = Field(
        min_length=1,
        pattern=r"^[A-Za-z0-9_./ -]+$",
        description="A metric of the lineage's MLflow run (e.g. `loss/eval`, `task/hellaswag_acc_norm`, "
        "`task/arc_easy/acc`, `loss/val`).",
    )
    min: float | None = Field(None, description="The metric must be at least this.")
    max: float | None = Field(None, description="The metric must be at most this.")

    @model_validator(mode="after")
    def _one_bound(self) -> MetricGate:
        if (self.min is None) == (self.max is None):
            raise ValueError(
                f"gate on {self.metric!r} needs exactly one bound: min (higher is better) or max (lower is better)"
            )
        return self

    @property
    def name(self) -> str:
        return f"{self.metric} {'min' if self.min is not None else 'max'}"


class EvalGates(_Section):
    val_loss_max: float | None = Field(None, gt=0, description="The final val loss must be at most this.")
    hellaswag_acc_norm_min: float | None = Field(
        None, ge=0, le=1, description="The final HellaSwag acc_norm must be at least this."
    )
    metrics: list[MetricGate] = Field(
        default_factory=list,
        description="Gates on any logged metric, each `{metric: NAME, max: X}` or `{metric: NAME, min: X}`; "
        "the final value (the final evaluation's, else the run's latest) decides.",
    )

    def configured(self) -> dict[str, float]:
        """The named gates (val_loss_max, hellaswag_acc_norm_min) that are set."""
        return {k: v for k, v in self.model_dump(exclude={"metrics"}).items() if v is not None}


class EvalConfig(_Section):
    interval: int = Field(100, gt=0, description="Steps between validation-loss evaluations.")
    val_tokens: int = Field(32768, gt=0, description="Validation tokens scored per evaluation.")
    prompts: list[str] = Field(
        default_factory=lambda: ["The for statement", "Exceptions are", "A class is"],
        description="Fixed prompts sampled at the end of the run.",
    )
    sample_tokens: int = Field(160, ge=0, description="Tokens generated per prompt.")
    temperature: float = Field(0.8, gt=0)
    top_k: int | None = Field(40, gt=0)
    device: str = Field(
        "cpu",
        pattern=r"^(cpu|cuda(:\d+)?)$",
        description="Where checkpoint evaluation runs: `cpu`, or a spare GPU (`cuda:N`) so it does not slow training.",
    )
    threads: int | None = Field(None, gt=0, description="CPU threads of the evaluator; default: torch's default.")
    watch: bool = Field(
        True,
        description="Evaluate each new checkpoint while training runs (else every checkpoint after training ends).",
    )
    poll_s: float = Field(5.0, gt=0, description="Seconds between looks at the store for new checkpoints.")
    hellaswag: str | None = Field(
        None,
        description="HellaSwag-format multiple choice (ctx, endings, label): a JSONL path or s3:// URI, "
        "or a hub dataset name (e.g. `Rowan/hellaswag`); null: skipped.",
    )
    hellaswag_split: str = Field("validation", description="Split of a hub HellaSwag dataset.")
    hellaswag_limit: int | None = Field(None, gt=0, description="Score only the first N examples.")
    harness_tasks: list[str] = Field(
        default_factory=list,
        description="lm-evaluation-harness tasks run on each checkpoint's Hugging Face "
        "export (needs the `harness` extra), offline: `hellaswag_local` scores eval.hellaswag's local JSONL; "
        "other tasks come from eval.harness_include or lm-eval's own list, with their data in the local "
        "datasets cache. Results are logged as harness/<task>/<metric> at the checkpoint's step.",
    )
    harness_include: str | None = Field(
        None, description="A folder of lm-eval task YAML files (e.g. with `dataset_path: json` on local files)."
    )
    harness_limit: int | None = Field(None, gt=0, description="Examples per lm-eval task (default: all).")
    gates: EvalGates = Field(default_factory=lambda: EvalGates())
    alias: str = Field(
        "candidate",
        pattern=r"^[A-Za-z][A-Za-z0-9_-]*$",
        description="Registry alias the final model version gets when every configured gate passes.",
    )
    approval: bool = Field(
        False,
        description="Once the gates pass, pause the flow run until a person approves the alias in Prefect's UI "
        "(or `resume_flow_run` with input `{approve: true}`); refused or timed out: no alias.",
    )
    approval_timeout_s: int = Field(
        86400, gt=0, description="Seconds a promotion waits for approval; then the version stays without the alias."
    )
