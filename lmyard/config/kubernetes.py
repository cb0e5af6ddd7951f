"""The `launch.kubernetes` section: what `lmyard render k8s` and `lmyard render k8s-pool` write into their manifests
(lmyard.launch.kubernetes; docs/kubernetes.md). No backend reads it: lmyard submits nothing to a cluster."""

from __future__ import annotations

import re

from pydantic import Field, field_validator

from lmyard.config.base import _Section

_NAME = re.compile(r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$")  # a Kubernetes object name (RFC 1123 subdomain)
_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")  # a namespace's (RFC 1123 label)


class KubernetesConfig(_Section):
    """What `lmyard render k8s` (the training Job) and `lmyard render k8s-pool` (a Prefect work pool's base job
    template) put into the manifests; validated offline, never applied by lmyard (docs/kubernetes.md)."""

    namespace: str | None = Field(
        None, description="Namespace of the rendered objects; default kubectl's current one (the pool: `default`)."
    )
    registry: str | None = Field(
        None,
        description="Image registry (host[:port]) the nodes pull the stage image from "
        "(`python -m lmyard.launch.images build --push REGISTRY`): REGISTRY/lmyard-stage:<code version>.",
    )
    image: str | None = Field(None, description="The stage image, instead of the one under `registry`.")
    node_selector: dict[str, str] = Field(
        default_factory=dict,
        description="Node labels the pods must match (nodeSelector), e.g. "
        "`{nvidia.com/gpu.product: NVIDIA-H100-80GB-HBM3}`.",
    )
    secret: str | None = Field(
        "lmyard-credentials",
        description="The Secret whose keys become the pods' environment (envFrom): AWS_ACCESS_KEY_ID, "
        "AWS_SECRET_ACCESS_KEY, MLFLOW_TRACKING_USERNAME/PASSWORD or MLFLOW_TRACKING_TOKEN. Only its name is "
        "rendered; null: none.",
    )
    s3_endpoint: str | None = Field(
        None, description="The S3 endpoint as the pods reach it (AWS_ENDPOINT_URL); default AWS's."
    )
    service_account: str | None = Field(None, description="The pods' service account; default the namespace's.")
    rdzv_port: int = Field(29400, gt=0, lt=65536, description="torchrun's rendezvous port on pod 0.")
    shm_size: str = Field(
        "16Gi", description="Size of /dev/shm, a memory-backed emptyDir (DataLoader workers and NCCL use it)."
    )
    env: dict[str, str] = Field(
        default_factory=dict,
        description="Extra environment (NCCL_SOCKET_IFNAME, NCCL_IB_HCA, ...), written into the manifests: never "
        "secrets, which belong in the Secret.",
    )

    @field_validator("secret", "service_account")
    @classmethod
    def _object_name(cls, v: str | None) -> str | None:
        if v is not None and not _NAME.match(v):
            raise ValueError(f"{v!r} is no Kubernetes name: lower-case letters, digits, '-' and '.'")
        return v

    @field_validator("namespace")
    @classmethod
    def _namespace(cls, v: str | None) -> str | None:
        if v is not None and not _LABEL.match(v):
            raise ValueError(f"{v!r} is no namespace: at most 63 lower-case letters, digits and '-'")
        return v
