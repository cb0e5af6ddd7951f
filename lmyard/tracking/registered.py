"""A registered model version back to the Hugging Face export it was logged from (`model.init_from:
models:/NAME/VERSION`, `models:/NAME@ALIAS`, `models:/NAME/latest`).

lmyard registers each final model as a logged pyfunc model whose artifact `hf_model` is the export
(lmyard.tracking.model_registry). Resolving goes through the tracking server's registry: the version (by number,
alias or the newest), its logged model, then the model's files from the artifact store (S3, or the server's
proxied artifacts); the export's folder is the one the pyfunc's MLmodel names.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from collections.abc import Callable

from lmyard.config import redact_uri
from lmyard.errors import UserError
from lmyard.tracking.client import mlflow_client

_URI = re.compile(r"^models:/(?P<name>[^/@]+)(?:/(?P<version>\d+|latest)|@(?P<alias>[\w-]+))$")


def is_registered(uri: str | None) -> bool:
    return bool(uri) and str(uri).startswith("models:/")


def model_version(client, uri: str, tracking_uri: str, what: str = "model.init_from"):
    """The model version `uri` names; a UserError naming it (`what`: where it was given) and where it was looked
    for."""
    from mlflow.exceptions import MlflowException

    m = _URI.match(uri)
    if m is None:
        raise UserError(
            f"{what} {uri!r} is not a registered model URI: give models:/NAME/VERSION, models:/NAME@ALIAS "
            "or models:/NAME/latest"
        )
    name, version, alias = m["name"], m["version"], m["alias"]
    missing = f"{what} {uri}: no such registered model version at {redact_uri(tracking_uri)}"
    try:
        if alias:
            return client.get_model_version_by_alias(name, alias)
        if version != "latest":
            return client.get_model_version(name, version)
        versions = client.search_model_versions(f"name = '{name}'")
    except MlflowException as e:
        if e.error_code in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE", "NOT_FOUND"):
            raise UserError(f"{missing} (check the name, version or alias in the MLflow UI)") from None
        raise
    if not versions:
        raise UserError(f"{missing} (the model has no versions)")
    return max(versions, key=lambda v: int(v.version))


def check(uri: str, tracking_uri: str) -> None:
    """A UserError now, before any training, when `uri` names no registered version."""
    model_version(mlflow_client(tracking_uri), uri, tracking_uri)


def export_folder(uri: str, tracking_uri: str, cache_dir: str) -> str:
    """The local folder of the Hugging Face export that registered version `uri` was logged from (downloaded
    under `cache_dir`)."""
    import mlflow.artifacts
    import yaml

    client = mlflow_client(tracking_uri)
    version = model_version(client, uri, tracking_uri)
    model_id = version.model_id or str(version.source).removeprefix("models:/")
    location = client.get_logged_model(model_id).artifact_location
    dest = os.path.join(cache_dir, re.sub(r"[^A-Za-z0-9._-]", "_", f"{version.name}-{version.version}-{model_id}"))
    local = _downloaded(
        dest,
        lambda tmp: mlflow.artifacts.download_artifacts(artifact_uri=location, dst_path=tmp, tracking_uri=tracking_uri),
    )
    with open(os.path.join(local, "MLmodel")) as f:
        flavor = yaml.safe_load(f).get("flavors", {}).get("python_function", {})
    hf = (flavor.get("artifacts") or {}).get("hf_model", {}).get("path")
    if not hf:
        raise UserError(f"model.init_from {uri}: that version is not a model lmyard registered (no hf_model artifact)")
    return os.path.join(local, hf)


COMPLETE = ".complete"  # in a downloaded folder: written last, before the folder is renamed into place


def _downloaded(dest: str, download: Callable[[str], str]) -> str:
    """The folder `download(tmp)` returns, under `dest`: downloaded once into a folder of its own, then renamed to
    `dest` whole, so the ranks of a node that resolve one version at once never read each other's partial files
    (the first rename wins; the others use its copy). `dest` from before this, without its marker, is replaced."""
    marker = os.path.join(dest, COMPLETE)
    if not os.path.exists(marker):
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(dest)}.", dir=os.path.dirname(dest))
        try:
            with open(os.path.join(tmp, COMPLETE), "w") as f:
                f.write(os.path.relpath(download(tmp), tmp))
            if os.path.isdir(dest) and not os.path.exists(marker):
                shutil.rmtree(dest, ignore_errors=True)  # an older or interrupted download
            try:
                os.rename(tmp, dest)
            except OSError:
                if not os.path.exists(marker):  # not another rank's complete copy: say what failed
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    with open(marker) as f:
        return os.path.normpath(os.path.join(dest, f.read()))
