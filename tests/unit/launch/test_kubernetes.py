"""Kubernetes on paper (docs/kubernetes.md): what `lmyard render k8s` and `lmyard render k8s-pool` write is checked
offline, with no cluster: each object is walked against the Kubernetes API's schema as the `kubernetes` client's
models declare it (every key known, every scalar of its type, every required field there), the Job's pods are
checked to meet at pod 0 through the Service, the work pool's template is filled in as Prefect's Kubernetes
worker fills it, and a config that cannot work on a cluster is one line naming what to change."""

from __future__ import annotations

import json
import re
import shlex
from typing import Any

import kubernetes.client as k8s
import pytest
import yaml

from flows.cli import main
from lmyard.data.shardset import ShardSet
from lmyard.launch import kubernetes
from lmyard.recipes import load_recipe
from lmyard.stages import TrainSpec

SITE = [
    "store=s3://lmyard/store",
    "tracking.uri=http://mlflow.lmyard.svc:5000",
    "launch.kubernetes.registry=registry.example.com:5000",
]
GPUS = [*SITE, "train.device=cuda", "launch.nproc_per_node=8"]
MODELS = {"Job": "V1Job", "Service": "V1Service", "ConfigMap": "V1ConfigMap"}
DNS_LABEL = re.compile(r"^[a-z]([-a-z0-9]{0,61}[a-z0-9])?$")

# ---------------------------------------------------------------- the API's schema, from the client's models


def _strict() -> k8s.Configuration:
    conf = k8s.Configuration()
    conf.client_side_validation = True  # a model refuses a missing required field (and a bad enum value)
    return conf


def api_object(value: Any, kind: str, where: str = "") -> Any:
    """`value` (parsed JSON or YAML) as the client's model `kind` (`V1Job`, `list[V1EnvVar]`, `dict[str, str]`,
    a scalar type), built bottom up: an unknown key, a value of the wrong type or a missing required field is an
    AssertionError naming where it is."""
    where = where or kind
    inner = re.fullmatch(r"list\[(.+)\]", kind)
    if inner:
        assert isinstance(value, list), f"{where}: a list expected, not {value!r}"
        return [api_object(v, inner.group(1), f"{where}[{i}]") for i, v in enumerate(value)]
    inner = re.fullmatch(r"dict[\[(]str, (.+)[\])]", kind)
    if inner:
        assert isinstance(value, dict) and all(isinstance(k, str) for k in value), f"{where}: a map expected"
        return {k: api_object(v, inner.group(1), f"{where}.{k}") for k, v in value.items()}
    scalars = {"str": (str,), "int": (int,), "bool": (bool,), "float": (int, float), "object": (str, int, dict)}
    if kind in scalars or kind in ("datetime", "date"):
        types = scalars.get(kind, (str,))
        ok = isinstance(value, types) and (kind == "bool" or not isinstance(value, bool))
        assert ok, f"{where}: {kind} expected, not {type(value).__name__} {value!r}"
        return value
    model = getattr(k8s, kind)
    assert isinstance(value, dict), f"{where}: a {kind} object expected, not {value!r}"
    attrs = {json_key: attr for attr, json_key in model.attribute_map.items()}
    unknown = sorted(set(value) - set(attrs))
    assert not unknown, f"{where}: {', '.join(unknown)} unknown to {kind}"
    fields = {attrs[k]: api_object(v, model.openapi_types[attrs[k]], f"{where}.{k}") for k, v in value.items()}
    try:
        return model(local_vars_configuration=_strict(), **fields)
    except ValueError as e:  # the generated setters' check of required fields
        raise AssertionError(f"{where}: {e}") from None


def valid(obj: dict) -> Any:
    """A rendered object as its kind's model of the API (V1Job, V1Service, V1ConfigMap)."""
    assert obj.get("apiVersion") in ("v1", "batch/v1"), obj.get("apiVersion")
    return api_object(obj, MODELS[obj["kind"]], obj["kind"])


def test_the_schema_check_refuses_unknown_keys_wrong_types_and_missing_fields_at_any_depth():
    pod = {"containers": [{"name": "c", "image": "i", "resources": {"limits": {"nvidia.com/gpu": "1"}}}]}
    job = {"apiVersion": "batch/v1", "kind": "Job", "spec": {"completions": 2, "template": {"spec": pod}}}
    assert isinstance(valid(job), k8s.V1Job)
    bad = [
        # Prefect's own default template once put these in the pod's spec, where the API has no such fields
        ({**pod, "parallelism": 1}, "parallelism unknown to V1PodSpec"),
        ({"containers": [{"image": "i"}]}, "Invalid value for `name`"),
        ({"containers": [{"name": "c", "env": [{"name": "A", "valu": "1"}]}]}, "env[0]: valu unknown"),
        ({"containers": [{"name": "c", "resources": {"limits": {"nvidia.com/gpu": 1}}}]}, "str expected, not int 1"),
        ({"containers": {"name": "c"}}, "containers: a list expected"),
        ({"containers": [{"name": "c", "stdin": "yes"}]}, "bool expected"),
    ]
    for spec, says in bad:
        with pytest.raises(AssertionError, match=re.escape(says)):
            valid({**job, "spec": {"template": {"spec": spec}}})
    with pytest.raises(AssertionError, match=re.escape("completions: int expected, not str '2'")):
        valid({**job, "spec": {**job["spec"], "completions": "2"}})
    with pytest.raises(AssertionError, match=re.escape("selector.matchExpressions[0]: Invalid value for `key`")):
        valid({**job, "spec": {**job["spec"], "selector": {"matchExpressions": [{"operator": "In"}]}}})


