"""lm-evaluation-harness (`lm-eval`, the `harness` extra) on a checkpoint's Hugging Face export, offline.

`eval.harness_tasks` names lm-eval tasks. `hellaswag_local` is lm-eval's
HellaSwag task (multiple choice, acc and acc_norm) over the local JSONL of
`eval.hellaswag` (lmyard's format: ctx, endings, label); other tasks come
from `eval.harness_include` (task YAML files, e.g. `dataset_path: json` on
local files) or lm-eval's own list with their data already in the local
datasets cache: the hub is never asked (HF_HUB_OFFLINE, HF_DATASETS_OFFLINE).

Both score a choice by the log-likelihood of " " + ending given the context.
lm-eval's acc_norm divides it by the choice's length in characters, lmyard's by
its tokens: `hellaswag_local` puts the space inside the choice (an empty target
delimiter), so the two count the same text and agree exactly where one token is
one character (the `bytes` tokenizer on ASCII text); with a BPE tokenizer acc
agrees and acc_norm is per character in lm-eval, per token in lmyard. An
example longer than the context differs too: lm-eval keeps one token more of
its context (block_size + 1 tokens, the last one only predicted).
"""

from __future__ import annotations

import json
import os
import tempfile

from lmyard.errors import UserError

LOCAL_HELLASWAG = "hellaswag_local"


def _hellaswag_yaml(data_file: str) -> str:
    """lm-eval's hellaswag task config over a local JSONL of {ctx, endings, label}."""
    return json.dumps(
        {  # JSON is YAML
            "task": LOCAL_HELLASWAG,
            "dataset_path": "json",
            "dataset_kwargs": {"data_files": {"validation": os.path.abspath(data_file)}},
            "output_type": "multiple_choice",
            "validation_split": "validation",
            "test_split": None,
            "doc_to_text": "{{ctx}}",
            "doc_to_target": "{{label}}",
            "doc_to_choice": "{{ endings | map('regex_replace', '^', ' ') | list }}",
            "target_delimiter": "",
            "metric_list": [
                {"metric": "acc", "aggregation": "mean", "higher_is_better": True},
                {"metric": "acc_norm", "aggregation": "mean", "higher_is_better": True},
            ],
            "metadata": {"version": 1.0},
        },
        indent=1,
    )


def _include_dir(tasks: list[str], hellaswag: str | None, include: str | None, tmp: str) -> list[str]:
    paths = [include] if include else []
    if LOCAL_HELLASWAG in tasks:
        if not hellaswag:
            raise UserError(
                f"eval.harness_tasks has {LOCAL_HELLASWAG}, which scores eval.hellaswag: set it to a "
                "JSONL file (ctx, endings, label)"
            )
        from lmyard.evaluate.evals import read_hellaswag

        data = os.path.join(tmp, "hellaswag_local.jsonl")  # normalized: integer labels, from a path or s3:// URI
        with open(data, "w") as f:
            for ex in read_hellaswag(hellaswag):
                f.write(json.dumps(ex) + "\n")
        with open(os.path.join(tmp, f"{LOCAL_HELLASWAG}.yaml"), "w") as f:
            f.write(_hellaswag_yaml(data))
        paths.append(tmp)
    return paths


def flatten(results: dict) -> dict[str, float]:
    """lm-eval's results {task: {"acc,none": x, "acc_stderr,none": s, ...}} as {"task/acc": x, ...}."""
    out = {}
    for task, metrics in results.get("results", {}).items():
        for key, value in metrics.items():
            name, _, filt = key.partition(",")
            if isinstance(value, (int, float)) and not isinstance(value, bool) and "stderr" not in name:
                out[f"{task}/{name}" + (f"_{filt}" if filt and filt != "none" else "")] = float(value)
    return out


def run(
    folder: str,
    tasks: list[str],
    *,
    hellaswag: str | None = None,
    include: str | None = None,
    limit: int | None = None,
    device: str = "cpu",
    batch_size: int = 4,
) -> dict:
    """lm-eval's tasks on the Hugging Face folder; {"metrics": flat metrics, "results": lm-eval's per-task results}."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    try:
        import lm_eval
        from lm_eval.models.huggingface import HFLM
        from lm_eval.tasks import TaskManager
    except ImportError:
        raise UserError("eval.harness_tasks needs lm-evaluation-harness: pip install 'lmyard[harness]'") from None
    with tempfile.TemporaryDirectory(prefix="lmyard-harness-") as tmp:
        manager = TaskManager(include_path=_include_dir(tasks, hellaswag, include, tmp) or None)
        unknown = [t for t in tasks if t not in manager.all_tasks]
        if unknown:
            raise UserError(
                f"eval.harness_tasks: lm-eval knows no task {', '.join(unknown)}; add its YAML "
                "under eval.harness_include"
            )
        model = HFLM(pretrained=folder, device=device, batch_size=batch_size, dtype="float32", add_bos_token=False)
        results = lm_eval.simple_evaluate(
            model=model, tasks=tasks, task_manager=manager, limit=limit, log_samples=False, bootstrap_iters=0
        )
    return {"metrics": flatten(results), "results": json.loads(json.dumps(results.get("results", {}), default=str))}


def evaluate(ckpt, cfg, device: str = "cpu") -> dict:
    """eval.harness_tasks on a checkpoint: exported to a temporary Hugging Face folder, then lm-eval."""
    from lmyard.export.hf import write_folder

    with tempfile.TemporaryDirectory(prefix="lmyard-harness-model-") as folder:
        write_folder(ckpt, folder)
        return run(
            folder,
            cfg.eval.harness_tasks,
            hellaswag=cfg.eval.hellaswag,
            include=cfg.eval.harness_include,
            limit=cfg.eval.harness_limit,
            device=device,
        )
