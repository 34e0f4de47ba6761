"""deploy/kubernetes (issue 36, goal 4): the Tandem Deployment/Service and the Gateway API Inference Extension's
InferencePool and InferenceObjective, checked without a cluster (none runs here).

What this checks, and what it does not:
- The extension's resources against JSON Schemas written for this test from the released API reference (the Go
  types of InferencePool `inference.networking.k8s.io/v1` and InferenceObjective
  `inference.networking.x-k8s.io/v1alpha2` with their kubebuilder validation markers: required fields, patterns,
  enums, bounds, the CEL rule "port is required when kind is Service"). They are NOT the published CRD files: those
  are not vendored (see docs/scale-out.md), so a field the CRDs add beyond these markers is not covered.
- The wiring a cluster would only reveal at run time: the pool selects the Deployment's pods, targets the port
  whose readiness probe is `/health` and which serves `/metrics`, the objectives name the pool, the HTTPRoute sends
  to it; the container's arguments parse with the real `tandem serve` parser; and the metrics the endpoint picker
  reads from a vLLM-like pod are among those that configuration exports.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest

yaml = pytest.importorskip("yaml")
jsonschema = pytest.importorskip("jsonschema")

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from inference_svc.cli import build_serve_config  # noqa: E402
from inference_svc.metrics import ServiceMetrics  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy" / "kubernetes"

ENDPOINT_PICKER_METRICS = (
    "vllm:num_requests_waiting",  # TotalQueuedRequests
    "vllm:num_requests_running",  # TotalRunningRequests
    "vllm:kv_cache_usage_perc",  # KVCacheUtilization
    "vllm:lora_requests_info",  # LoRA affinity (labels max_lora, running_/waiting_lora_adapters)
    "vllm:cache_config_info",  # block size and number of blocks, as labels
)
"""What the endpoint picker reads from a pod without an engine-type label (the extension's model-server protocol,
docs/proposals/003-model-server-protocol)."""

# ---- schemas derived from the API reference (field names, requiredness and kubebuilder markers)
GROUP = {
    "type": "string",
    "maxLength": 253,
    "pattern": r"^$|^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$",
}
KIND = {"type": "string", "minLength": 1, "maxLength": 63, "pattern": r"^[a-zA-Z]([-a-zA-Z0-9]*[a-zA-Z0-9])?$"}
OBJECT_NAME = {"type": "string", "minLength": 1, "maxLength": 253}
PORT = {
    "type": "object", "additionalProperties": False, "required": ["number"],
    "properties": {"number": {"type": "integer", "minimum": 1, "maximum": 65535}},
}  # fmt: skip
LABEL_KEY = (
    r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"  # an optional DNS-subdomain prefix /
    r"([A-Za-z0-9][-A-Za-z0-9_.]{0,61})?[A-Za-z0-9]$"
)
LABEL_VALUE = {"type": "string", "maxLength": 63, "pattern": r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$"}
METADATA = {
    "type": "object", "required": ["name"],
    "properties": {"name": {"type": "string", "pattern": r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", "maxLength": 63}},
}  # fmt: skip

INFERENCE_POOL_V1 = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "inference.networking.k8s.io/v1"},
        "kind": {"const": "InferencePool"},
        "metadata": METADATA,
        "spec": {
            "type": "object", "additionalProperties": False,
            "required": ["selector", "targetPorts", "endpointPickerRef"],
            "properties": {
                "selector": {
                    "type": "object", "additionalProperties": False, "required": ["matchLabels"],
                    "properties": {"matchLabels": {
                        "type": "object", "minProperties": 1, "maxProperties": 64,
                        "propertyNames": {"pattern": LABEL_KEY, "maxLength": 253}, "additionalProperties": LABEL_VALUE,
                    }},
                },
                "targetPorts": {"type": "array", "minItems": 1, "maxItems": 1, "items": PORT},
                "endpointPickerRef": {
                    "type": "object", "additionalProperties": False, "required": ["name"],
                    "properties": {
                        "group": GROUP, "kind": KIND, "name": OBJECT_NAME, "port": PORT,
                        "failureMode": {"enum": ["FailOpen", "FailClose"]},
                    },
                },
            },
        },
    },
}  # fmt: skip
INFERENCE_OBJECTIVE_V1ALPHA2 = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "inference.networking.x-k8s.io/v1alpha2"},
        "kind": {"const": "InferenceObjective"},
        "metadata": METADATA,
        "spec": {
            "type": "object", "additionalProperties": False, "required": ["poolRef"],
            "properties": {
                "priority": {"type": "integer"},
                "poolRef": {
                    "type": "object", "additionalProperties": False, "required": ["name"],
                    "properties": {"group": GROUP, "kind": KIND, "name": OBJECT_NAME},
                },
            },
        },
    },
}  # fmt: skip


def _docs() -> list[dict[str, Any]]:
    docs = []
    for path in sorted(DEPLOY.glob("*.yaml")):
        docs += [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    return docs


def _one(kind: str, docs: list[dict] | None = None) -> dict:
    found = [d for d in docs or _docs() if d["kind"] == kind]
    assert len(found) == 1, f"{len(found)} {kind}"
    return found[0]


def validate_pool(doc: dict) -> None:
    """The schema, then the CEL rule of EndpointPickerRef: kind defaults to Service, which needs a port."""
    jsonschema.validate(doc, INFERENCE_POOL_V1)
    ref = doc["spec"]["endpointPickerRef"]
    if ref.get("kind", "Service") == "Service" and "port" not in ref:
        raise jsonschema.ValidationError("endpointPickerRef: port is required when kind is 'Service'")


def _container(deployment: dict) -> dict:
    [container] = deployment["spec"]["template"]["spec"]["containers"]
    return container


def _port_number(container: dict, port: int | str) -> int:
    if isinstance(port, int):
        return port
    [number] = [p["containerPort"] for p in container["ports"] if p["name"] == port]
    return number


def test_the_extensions_resources_match_the_released_api() -> None:
    docs = _docs()
    validate_pool(_one("InferencePool", docs))
    objectives = [d for d in docs if d["kind"] == "InferenceObjective"]
    assert objectives
    for doc in objectives:
        jsonschema.validate(doc, INFERENCE_OBJECTIVE_V1ALPHA2)


def test_the_schemas_refuse_what_the_api_refuses() -> None:
    """The derived schemas are not vacuous: each broken copy of the real pool or objective is refused."""
    pool = _one("InferencePool")
    objective = next(d for d in _docs() if d["kind"] == "InferenceObjective")
    broken_pools = []
    for path, value in (
        (("apiVersion",), "inference.networking.x-k8s.io/v1alpha2"),  # the pre-GA group
        (("spec", "targetPorts"), []),
        (("spec", "targetPorts"), [{"number": 8000}, {"number": 8001}]),  # one port only in v1
        (("spec", "targetPorts", 0, "number"), 70000),
        (("spec", "selector", "matchLabels"), {}),
        (("spec", "selector", "matchLabels"), {"bad key!": "x"}),
        (("spec", "endpointPickerRef", "failureMode"), "Retry"),
        (("spec", "endpointPickerRef", "kind"), "bad/kind"),
        (("spec", "endpointPickerRef", "port"), None),  # a Service needs a port (the CEL rule)
        (("spec", "extensionRef"), {"name": "x"}),  # the v1alpha2 field name
    ):
        broken_pools.append(_set(pool, path, value))
    for doc in broken_pools:
        with pytest.raises(jsonschema.ValidationError):
            validate_pool(doc)
    for path, value in (
        (("spec", "poolRef"), None),
        (("spec", "priority"), "high"),
        (("spec", "criticality"), "Critical"),
    ):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(_set(objective, path, value), INFERENCE_OBJECTIVE_V1ALPHA2)


def _set(doc: dict, path: tuple, value: Any) -> dict:
    out = copy.deepcopy(doc)
    node = out
    for key in path[:-1]:
        node = node[key]
    if value is None:
        del node[path[-1]]
    else:
        node[path[-1]] = value
    return out


def test_the_pool_selects_the_tandem_pods_on_their_ready_http_port() -> None:
    docs = _docs()
    pool, deployment, service = _one("InferencePool", docs), _one("Deployment", docs), _one("Service", docs)
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert pool["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert service["spec"]["selector"].items() <= labels.items()
    container = _container(deployment)
    target = pool["spec"]["targetPorts"][0]["number"]
    probe = container["readinessProbe"]["httpGet"]
    assert probe["path"] == "/health" and _port_number(container, probe["port"]) == target
    args = container["args"]
    assert args[0] == "serve"
    settings = _parse(args)
    assert settings.http_port == target
    # the endpoint picker scrapes /metrics on the target port: the HTTP API serves it only when metrics listen on
    # the same interface (inference_svc/openai_api/app.py)
    assert settings.metrics_port is not None and settings.metrics_host == settings.host
    assert deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > settings.shutdown_grace
    for objective in (d for d in docs if d["kind"] == "InferenceObjective"):
        assert objective["spec"]["poolRef"]["name"] == pool["metadata"]["name"]
        assert objective["spec"]["poolRef"].get("kind", "InferencePool") == "InferencePool"
    route = _one("HTTPRoute", docs)
    backends = [b for rule in route["spec"]["rules"] for b in rule["backendRefs"]]
    assert {
        "group": "inference.networking.k8s.io",
        "kind": "InferencePool",
        "name": pool["metadata"]["name"],
    } in backends


def _parse(args: list[str]) -> Any:
    """The container's arguments through the real `tandem serve` parser (the model folder must exist: a stand-in)."""
    import tempfile

    argv = list(args[1:])
    with tempfile.TemporaryDirectory() as stand_in:
        argv[argv.index("--model") + 1] = stand_in
        settings, _, _ = build_serve_config(argv)
    return settings


def test_the_pods_export_what_the_endpoint_picker_reads() -> None:
    settings = _parse(_container(_one("Deployment"))["args"])
    m = ServiceMetrics(model_name="tandem", names=settings.scale_out.metrics_names)
    exported = {f.name for f in text_string_to_metric_families(m.render().decode())}
    missing = [name for name in ENDPOINT_PICKER_METRICS if name not in exported]
    assert not missing, (
        f"the endpoint picker reads {missing}, which --metrics-names {settings.scale_out.metrics_names} leaves out"
    )
    config = settings.scale_out.kv_events
    assert config.enabled and config.topic == "kv-events"
    ports = {p["containerPort"] for p in _container(_one("Deployment"))["ports"]}
    for endpoint in (config.endpoint, config.replay_endpoint):
        assert endpoint is not None and int(endpoint.rsplit(":", 1)[1]) in ports