# ---------------------------------------------------------------- the training Job


def _render(*overrides: str, shards: ShardSet | None = None) -> tuple[Any, list[dict]]:
    cfg = load_recipe("smoke", list(overrides))
    return cfg, kubernetes.training_objects(cfg, shards)


def _shards() -> ShardSet:
    manifest = {"shards": [{"split": "train", "tokens": 1000}], "tokenizer": {"n_vocab": 256}}
    return ShardSet(address="f00d", uri="s3://lmyard/store/shards/f00d", manifest=manifest)


def test_a_rendered_training_job_is_a_valid_kubernetes_job_and_service_whose_pods_meet_at_pod_0():
    cfg, objects = _render(*GPUS, "launch.nnodes=4", "launch.kubernetes.node_selector={gpu: h100}")
    service, job = objects
    assert isinstance(valid(service), k8s.V1Service) and isinstance(valid(job), k8s.V1Job)
    name, spec, pod = job["metadata"]["name"], job["spec"], job["spec"]["template"]["spec"]
    assert DNS_LABEL.match(f"{name}-3") and service["metadata"]["name"] == pod["subdomain"] == name
    assert spec["completionMode"] == "Indexed" and spec["completions"] == spec["parallelism"] == 4
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"] is True
    assert service["spec"]["selector"].items() <= job["spec"]["template"]["metadata"]["labels"].items()
    (train,) = pod["containers"]
    cmd = train["command"]
    assert cmd[cmd.index("--rdzv_endpoint") + 1] == f"{name}-0.{name}:29400"
    assert cmd[cmd.index("--rdzv_backend") + 1] == "static" and cmd[cmd.index("--node_rank") + 1] == "$(NODE_RANK)"
    assert cmd[-4:] == ["lmyard.stages", "train", "--spec", "/etc/lmyard/spec/spec.json"]
    env = {e["name"]: e for e in train["env"]}
    index = "metadata.annotations['batch.kubernetes.io/job-completion-index']"
    assert env["NODE_RANK"]["valueFrom"]["fieldRef"]["fieldPath"] == index
    assert env["MLFLOW_TRACKING_URI"]["value"] == "http://mlflow.lmyard.svc:5000"
    assert train["resources"]["limits"] == {"nvidia.com/gpu": "8"} and pod["nodeSelector"] == {"gpu": "h100"}
    assert train["envFrom"] == [{"secretRef": {"name": "lmyard-credentials"}}]
    assert train["image"].startswith("registry.example.com:5000/lmyard-stage:")
    assert {v["configMap"]["name"] for v in pod["volumes"] if "configMap" in v} == {f"{name}-spec"}


def test_a_cpu_job_asks_for_no_gpu_and_one_node_runs_torchrun_standalone():
    _, (service, job) = _render(*SITE, "launch.nnodes=1", "train.device=cpu")
    valid(service), valid(job)
    pod = job["spec"]["template"]["spec"]
    assert pod["containers"][0]["resources"] == {} and "tolerations" not in pod
    assert "--standalone" in pod["containers"][0]["command"]


def test_the_spec_configmap_holds_the_train_spec_and_no_credential_reaches_any_object():
    overrides = [*SITE, "tracking.uri=http://alice:s3cret@mlflow:5000", "launch.nnodes=2"]
    cfg, objects = _render(*overrides, shards=_shards())
    assert [o["kind"] for o in objects] == ["Service", "ConfigMap", "Job"]
    for obj in objects:
        valid(obj)
    assert "s3cret" not in yaml.safe_dump_all(objects)
    spec = TrainSpec.model_validate_json(objects[1]["data"]["spec.json"])
    assert spec.shards == _shards() and spec.config.tracking.uri == "http://mlflow:5000"
    assert spec.config.model_dump(exclude={"tracking"}) == cfg.model_dump(exclude={"tracking"})


def test_rendered_yaml_round_trips_on_stdout_and_in_files(tmp_path, capsys):
    overrides = [a for o in [*GPUS, "launch.nnodes=2"] for a in ("--set", o)]
    assert main(["render", "k8s", "smoke", *overrides]) == 0
    printed = list(yaml.safe_load_all(capsys.readouterr().out))
    assert printed == kubernetes.training_objects(load_recipe("smoke", [*GPUS, "launch.nnodes=2"]))
    assert main(["render", "k8s", "smoke", *overrides, "--out", str(tmp_path)]) == 0
    written = {p.name: yaml.safe_load(p.read_text()) for p in tmp_path.iterdir()}
    assert written == {"service.yaml": printed[0], "job.yaml": printed[1]}
    for obj in written.values():
        valid(obj)


