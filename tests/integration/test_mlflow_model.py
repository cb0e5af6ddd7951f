"""The registered model against a real `mlflow server` (artifacts in S3) with a local-path store: the flow
finishes and registers a version, the version's pyfunc generates text, the run shows its dataset and logged
models, and the MLflow UI in a real headless Chromium shows them too."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tempfile

import pytest
from conftest import tiny_overrides
from mlflow.tracking import MlflowClient

from lmyard.recipes import load_recipe

pytestmark = pytest.mark.slow
NAME = "served-smoke"


@pytest.fixture(scope="module")
def served_run(prefect_api_url, mlflow_server, tmp_path_factory):
    """One tiny smoke run: store on a local path, tracking on the MLflow server, the gate passes."""
    from flows.pretrain import pretrain

    tmp = tmp_path_factory.mktemp("served")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LMYARD_CACHE", str(tmp / "cache"))
        cfg = load_recipe(
            "smoke",
            tiny_overrides(
                tmp,
                steps=6,
                **{
                    "tracking.uri": mlflow_server.uri,
                    "tracking.experiment": "served",
                    "tracking.registered_model": NAME,
                    "tracking.system_metrics": False,
                    "eval.gates.val_loss_max": 100,
                    "eval.threads": 1,
                },
            ),
        )
        summary = pretrain(config=cfg)
    return cfg, summary, MlflowClient(mlflow_server.uri)


def test_local_store_with_mlflow_server_finishes_and_registers_a_version(served_run):
    cfg, summary, client = served_run
    assert summary.registered_model == f"{NAME}/1" and summary.alias == "candidate"
    version = client.get_model_version_by_alias(NAME, "candidate")
    assert version.source.startswith("models:/m-") and version.run_id == summary.mlflow_run_id
    checkpoint_uri = f"{cfg.store}/runs/smoke/checkpoints/step_00000006"
    assert version.tags["lmyard.checkpoint"] == summary.checkpoint == checkpoint_uri
    model_id = version.source.removeprefix("models:/")
    model = client.get_logged_model(model_id)
    # registered as mlflow.register_model does it: the logged model's page lists its version
    listed = json.loads(model.tags["mlflow.modelVersions"])  # the version: a number, or a string over REST
    assert [(v["name"], str(v["version"])) for v in listed] == [(NAME, "1")]
    assert model.artifact_location.startswith("mlflow-artifacts:")  # the weights went to the artifact store (S3)
    files = {os.path.basename(a.path) for a in client.list_logged_model_artifacts(model_id, "artifacts/hf_model")}
    assert {"model.safetensors", "config.json", "tokenizer.json"} <= files


def test_registered_model_loads_as_pyfunc_and_generates_text(served_run, mlflow_server, monkeypatch):
    import mlflow.pyfunc

    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server.uri)
    model = mlflow.pyfunc.load_model(f"models:/{NAME}@candidate")
    out = model.predict(["The for statement", "Exceptions are"], params={"max_new_tokens": 12, "seed": 1})
    assert len(out) == 2 and out[0].startswith("The for statement") and out[1].startswith("Exceptions are")
    assert all(len(text) > len(prompt) for text, prompt in zip(out, ["The for statement", "Exceptions are"]))
    again = model.predict(["The for statement"], params={"max_new_tokens": 12, "seed": 1})
    assert again == out[:1]  # seeded


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_every_familys_export_loads_as_pyfunc_and_generates_text_without_a_warning(tmp_path, arch, capfd):
    """The pyfunc as the registry stores it (models from code, the exported folder as its artifact, the generation
    params in its signature), on each family's export; a prompt longer than the context keeps its end; loading and
    predicting warn about nothing (type hints, the generation config's lengths)."""
    import warnings

    import mlflow.pyfunc
    from conftest import write_random_checkpoint

    from lmyard.export.hf import export
    from lmyard.tracking.model_registry import PYFUNC_FILE as PYFUNC
    from lmyard.tracking.model_registry import with_params

    uri, model = write_random_checkpoint(tmp_path / "store", arch=arch)  # llama: the llama-tiny preset
    export(uri, str(tmp_path / "hf"), cache_dir=str(tmp_path / "cache"))
    mlflow.pyfunc.save_model(
        str(tmp_path / "pyfunc"), python_model=PYFUNC, artifacts={"hf_model": str(tmp_path / "hf")}
    )
    with_params(str(tmp_path / "pyfunc"))
    capfd.readouterr()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        served = mlflow.pyfunc.load_model(str(tmp_path / "pyfunc"))
        long_prompt = "x" * (2 * model.config.block_size)
        out = served.predict(["The for statement", long_prompt], params={"max_new_tokens": 8, "seed": 1})
    assert out[0].startswith("The for statement") and len(out[0]) > len("The for statement")
    assert out[1].startswith(long_prompt)
    assert served.predict(["The for statement"], params={"max_new_tokens": 8, "seed": 1}) == out[:1]  # seeded
    said = capfd.readouterr().err
    assert not [str(w.message) for w in caught if "mlflow" in w.filename or "transformers" in w.filename]
    assert "WARNING" not in said and "max_length" not in said and "type hint" not in said, said


def test_run_has_its_dataset_input_and_logged_models(served_run):
    cfg, summary, client = served_run
    run = client.get_run(summary.mlflow_run_id)
    [dataset_input] = run.inputs.dataset_inputs
    ds = dataset_input.dataset
    assert ds.digest == summary.shard_address[:36] and ds.name == f"shards-{summary.shard_address[:12]}"
    assert f"shards/{summary.shard_address}" in ds.source
    assert {t.key: t.value for t in dataset_input.tags} == {"mlflow.data.context": "training"}

    models = client.search_logged_models([run.info.experiment_id], filter_string=f"source_run_id = '{run.info.run_id}'")
    by_name = {m.name: m for m in models}
    assert set(by_name) == {"smoke-step-00000003", "smoke-step-00000006", NAME}
    # each evaluated checkpoint's model carries its step's metrics; the registered one the final step's
    step3 = {m.key: m.step for m in by_name["smoke-step-00000003"].metrics}
    assert step3["loss/eval"] == 3
    final = {m.key: m.value for m in by_name[NAME].metrics if m.step == 6}
    evaluated = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "loss/eval")}
    assert final["loss/eval"] == evaluated[6] and sorted(evaluated) == [3, 6]  # linked, not logged twice
    assert {o.model_id for o in run.outputs.model_outputs} == {m.model_id for m in models}


