"""The CacheFlowCluster custom resource as frozen dataclasses: one definition gives the CRD's schema
(`crd.py` walks these fields), the defaults, and the operator's parsing of a resource's spec.

Field names are snake_case here and camelCase in the resource (`chunk_size` <-> `chunkSize`). Each
field's metadata carries its documentation and its OpenAPI constraints (minimum, enum, pattern).
"""

from __future__ import annotations

import dataclasses
import re
import typing
from dataclasses import dataclass, field
from typing import Any, TypeVar

from cacheflow_common.errors import ConfigError
from cacheflow_common.layer_split import balanced_split, parse_split
from cacheflow_common.typed_values import typed_value

GROUP = "cacheflow.io"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "CacheFlowCluster"
PLURAL = "cacheflowclusters"
SINGULAR = "cacheflowcluster"
SHORT_NAMES = ("cfc",)

DEFAULT_IMAGE = "ghcr.io/cacheflow/cacheflow"  # the root Dockerfile's image; the chart's default too
DEFAULT_TAG = "0.1.0"  # the package version (pyproject) = the chart's appVersion
MAX_NAME = 40  # longest resource name: "<name>-storage-<i>" and its revision labels must stay within 63
QUANTITY = r"^[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)?$"  # a Kubernetes quantity
NAME = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")  # DNS-1035 label: Service names are derived from it


def doc(text: str, **constraints: Any) -> dict[str, Any]:
    """Field metadata: its description and OpenAPI constraints (minimum, maximum, enum, pattern, ...)."""
    return {"doc": text, "openapi": constraints}


def resources_doc(what: str) -> dict[str, Any]:
    return doc(f"CPU/memory requests and limits of {what} (a Kubernetes ResourceRequirements: requests, limits)",
               kind="resources")


@dataclass(frozen=True, kw_only=True)
class ImageSpec:
    repository: str = field(default=DEFAULT_IMAGE, metadata=doc("image repository (built from the root Dockerfile)"))
    tag: str = field(default=DEFAULT_TAG, metadata=doc("image tag"))
    pull_policy: str = field(default="IfNotPresent", metadata=doc("imagePullPolicy",
                                                                  enum=["Always", "IfNotPresent", "Never"]))
    pull_secrets: tuple[str, ...] = field(default=(), metadata=doc("names of imagePullSecrets"))

    @property
    def ref(self) -> str:
        return f"{self.repository}:{self.tag}"


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    source: str = field(default="smollm2", metadata=doc(
        "tiny | smollm2 | qwen3-8b | a model directory (config.json + safetensors), e.g. under /models "
        "when volumeClaim is set", minLength=1))
    dtype: str = field(default="auto", metadata=doc("compute dtype (auto: bfloat16 where fast)",
                                                    enum=["auto", "bfloat16", "float16", "float32"]))
    layers: int = field(default=30, metadata=doc("the model's decoder layers (SmolLM2-135M: 30, tiny: 8, "
                                                 "Qwen3-8B: 36): the stages split them", minimum=1))
    volume_claim: str = field(default="", metadata=doc("a PersistentVolumeClaim with model directories, "
                                                       "mounted read-only at /models on the stage workers"))


@dataclass(frozen=True, kw_only=True)
class StagesSpec:
    count: int = field(default=2, metadata=doc("pipeline stages (one worker pod each)", minimum=1, maximum=64))
    layer_split: str = field(default="", metadata=doc(
        "explicit layer ranges per stage, e.g. '0:14,14:30' (empty: balanced by count)",
        pattern=r"^$|^[0-9]+:[0-9]+(,[0-9]+:[0-9]+)*$"))
    chunk_size: int = field(default=256, metadata=doc("restore chunk size in tokens", minimum=1))
    policy: str = field(default="cacheflow", metadata=doc(
        "default restore policy (the CacheFlow ones use profileConfigMap, else fall back to cake)",
        enum=["cacheflow", "cacheflow-token", "cacheflow-layer", "cake", "compute-only", "load-only"]))
    profile_config_map: str = field(default="", metadata=doc(
        "a ConfigMap whose key profile.json is the output of `cacheflow profile` on this hardware"))
    pool_tokens: int = field(default=1 << 17, metadata=doc("KV pool capacity per worker, in tokens", minimum=16))
    tenant_pool_share: float = field(default=0.5, metadata=doc(
        "the most of a worker's KV pool one tenant may hold at once (0.5: room for a second tenant; 1: no cap)",
        minimum=0.01, maximum=1))
    threads: int = field(default=0, metadata=doc("torch threads per worker (0: from the CPU limit or request)",
                                                 minimum=0))
    gpus: int = field(default=0, metadata=doc("GPUs per worker (nvidia.com/gpu)", minimum=0))
    resources: dict[str, Any] = field(default_factory=dict, metadata=resources_doc("each stage worker"))
    node_selector: dict[str, str] = field(default_factory=dict, metadata=doc("nodeSelector of the worker pods"))
    tolerations: tuple[dict[str, Any], ...] = field(default=(), metadata=doc("tolerations of the worker pods",
                                                                             kind="tolerations"))


