"""Kubernetes on paper: the train stage as standard objects and a Prefect work pool's base job template, as dicts.

    training_objects(cfg, shards)  # `lmyard render k8s`: a headless Service, an indexed batch/v1 Job (one pod a
                                   # node, torchrun in each) and, with a shard set, the ConfigMap of its spec
    pool_template(cfg)             # `lmyard render k8s-pool`: a Kubernetes work pool's base job template, GPU nodes

No credentials are written: the pods take them from the Secret launch.kubernetes.secret names. lmyard applies
nothing to a cluster; the tests validate what this renders against the Kubernetes API's schema, offline.

Design notes: docs/kubernetes.md, `lmyard/launch/kubernetes.py`.
"""

from __future__ import annotations

import hashlib
import re
from typing import Any

from lmyard import backends
from lmyard.config import RunConfig
from lmyard.data.shardset import ShardSet
from lmyard.errors import UserError
from lmyard.launch.images import image_tag
from lmyard.launch.job import stage_env, torchrun_command
from lmyard.stages import TrainSpec
from lmyard.tracking.credentials import credentials_to_env, split_credentials

GPU = "nvidia.com/gpu"  # the NVIDIA device plugin's resource
INDEX = "batch.kubernetes.io/job-completion-index"  # an indexed Job's pod annotation: JOB_COMPLETION_INDEX's value
SPEC_DIR = "/etc/lmyard/spec"  # the ConfigMap of the train stage's spec, in every pod
NAME_MAX = 50  # pod i's hostname is <job>-<i>: a DNS label (63), room left for the index
CONFIGMAP_MAX = 1 << 20  # the API server refuses a larger ConfigMap
POOL_POD_WATCH_S = 900  # the pool's wait for a flow run's pod: a CUDA image's first pull on a node takes minutes


def job_name(cfg: RunConfig) -> str:
    """`train-<run_name>` as a DNS label (lower case, `-` for what is not a letter or digit), at most NAME_MAX
    characters (a longer one cut, and ended by a hash of the whole run name)."""
    name = re.sub(r"[^a-z0-9-]+", "-", f"train-{cfg.run_name}".lower()).strip("-")
    if len(name) > NAME_MAX:
        name = f"{name[: NAME_MAX - 7].rstrip('-')}-{hashlib.sha256(cfg.run_name.encode()).hexdigest()[:6]}"
    return name


def stage_image(cfg: RunConfig) -> str:
    """launch.kubernetes.image, else the stage image of this checkout under launch.kubernetes.registry."""
    kc = cfg.launch.kubernetes
    if kc.image:
        return kc.image
    if not kc.registry:
        raise UserError(
            "a Kubernetes node pulls the stage image from a registry: set launch.kubernetes.registry (where "
            "`python -m lmyard.launch.images build --push REGISTRY` put it) or launch.kubernetes.image"
        )
    return f"{kc.registry}/{image_tag()}"


def reachable_from_pods(cfg: RunConfig) -> str:
    """The tracking URI without credentials; a store or tracking URI that is a file of this machine, which no pod
    sees, is one line naming the key to change."""
    if not cfg.store.startswith("s3://"):
        raise UserError(
            f"store {cfg.store} is a folder of this machine, which no pod sees: set store to s3://bucket/prefix "
            "(and launch.kubernetes.s3_endpoint unless it is AWS's)"
        )
    uri = split_credentials(cfg.tracking.uri)[0]
    if not uri.startswith(("http://", "https://", "databricks")):
        raise UserError(
            f"tracking.uri {uri} is a file of this machine, which no pod sees: set tracking.uri to the MLflow "
            "server's http(s):// URL"
        )
    return uri


def _metadata(cfg: RunConfig, name: str, labels: dict[str, str]) -> dict[str, Any]:
    ns = cfg.launch.kubernetes.namespace
    return {"name": name, **({"namespace": ns} if ns else {}), "labels": labels}