@pytest.mark.parametrize(
    "overrides, says",
    [
        (["store=s3://b/p", "tracking.uri=http://m:5000"], "set launch.kubernetes.registry"),
        ([*SITE, "launch.nnodes=2", "launch.min_nnodes=1"], "unset launch.min_nnodes"),
        ([*SITE[1:]], "store .lmyard/store is a folder of this machine, which no pod sees"),
        ([*SITE[::2], "tracking.uri=sqlite:///mlflow.db"], "set tracking.uri to the MLflow server's http(s):// URL"),
        ([*SITE, "launch.kubernetes.secret=Creds"], "launch.kubernetes.secret"),
    ],
)
def test_a_config_a_cluster_cannot_run_is_one_line_naming_what_to_fix(overrides, says, capsys):
    assert main(["render", "k8s", "smoke", *[a for o in overrides for a in ("--set", o)]]) == 2
    out = capsys.readouterr()
    assert out.out == "" and len(out.err.strip().splitlines()) == 1 and says in out.err, out.err


def test_a_shard_set_the_store_lacks_is_one_line_and_one_it_has_becomes_the_spec_configmap(
    monkeypatch, tmp_path, capsys
):
    import lmyard.data.shards

    found: dict[str, ShardSet] = {}
    monkeypatch.setattr(lmyard.data.shards, "load_manifest", lambda store, address: found.get(address))
    args = ["render", "k8s", "smoke", *[a for o in SITE for a in ("--set", o)], "--shards", "f00d"]
    assert main(args) == 2
    assert "no shard set f00d in the store s3://lmyard/store: `lmyard shard RECIPE`" in capsys.readouterr().err
    found["f00d"] = _shards()
    assert main([*args, "--out", str(tmp_path)]) == 0
    config_map = yaml.safe_load((tmp_path / "configmap.yaml").read_text())
    assert TrainSpec.model_validate_json(valid(config_map).data["spec.json"]).shards == _shards()


# ---------------------------------------------------------------- the Prefect work pool


def as_the_worker_fills_it(template: dict, flow_run: dict[str, Any]) -> dict:
    """The Job the Kubernetes worker would submit for a flow run: the variables' defaults under the flow run's
    values (Prefect's templating), then the container's `env` as a list and its `args` split, as
    prefect-kubernetes' KubernetesWorkerJobConfiguration does before it creates the Job."""
    from prefect.utilities.templating import apply_values

    defaults = {k: v["default"] for k, v in template["variables"]["properties"].items() if "default" in v}
    manifest = apply_values(template["job_configuration"], defaults | flow_run)["job_manifest"]
    container = manifest["spec"]["template"]["spec"]["containers"][0]
    container["env"] = [{"name": k, "value": v} for k, v in container["env"].items()]
    container["args"] = shlex.split(container["args"])
    return manifest


def test_the_work_pool_template_passes_prefects_check_and_fills_in_as_a_valid_gpu_job(capsys):
    from prefect.server.schemas.actions import WorkPoolCreate

    overrides = [*GPUS, "launch.backend=local", "launch.kubernetes.node_selector={gpu: h100}"]
    assert main(["render", "k8s-pool", "smoke", *[a for o in overrides for a in ("--set", o)]]) == 0
    template = json.loads(capsys.readouterr().out)
    WorkPoolCreate(name="lmyard-k8s", type="kubernetes", base_job_template=template)  # the server's own check
    flow_run = {"name": "cheerful-ibex", "command": "prefect flow-run execute", "labels": {"prefect.io/flow": "x"}}
    manifest = as_the_worker_fills_it(template, flow_run)
    valid(manifest)
    pod = manifest["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["resources"]["limits"] == {"nvidia.com/gpu": "8"} and pod["nodeSelector"] == {"gpu": "h100"}
    assert container["image"].startswith("registry.example.com:5000/lmyard-stage:")
    assert container["args"] == ["prefect", "flow-run", "execute"]
    env = {e["name"]: e["value"] for e in container["env"]}
    assert env["LMYARD_STORE"] == "s3://lmyard/store" and env["MLFLOW_TRACKING_URI"].startswith("http://mlflow")
    assert container["envFrom"] == [{"secretRef": {"name": "lmyard-credentials"}}]
    assert "serviceAccountName" not in pod and "ttlSecondsAfterFinished" not in manifest["spec"]  # unset: left out


def test_the_work_pool_refuses_a_config_whose_stages_would_not_run_in_its_one_pod(capsys):
    overrides = [*GPUS, "launch.backend=local", "launch.nnodes=2", "launch.rdzv_endpoint=h:1"]
    assert main(["render", "k8s-pool", "smoke", *[a for o in overrides for a in ("--set", o)]]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "set launch.backend=local and launch.nnodes=1" in err