@dataclass(frozen=True, kw_only=True)
class StorageSpec:
    pods: int = field(default=2, metadata=doc("storage pods (a StatefulSet)", minimum=1))
    backend: str = field(default="filesystem", metadata=doc("chunk store of each pod",
                                                            enum=["filesystem", "memory", "redis"]))
    volume_size: str = field(default="50Gi", metadata=doc("filesystem backend: each pod's volume claim",
                                                          pattern=QUANTITY))
    storage_class: str = field(default="", metadata=doc("storageClassName of the claims (empty: the default)"))
    capacity: str = field(default="", metadata=doc(
        "evict least recently used chunks above this size, e.g. 45GiB (empty: 90% of volumeSize with the "
        "filesystem backend, unlimited with memory)", pattern=r"^$|^[0-9]+(\.[0-9]+)?([KMGT]i?B)?$"))
    link_rate_gbps: float = field(default=0.0, metadata=doc("shape each pod's outgoing link to this rate "
                                                            "(0: unshaped)", minimum=0))
    link_capacity_gbps: float = field(default=0.0, metadata=doc(
        "each pod's link capacity, for the dashboard's I/O utilisation (0: the shaping rate, linkRateGbps; "
        "unshaped: the speed the pod's network interface reports, else 10)",
        minimum=0))
    transport: str = field(default="auto", metadata=doc("data plane (auto: TCP, what the workers read "
                                                            "over; nixl: NIXL as well, for readers that bring it)",
                                                        enum=["auto", "tcp", "nixl"]))
    redis_url: str = field(default="", metadata=doc("redis backend: redis://host:port/db"))
    chunk_replicas: int = field(default=1, metadata=doc("copies of each chunk over the pods", minimum=1))
    delete_volumes: bool = field(default=False, metadata=doc(
        "delete the pods' volume claims with the cluster (default: keep the stored chunks)"))
    resources: dict[str, Any] = field(default_factory=dict, metadata=resources_doc("each storage pod"))


@dataclass(frozen=True, kw_only=True)
class BatchingSpec:
    max_batch: int = field(default=8, metadata=doc("most requests restoring at once", minimum=1))
    max_queue: int = field(default=64, metadata=doc("requests waiting beyond the batch; more get 429", minimum=0))
    window_ms: float = field(default=20.0, metadata=doc("a batch forms within this window", minimum=0))


@dataclass(frozen=True, kw_only=True)
class CoordinatorSpec:
    replicas: int = field(default=1, metadata=doc("coordinator pods", minimum=1))
    batching: BatchingSpec = field(default_factory=BatchingSpec, metadata=doc("admission and batching"))
    service_type: str = field(default="ClusterIP", metadata=doc("type of the API Service",
                                                                enum=["ClusterIP", "NodePort", "LoadBalancer"]))
    resources: dict[str, Any] = field(default_factory=dict, metadata=resources_doc("each coordinator pod"))


@dataclass(frozen=True, kw_only=True)
class AuthSpec:
    secret_name: str = field(default="cacheflow-auth", metadata=doc(
        "Secret with keys api-tokens (clients) and pod-tokens (storage pods): lines of 'tenant token'",
        minLength=1))


@dataclass(frozen=True, kw_only=True)
class TLSSpec:
    enabled: bool = field(default=True, metadata=doc(
        "TLS on the internal hops (coordinator -> workers, worker -> worker, workers -> storage pods' data plane), "
        "with a CA and certificate the operator keeps in the Secret <name>-tls and renews before they expire"))
    renew_days: int = field(default=30, metadata=doc("renew the certificate this many days before it expires",
                                                     minimum=1, maximum=80))


PROMETHEUS_NAMESPACE = {"kubernetes.io/metadata.name": "monitoring"}  # kube-prometheus-stack's usual namespace
PROMETHEUS_POD = {"app.kubernetes.io/name": "prometheus"}  # the label the Prometheus Operator gives its pods


