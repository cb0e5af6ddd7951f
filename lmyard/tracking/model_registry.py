"""The model registry: the final model logged as an MLflow pyfunc and registered the way MLflow does it.

Design notes: docs/tracking.md, `lmyard/tracking/model_registry.py`.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

from lmyard.tracking.lineage import Lineage

# the pyfunc's code file, by path: importing lmyard.export here would load torch into the flow's process
PYFUNC_FILE = str(Path(__file__).resolve().parents[1] / "export" / "pyfunc.py")


def log_hf_model(
    lineage: Lineage, name: str, folder: str, step: int, params: dict[str, str], tags: dict[str, str]
) -> str:
    """Log an exported Hugging Face folder as an MLflow pyfunc model whose artifacts go to the artifact
    store; an output of the run at `step`, linked to the run's metrics there. The logged model's id."""
    import tempfile

    import mlflow.pyfunc
    from mlflow.entities import LoggedModelOutput
    from mlflow.models import Model

    client = lineage.client
    model = client.create_logged_model(
        lineage.ref.experiment_id,
        name=name,
        source_run_id=lineage.ref.mlflow_run_id,
        params=params,
        tags=tags,
        model_type="transformers-text-generation",
    )
    with tempfile.TemporaryDirectory(prefix="lmyard-model-") as tmp:
        path = os.path.join(tmp, "model")
        mlflow.pyfunc.save_model(
            path,
            python_model=PYFUNC_FILE,
            artifacts={"hf_model": folder},
            pip_requirements=_pyfunc_requirements(),
            mlflow_model=Model(
                artifact_path=model.artifact_location, run_id=lineage.ref.mlflow_run_id, model_id=model.model_id
            ),
        )
        with_params(path)
        client.log_model_artifacts(model.model_id, path)
    client.finalize_logged_model(model.model_id, "READY")
    client.log_outputs(lineage.ref.mlflow_run_id, [LoggedModelOutput(model.model_id, step)])
    lineage.link_metrics(model.model_id, step)
    return model.model_id


def with_params(path: str) -> None:
    """The saved pyfunc's signature with the generation params: MLflow infers its inputs and outputs from
    `predict`'s type hints (list[str] -> list[str]) but no params from them, and a signature given to save_model
    that differs from the inferred one is replaced, with a warning."""
    from mlflow.models import Model

    saved = Model.load(path)
    saved.signature = _signature()
    saved.save(os.path.join(path, "MLmodel"))


def _signature():
    """Prompts in, texts out; generation settings as params."""
    from mlflow.models import ModelSignature
    from mlflow.types import ColSpec, ParamSchema, ParamSpec, Schema

    return ModelSignature(
        inputs=Schema([ColSpec("string")]),
        outputs=Schema([ColSpec("string")]),
        params=ParamSchema(
            [
                ParamSpec("max_new_tokens", "long", 64),
                ParamSpec("temperature", "double", 0.8),
                ParamSpec("top_k", "long", 40),
                ParamSpec("seed", "long", 0),
                ParamSpec("do_sample", "boolean", True),
            ]
        ),
    )


def _pyfunc_requirements() -> list[str]:
    """What loading the pyfunc needs (pinned to what is installed here, where known); never inferred by
    loading the model, which would cost a full load at logging time."""
    from importlib.metadata import PackageNotFoundError, version

    out = []
    for dist in ("mlflow", "torch", "transformers", "tokenizers", "safetensors"):
        try:
            out.append(f"{dist}=={version(dist)}")
        except PackageNotFoundError:
            out.append(dist)
    return out


def register_model(
    lineage: Lineage, name: str, model_id: str, step: int, description: str, tags: dict[str, str], checkpoint_uri: str
) -> str:
    """Register logged model `model_id` as a new version of `name` and list that version on the logged model
    (see the module docstring); its version number."""
    from mlflow.exceptions import MlflowException

    client = lineage.client
    try:
        client.create_registered_model(name, description="Language models pretrained with lmyard")
    except MlflowException as e:
        if e.error_code != "RESOURCE_ALREADY_EXISTS":
            raise
    with _global_tracking_uri(lineage.ref.tracking_uri):
        version = client.create_model_version(
            name,
            source=f"models:/{model_id}",
            run_id=lineage.ref.mlflow_run_id,
            description=description,
            tags={"lmyard.step": str(step), "lmyard.checkpoint": checkpoint_uri, **tags},
            model_id=model_id,
        )
    list_version_on_model(lineage, model_id, name, str(version.version))
    lineage.set_tags(
        {"lmyard.registered_model": f"{name}/{version.version}", "lmyard.final_checkpoint": checkpoint_uri}
    )
    return str(version.version)


@contextlib.contextmanager
def _global_tracking_uri(uri: str) -> Iterator[None]:
    """The process's global MLflow tracking URI set to `uri` for a call, then as it was (unset included).

    MLflow's SQL registry store (a sqlite:// URI, no server) looks the logged model of a `models:/<model id>`
    source up through the global tracking URI rather than the client's."""
    import mlflow

    previous = mlflow.get_tracking_uri() if mlflow.is_tracking_uri_set() else None
    mlflow.set_tracking_uri(uri)
    try:
        yield
    finally:
        mlflow.set_tracking_uri(previous)  # type: ignore[arg-type]  # None unsets it, as before the call


def list_version_on_model(lineage: Lineage, model_id: str, name: str, version: str) -> None:
    """Add {name, version} to the logged model's `mlflow.modelVersions` tag, as mlflow.register_model does, unless
    it is there already: a tracking server adds it itself when it creates the version, a sqlite store does not
    (and mlflow.register_model, adding it again, would list the version twice on a server)."""
    import json

    from mlflow.utils.mlflow_tags import MLFLOW_MODEL_VERSIONS

    listed = json.loads(lineage.client.get_logged_model(model_id).tags.get(MLFLOW_MODEL_VERSIONS) or "[]")
    if any(v.get("name") == name and str(v.get("version")) == version for v in listed):
        return
    entry = {"name": name, "version": int(version)}  # a number, as the server writes it
    lineage.client.set_logged_model_tags(model_id, {MLFLOW_MODEL_VERSIONS: json.dumps([*listed, entry])})


def set_alias(lineage: Lineage, name: str, alias: str, version: str) -> None:
    """Point `models:/<name>@<alias>` at `version`."""
    lineage.client.set_registered_model_alias(name, alias, version)


def tag_version(lineage: Lineage, name: str, version: str, tags: dict[str, str]) -> None:
    """Tags on a model version (e.g. who approved its promotion and when): the registry's page of the version."""
    for key, value in tags.items():
        lineage.client.set_model_version_tag(name, version, key, value)