def _labels(name: str) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": "lmyard",
        "app.kubernetes.io/component": "train",
        "app.kubernetes.io/instance": name,
    }


def _environment(cfg: RunConfig, tracking_uri: str) -> dict[str, str]:
    """What every pod's environment holds besides the Secret's keys: never a credential."""
    kc = cfg.launch.kubernetes
    return {
        "MLFLOW_TRACKING_URI": tracking_uri,
        **({"AWS_ENDPOINT_URL": kc.s3_endpoint} if kc.s3_endpoint else {}),
        **kc.env,
    }


def _pod(cfg: RunConfig, container: dict[str, Any], volumes: list[dict[str, Any]]) -> dict[str, Any]:
    """A pod's spec around its one container: on GPU nodes (a toleration of their taint) when it asks for GPUs,
    /dev/shm in memory, and a grace after SIGTERM that leaves the trainer time to checkpoint."""
    kc = cfg.launch.kubernetes
    gpus = GPU in container.get("resources", {}).get("limits", {})
    container["volumeMounts"] = [*container.get("volumeMounts", []), {"name": "dshm", "mountPath": "/dev/shm"}]
    return {
        "restartPolicy": "Never",
        "terminationGracePeriodSeconds": int(cfg.launch.grace_s) + 60,
        **({"serviceAccountName": kc.service_account} if kc.service_account else {}),
        **({"nodeSelector": dict(kc.node_selector)} if kc.node_selector else {}),
        **({"tolerations": [{"key": GPU, "operator": "Exists", "effect": "NoSchedule"}]} if gpus else {}),
        "containers": [container],
        "volumes": [*volumes, {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": kc.shm_size}}],
    }


def training_job(cfg: RunConfig) -> dict[str, Any]:
    """The train stage as an indexed Job: launch.nnodes pods at once, pod i torchrun's node i (its completion
    index), the static rendezvous at pod 0 through the headless Service; any pod's failure fails the Job."""
    kc, n = cfg.launch.kubernetes, cfg.launch.nnodes
    if cfg.launch.min_nnodes is not None and cfg.launch.min_nnodes < n:
        raise UserError(
            f"launch.min_nnodes={cfg.launch.min_nnodes} is below launch.nnodes={n}: an indexed Job runs exactly "
            "launch.nnodes pods and does not go on without one; unset launch.min_nnodes"
        )
    name, tracking_uri, image = job_name(cfg), reachable_from_pods(cfg), stage_image(cfg)
    command = torchrun_command(
        cfg,
        python="python",  # the stage image's
        rdzv_endpoint=f"{name}-0.{name}:{kc.rdzv_port}",  # pod 0's hostname in the Service's subdomain
        rdzv_id=name,
        node_rank="$(NODE_RANK)",  # filled in by the kubelet from the pod's environment
        spec_path=f"{SPEC_DIR}/spec.json",
    )
    rank = {"name": "NODE_RANK", "valueFrom": {"fieldRef": {"fieldPath": f"metadata.annotations['{INDEX}']"}}}
    container: dict[str, Any] = {
        "name": "train",
        "image": image,
        "command": command,
        "env": [
            rank,
            *({"name": k, "value": v} for k, v in (stage_env(cfg) | _environment(cfg, tracking_uri)).items()),
        ],
        **({"envFrom": [{"secretRef": {"name": kc.secret}}]} if kc.secret else {}),
        "ports": [{"name": "rdzv", "containerPort": kc.rdzv_port}],
        "resources": {"limits": {GPU: str(cfg.launch.nproc_per_node)}} if cfg.train.device == "cuda" else {},
        "volumeMounts": [{"name": "spec", "mountPath": SPEC_DIR, "readOnly": True}],
    }
    pod = _pod(cfg, container, [{"name": "spec", "configMap": {"name": f"{name}-spec"}}])
    pod["subdomain"] = name  # pod i is <job>-<i>.<service>
    spec = {"completionMode": "Indexed", "completions": n, "parallelism": n, "backoffLimit": 0}
    template = {"metadata": {"labels": _labels(name)}, "spec": pod}
    return {"apiVersion": "batch/v1", "kind": "Job", "metadata": _metadata(cfg, name, _labels(name)),
            "spec": {**spec, "template": template}}  # fmt: skip


def headless_service(cfg: RunConfig) -> dict[str, Any]:
    """The Job's pods by name (`<job>-<i>.<job>`), in DNS before they are ready: where the nodes meet pod 0."""
    name = job_name(cfg)
    spec = {
        "clusterIP": "None",
        "publishNotReadyAddresses": True,
        "selector": _labels(name),
        "ports": [{"name": "rdzv", "port": cfg.launch.kubernetes.rdzv_port}],
    }
    return {"apiVersion": "v1", "kind": "Service", "metadata": _metadata(cfg, name, _labels(name)), "spec": spec}


def spec_config_map(cfg: RunConfig, shards: ShardSet) -> dict[str, Any]:
    """The ConfigMap the Job's pods read their spec from: the run config (without the tracking password) and the
    shard set; no lineage, so the trainer logs to no MLflow run (the flow opens one)."""
    config = credentials_to_env(cfg, environ={})  # the password goes nowhere
    text = TrainSpec(config=config, shards=shards).model_dump_json()
    if len(text) > CONFIGMAP_MAX:
        raise UserError(
            f"the train stage's spec is {len(text):,} bytes (its shard set's manifest lists "
            f"{len(shards.manifest.get('shards', []))} shards), over a ConfigMap's {CONFIGMAP_MAX:,}: raise "
            "data.shard_tokens for fewer, larger shards"
        )
    name = f"{job_name(cfg)}-spec"
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": _metadata(cfg, name, _labels(job_name(cfg))),
            "data": {"spec.json": text}}  # fmt: skip


def shard_set(cfg: RunConfig, address: str) -> ShardSet:
    """The shard set at `address` (what `lmyard shard` prints) in the config's store, for the spec's ConfigMap."""
    from lmyard.data.shards import load_manifest
    from lmyard.run import Run

    shards = load_manifest(Run.of(cfg).store, address)
    if shards is None:
        raise UserError(
            f"no shard set {address} in the store {cfg.store}: `lmyard shard RECIPE` makes it and prints its address"
        )
    return shards


def training_objects(cfg: RunConfig, shards: ShardSet | None = None) -> list[dict[str, Any]]:
    """What `kubectl apply` needs for the train stage: the Service, the Job and, given the shard set, its spec."""
    job = training_job(cfg)  # its checks first
    return [headless_service(cfg), *([spec_config_map(cfg, shards)] if shards else []), job]


# ---------------------------------------------------------------- a Prefect work pool for GPU nodes


def pool_template(cfg: RunConfig) -> dict[str, Any]:
    """A Kubernetes work pool's base job template (`prefect work-pool create --type kubernetes --base-job-template
    FILE`): each flow run one pod on a GPU node, running the flow and its stages (launch.backend local, one node);
    its variables' defaults come from the config. Its containers are the Kubernetes worker's: `prefect-job`, whose
    `args` and `env` the worker fills in."""
    launch, kc = cfg.launch, cfg.launch.kubernetes
    if not backends.of(cfg).on_flow_host or launch.nnodes != 1:
        raise UserError(
            f"a flow run of the Kubernetes pool is one pod that runs its stages itself, not {launch.nnodes} node(s) "
            f"on launch.backend={launch.backend}: set launch.backend=local and launch.nnodes=1 (more nodes: the "
            "indexed Job of `lmyard render k8s`)"
        )
    env = {**_environment(cfg, reachable_from_pods(cfg)), "LMYARD_STORE": cfg.store}
    env["PREFECT_FLOWS_HEARTBEAT_FREQUENCY"] = "30"  # deploy/automations.yaml marks a silent flow run crashed
    container: dict[str, Any] = {
        "name": "prefect-job",
        "image": "{{ image }}",
        "imagePullPolicy": "{{ image_pull_policy }}",
        "args": "{{ command }}",
        "env": "{{ env }}",
        **({"envFrom": [{"secretRef": {"name": "{{ secret }}"}}]} if kc.secret else {}),
        "resources": {"limits": {GPU: "{{ gpus }}"}} if cfg.train.device == "cuda" else {},
    }
    pod = _pod(cfg, container, [])
    pod |= {"serviceAccountName": "{{ service_account_name }}", "nodeSelector": "{{ node_selector }}"}
    metadata = {"generateName": "{{ name }}-", "namespace": "{{ namespace }}", "labels": "{{ labels }}"}
    spec = {"backoffLimit": 0, "ttlSecondsAfterFinished": "{{ finished_job_ttl }}", "template": {"spec": pod}}
    placeholders = ("command", "env", "labels", "name", "namespace")
    timeouts = ("job_watch_timeout_seconds", "pod_watch_timeout_seconds", "stream_output")
    configuration = {
        **{k: f"{{{{ {k} }}}}" for k in placeholders},
        "job_manifest": {"apiVersion": "batch/v1", "kind": "Job", "metadata": metadata, "spec": spec},
        **{k: f"{{{{ {k} }}}}" for k in timeouts},
    }
    return {"job_configuration": configuration, "variables": _pool_variables(cfg, stage_image(cfg), env)}


def _pool_variables(cfg: RunConfig, image: str, env: dict[str, str]) -> dict[str, Any]:
    """The pool's variables (a JSON schema, as the Prefect UI shows them) with the config's values as defaults."""
    kc, strings = cfg.launch.kubernetes, {"type": "object", "additionalProperties": {"type": "string"}}

    def var(kind: str | dict, description: str, default: Any = None) -> dict[str, Any]:
        return {**({"type": kind} if isinstance(kind, str) else kind), "description": description,
                **({"default": default} if default is not None else {})}  # fmt: skip

    props = {
        "name": var("string", "Name given to the Job the worker creates (its generateName)."),
        "command": var("string", "The flow run's command; blank: the worker's `prefect flow-run execute`."),
        "env": var(strings, "The pod's environment (no credentials: they come from the Secret).", env),
        "labels": var(strings, "Labels of the Job the worker creates."),
        "namespace": var("string", "Namespace of the flow runs' Jobs.", kc.namespace or "default"),
        "image": var("string", "The flow run's image: it runs the flow, so it needs Prefect, lmyard and torch.", image),
        "image_pull_policy": {
            **var("string", "The image's pull policy.", "IfNotPresent"),
            "enum": ["IfNotPresent", "Always", "Never"],
        },  # fmt: skip
        "service_account_name": var("string", "The pod's service account.", kc.service_account),
        "node_selector": var(strings, "Node labels the pod must match (nodeSelector).", dict(kc.node_selector)),
        "finished_job_ttl": var("integer", "Seconds a finished Job is kept; unset: until deleted."),
        "job_watch_timeout_seconds": var("integer", "Seconds to wait for each event of the Job; unset: forever."),
        "pod_watch_timeout_seconds": var("integer", "Seconds to wait for the pod to start.", POOL_POD_WATCH_S),
        "stream_output": var("boolean", "Stream the pod's output to the worker's.", True),
    }
    if cfg.train.device == "cuda":
        props["gpus"] = var(
            "string", "GPUs of the pod (nvidia.com/gpu): one rank each.", str(cfg.launch.nproc_per_node)
        )
    if kc.secret:
        props["secret"] = var("string", "The Secret whose keys become the pod's environment (envFrom).", kc.secret)
    return {"type": "object", "properties": props}
