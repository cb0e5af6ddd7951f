"""lm-evaluation-harness (`lm-eval`, the `harness` extra) on a checkpoint's Hugging Face export, offline.

`eval.harness_tasks` names lm-eval tasks. `hellaswag_local` is lm-eval's
HellaSwag task (multiple choice, acc and acc_norm) over the local JSONL of
`eval.hellaswag` (lmyard's format: ctx, endings, label); other tasks come
from `eval.harness_include` (task YAML files, e.g. `dataset_path: json` on
local files) or lm-eval's own list with their data already in the local
datasets cache: the hub is never asked (HF_HUB_OFFLINE, HF_DATASETS_OFFLINE).

Design notes: docs/export.md, `lmyard/evaluate/harness.py`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

from lmyard.errors import UserError

LOCAL_HELLASWAG = "hellaswag_local"
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}  # defaults: an operator's own settings win
_NEEDS_HELLASWAG = f"eval.harness_tasks has {LOCAL_HELLASWAG}, which scores eval.hellaswag: set it to a JSONL file (ctx, endings, label)"


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
            raise UserError(_NEEDS_HELLASWAG)
        from lmyard.evaluate.hellaswag import read_hellaswag

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


def _task_manager(tasks: list[str], include_paths: list[str]):
    """lm-eval's TaskManager over its own tasks and `include_paths`; UserError naming any task it lacks."""
    try:
        from lm_eval.tasks import TaskManager
    except ImportError:
        raise UserError("eval.harness_tasks needs lm-evaluation-harness: pip install 'lmyard[harness]'") from None
    manager = TaskManager(include_path=include_paths or None)
    unknown = [t for t in tasks if t not in manager.all_tasks]
    if unknown:
        raise UserError(
            f"eval.harness_tasks: lm-eval knows no task {', '.join(unknown)}; add its YAML "
            "under eval.harness_include, or drop it from eval.harness_tasks"
        )
    return manager


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
    for key, value in OFFLINE.items():
        os.environ.setdefault(key, value)
    with tempfile.TemporaryDirectory(prefix="lmyard-harness-") as tmp:
        manager = _task_manager(tasks, _include_dir(tasks, hellaswag, include, tmp))
        import lm_eval
        from lm_eval.models.huggingface import HFLM

        model = HFLM(pretrained=folder, device=device, batch_size=batch_size, dtype="float32", add_bos_token=False)
        results = lm_eval.simple_evaluate(
            model=model, tasks=tasks, task_manager=manager, limit=limit, log_samples=False, bootstrap_iters=0
        )
    return {"metrics": flatten(results), "results": json.loads(json.dumps(results.get("results", {}), default=str))}


def check_tasks(e) -> None:
    """Before a run (lmyard.config.EvalConfig `e`): every eval.harness_tasks task is one lm-eval knows and can load
    here offline, as the evaluator will; else a UserError naming the task and how to supply it. The tasks load in
    a process of its own (see the module docstring); the caller's process imports neither lm-eval nor torch."""
    tasks = list(e.harness_tasks or [])
    if LOCAL_HELLASWAG in tasks and not e.hellaswag:
        raise UserError(_NEEDS_HELLASWAG)
    others = [t for t in tasks if t != LOCAL_HELLASWAG]  # lmyard's own task over eval.hellaswag: it loads
    if not others:
        return
    cmd = [sys.executable, "-m", "lmyard.evaluate.harness", *others]
    cmd += ["--include", e.harness_include] if e.harness_include else []
    done = subprocess.run(cmd, env={**OFFLINE, **os.environ}, capture_output=True, text=True, timeout=600)
    lines = done.stderr.strip().splitlines()
    if done.returncode == 2 and lines and lines[-1].startswith("lmyard: error: "):
        raise UserError(lines[-1].removeprefix("lmyard: error: "))
    if done.returncode:
        raise RuntimeError(f"checking eval.harness_tasks failed (exit {done.returncode}): {lines[-1:] or ''}")


def load_tasks(tasks: list[str], include: str | None) -> None:
    """Load each task (and its data) as lm-eval will; UserError naming the first that cannot load."""
    manager = _task_manager(tasks, [include] if include else [])
    for task in tasks:
        try:
            manager.load([task])
        # lm-eval and datasets fail in many types (ConnectionError offline, FileNotFoundError, ValueError, ...):
        # whichever it is, the task cannot be evaluated here, and its message goes into the one line
        except Exception as exc:
            reason = (str(exc).splitlines() or [type(exc).__name__])[0]
            raise UserError(
                f"eval.harness_tasks: task {task} cannot be loaded offline here ({reason}); put its dataset in the "
                "local datasets cache (HF_DATASETS_CACHE), describe it in a task YAML under eval.harness_include "
                "(dataset_path: json with local data_files), or drop it from eval.harness_tasks"
            ) from None


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


def main(argv: list[str] | None = None) -> int:
    """`python -m lmyard.evaluate.harness TASK... [--include DIR]`: load the tasks offline; exit 0, or 2 with one line."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m lmyard.evaluate.harness", description="check that lm-eval tasks load")
    p.add_argument("tasks", nargs="+")
    p.add_argument("--include", default=None, help="a folder of task YAML files (eval.harness_include)")
    args = p.parse_args(argv)
    try:
        load_tasks(args.tasks, args.include)
    except UserError as e:
        print(f"lmyard: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