def _dom(url: str) -> str:
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    with tempfile.TemporaryDirectory(prefix="lmyard-chromium-") as profile:
        proc = subprocess.run(
            [
                chromium,
                "--headless=new",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-quic",
                "--no-first-run",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                f"--user-data-dir={profile}",
                "--virtual-time-budget=20000",
                "--dump-dom",
                url,
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
    return proc.stdout


@pytest.mark.skipif(
    not (shutil.which("chromium") or shutil.which("chromium-browser")),
    reason="needs Debian's chromium (bash .ci/run installs it)",
)
def test_mlflow_ui_shows_the_runs_dataset_logged_model_registered_version_and_losses_first(served_run, mlflow_server):
    cfg, summary, client = served_run
    run = client.get_run(summary.mlflow_run_id)
    exp, model_id = run.info.experiment_id, client.get_model_version(NAME, "1").source.removeprefix("models:/")
    view = "workflowType=machine_learning"  # MLflow 3's model-training view
    page = _dom(f"{mlflow_server.uri}/#/experiments/{exp}/runs/{run.info.run_id}?{view}")
    text = re.sub(r"<[^>]+>", " ", page)
    assert f"shards-{summary.shard_address[:12]}" in text, text[-3000:]  # Datasets
    assert f'href="#/experiments/{exp}/models/{model_id}"' in page  # the logged model, beside its metrics
    assert f'href="#/models/{NAME}/versions/1"' in page and re.search(rf"{NAME}\s*v1", text)  # Registered models
    models = re.sub(r"<[^>]+>", " ", _dom(f"{mlflow_server.uri}/#/experiments/{exp}/models?{view}"))
    assert all(name in models for name in ("smoke-step-00000003", "smoke-step-00000006", NAME)), models[-3000:]
    # the final model's own page lists its registered version (not "Not registered")
    page = _dom(f"{mlflow_server.uri}/#/experiments/{exp}/models/{model_id}?{view}")
    text = re.sub(r"<[^>]+>", " ", page)
    assert "Not registered" not in text and re.search(rf"{NAME}\s*v1", text), text[-3000:]
    # the Model metrics tab leads with the losses; the plumbing is on the System metrics tab, beside MLflow's own
    tabs = {}
    for tab in ("model-metrics", "system-metrics"):
        page = _dom(f"{mlflow_server.uri}/#/experiments/{exp}/runs/{run.info.run_id}/{tab}?{view}")
        tabs[tab] = re.findall(r"(\S+) \((\d+)\) Add chart", re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", page)))
    assert tabs["model-metrics"][0] == ("loss", "3"), tabs  # loss/train, loss/val, loss/eval
    assert not {name for name, _ in tabs["model-metrics"]} & {"checkpoint", "startup", "eval", "guard"}, tabs
    assert ("system/checkpoint", "4") in tabs["system-metrics"], tabs