@dataclass(frozen=True, kw_only=True)
class NetworkPolicySpec:
    enabled: bool = field(default=True, metadata=doc(
        "create NetworkPolicies that deny the cluster's pods every path but their own (turn off where the "
        "cluster has no NetworkPolicy controller)"))
    metrics_namespace_labels: dict[str, str] = field(default_factory=lambda: dict(PROMETHEUS_NAMESPACE), metadata=doc(
        "labels of the namespace Prometheus scrapes from ({}: any namespace)"))
    metrics_pod_labels: dict[str, str] = field(default_factory=lambda: dict(PROMETHEUS_POD), metadata=doc(
        "labels of the Prometheus pods that scrape /metrics ({}: any pod of those namespaces)"))
    data_plane_client_labels: dict[str, str] = field(default_factory=dict, metadata=doc(
        "labels of further pods in the cluster's namespace that may reach the storage pods' data plane, e.g. "
        "vLLM with the CacheFlow connector ({}: none, only the stage workers and the coordinator)"))


@dataclass(frozen=True, kw_only=True)
class CacheFlowClusterSpec:
    image: ImageSpec = field(default_factory=ImageSpec, metadata=doc("the cacheflow image every pod runs"))
    model: ModelSpec = field(default_factory=ModelSpec, metadata=doc("the model the stages serve"))
    stages: StagesSpec = field(default_factory=StagesSpec, metadata=doc("pipeline stage workers"))
    storage: StorageSpec = field(default_factory=StorageSpec, metadata=doc("storage pods"))
    coordinator: CoordinatorSpec = field(default_factory=CoordinatorSpec, metadata=doc("the API and batching"))
    auth: AuthSpec = field(default_factory=AuthSpec, metadata=doc("bearer tokens"))
    tls: TLSSpec = field(default_factory=TLSSpec, metadata=doc("encryption of the internal hops"))
    network_policy: NetworkPolicySpec = field(default_factory=NetworkPolicySpec, metadata=doc(
        "who may reach which of the cluster's pods"))

    def split(self) -> list[range]:
        """The layer range of every stage: the explicit split, or balanced by layer count."""
        if self.stages.layer_split:
            ranges = parse_split(self.stages.layer_split, self.model.layers)
            if len(ranges) != self.stages.count:
                raise ConfigError(f"layerSplit {self.stages.layer_split!r} has {len(ranges)} stages, "
                                  f"stages.count is {self.stages.count}")
            return ranges
        return balanced_split(self.model.layers, self.stages.count)

    def check(self) -> None:
        """Semantic checks the schema cannot express; ConfigError with the reason."""
        self.split()
        if self.storage.backend == "redis" and not self.storage.redis_url:
            raise ConfigError("storage.backend redis needs storage.redisUrl")
        if self.storage.backend == "redis" and self.storage.capacity:
            raise ConfigError("a redis backend's capacity is set in Redis (maxmemory), not storage.capacity")
        if self.storage.chunk_replicas > self.storage.pods:
            raise ConfigError(f"storage.chunkReplicas {self.storage.chunk_replicas} > storage.pods "
                              f"{self.storage.pods}")


@dataclass(frozen=True, kw_only=True)
class Cluster:
    """A CacheFlowCluster resource: what the manifests need of its metadata, and its parsed spec."""

    name: str
    namespace: str
    uid: str
    spec: CacheFlowClusterSpec

    @classmethod
    def from_resource(cls, body: dict[str, Any]) -> Cluster:
        meta = body.get("metadata", {})
        name = meta.get("name", "")
        if not NAME.fullmatch(name) or len(name) > MAX_NAME:
            raise ConfigError(f"name {name!r}: at most {MAX_NAME} lowercase letters, digits and '-', "
                              "starting with a letter")
        spec = parse(CacheFlowClusterSpec, body.get("spec") or {}, "spec")
        spec.check()
        return cls(name=name, namespace=meta.get("namespace") or "default", uid=meta.get("uid", ""), spec=spec)


# ------------------------------------------------------------------------------------ generic parsing
T = TypeVar("T")


def camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(part.title() for part in rest)


def field_types(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def parse(cls: type[T], data: Any, path: str) -> T:
    """A dataclass from its camelCase mapping; defaults for what is absent; ConfigError names the bad key."""
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must be a mapping")
    fields = {camel(f.name): f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    if unknown := sorted(set(data) - set(fields)):
        raise ConfigError(f"{path}: unknown keys {unknown}; known: {sorted(fields)}")
    hints = field_types(cls)
    values = {f.name: _value(hints[f.name], data[key], f"{path}.{key}") for key, f in fields.items() if key in data}
    return cls(**values)


def _value(hint: Any, value: Any, path: str) -> Any:
    if dataclasses.is_dataclass(hint):
        return parse(hint, value, path)  # type: ignore[arg-type]
    return typed_value(hint, value, path)
