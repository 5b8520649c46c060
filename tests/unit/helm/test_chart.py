"""The Helm chart, with Helm's own library (helm-python-sdk): lint, render, and validate every
rendered manifest against Kubernetes schemas (kubernetes-validate) and the KubeRay RayService
CRD; the rendered serveConfigV2 must be a valid sessionserve AppConfig."""

from __future__ import annotations

import json
from pathlib import Path

import helm_python as helm
import jsonschema
import kubernetes_validate
import pytest
import yaml

from sessionserve.config import AppConfig

ROOT = Path(__file__).resolve().parents[3]
CHART = ROOT / "helm" / "sessionserve"
FULL = yaml.safe_load((CHART / "ci" / "full-values.yaml").read_text())
CRD = yaml.safe_load((ROOT / "tests" / "data" / "ray.io_rayservices.yaml").read_text())
K8S_VERSION = "1.32.0"


def strict(schema: dict) -> dict:
    """The CRD schema with unknown fields refused (a cluster would silently prune them: a
    misspelt field would be lost without a trace)."""
    if isinstance(schema, dict):
        schema = {k: strict(v) for k, v in schema.items()}
        if (
            "properties" in schema
            and "additionalProperties" not in schema
            and not schema.get("x-kubernetes-preserve-unknown-fields")
        ):
            schema["additionalProperties"] = False
    elif isinstance(schema, list):
        schema = [strict(v) for v in schema]
    return schema


RAYSERVICE_SCHEMA = strict(
    next(v for v in CRD["spec"]["versions"] if v["name"] == "v1")["schema"]["openAPIV3Schema"]
)


def render(values: dict | None = None) -> list[dict]:
    out = helm.Chart.load(CHART).render(values or {}, name="chat", namespace="llm")
    docs = []
    for path, text in out.items():
        if path.endswith(".yaml"):
            docs += [d for d in yaml.safe_load_all(text) if d]
    return docs


def by_kind(docs: list[dict], kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


@pytest.mark.parametrize("values", [None, FULL], ids=["default", "full"])
def test_lint_is_clean(values) -> None:
    report = helm.lint(CHART, values, strict=True, kube_version=f"v{K8S_VERSION}")
    assert report["errors"] == [] and not [m for m in report["messages"] if m["severity"] >= 2]


@pytest.mark.parametrize("values", [None, FULL], ids=["default", "full"])
def test_rendered_manifests_are_valid(values) -> None:
    docs = render(values)
    for doc in docs:
        if doc["kind"] == "RayService":
            jsonschema.validate(doc, RAYSERVICE_SCHEMA)
        elif doc["apiVersion"].startswith("monitoring.coreos.com/"):
            assert doc["spec"], doc  # CRDs of the Prometheus operator: structure only
        else:
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    (rs,) = by_kind(docs, "RayService")
    serve = yaml.safe_load(rs["spec"]["serveConfigV2"])
    app = serve["applications"][0]
    assert app["import_path"] == "sessionserve.app:build_app"
    AppConfig.model_validate(app["args"])  # the same validation `serve run` applies


def test_the_crd_check_catches_a_misspelt_field() -> None:
    (rs,) = by_kind(render(), "RayService")
    rs["spec"]["rayClusterConfig"]["workerGroupSpec"] = []  # the real field is ...Specs
    with pytest.raises(jsonschema.ValidationError, match="workerGroupSpec"):
        jsonschema.validate(rs, RAYSERVICE_SCHEMA)


def test_one_pod_template_for_head_and_workers() -> None:
    (rs,) = by_kind(render(FULL), "RayService")
    cluster = rs["spec"]["rayClusterConfig"]
    head = cluster["headGroupSpec"]["template"]["spec"]
    worker = cluster["workerGroupSpecs"][0]["template"]["spec"]
    assert (
        head["volumes"] == worker["volumes"] and head["initContainers"] == worker["initContainers"]
    )
    assert head["containers"][0]["image"] == worker["containers"][0]["image"]
    assert worker["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert worker["tolerations"] and "nodeSelector" not in head


def test_model_from_pvc_or_init_container() -> None:
    (default,) = by_kind(render(), "RayService")
    spec = default["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]
    assert spec["volumes"][0]["persistentVolumeClaim"]["claimName"] == "sessionserve-models"
    assert "initContainers" not in spec
    (full,) = by_kind(render(FULL), "RayService")
    spec = full["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]
    assert spec["volumes"][0] == {"name": "models", "emptyDir": {}}
    assert spec["initContainers"][0]["image"] == "alpine:3.20"


def test_autoscaling_reaches_the_serve_config() -> None:
    (default,) = by_kind(render(), "RayService")
    args = yaml.safe_load(default["spec"]["serveConfigV2"])["applications"][0]["args"]
    assert "autoscaling" not in args["replica"] and args["replica"]["num_replicas"] == 2
    (full,) = by_kind(render(FULL), "RayService")
    args = yaml.safe_load(full["spec"]["serveConfigV2"])["applications"][0]["args"]
    assert args["replica"]["autoscaling"]["max_replicas"] == 8
    assert full["spec"]["rayClusterConfig"]["enableInTreeAutoscaling"] is True
    assert args["engine"]["model"]["served_name"] == "llama-3.1-8b"


def test_drafter_value_reaches_the_engine_config() -> None:
    (default,) = by_kind(render(), "RayService")
    args = yaml.safe_load(default["spec"]["serveConfigV2"])["applications"][0]["args"]
    assert args["engine"]["spec"] == {
        "drafter_path": None,
        "num_drafts": 4,
        "history_drafts": False,
        "adaptive": True,
    }
    (full,) = by_kind(render(FULL), "RayService")
    args = yaml.safe_load(full["spec"]["serveConfigV2"])["applications"][0]["args"]
    spec = AppConfig.model_validate(args).engine.spec
    assert spec.drafter_path == "/models/EAGLE-LLaMA3.1-Instruct-8B" and spec.num_drafts == 5
    assert spec.history_drafts and not spec.adaptive


def test_cuda_graphs_value_reaches_the_engine_config() -> None:
    for values, want in ((None, True), (FULL, False)):
        (rs,) = by_kind(render(values) if values else render(), "RayService")
        args = yaml.safe_load(rs["spec"]["serveConfigV2"])["applications"][0]["args"]
        assert AppConfig.model_validate(args).engine.cuda_graphs is want


def test_kv_dtype_value_reaches_the_engine_config() -> None:
    for values, want in (
        (None, "auto"),
        ({"engine": {"cache": {"kvDtype": "bfloat16"}}}, "bfloat16"),
    ):
        (rs,) = by_kind(render(values) if values else render(), "RayService")
        args = yaml.safe_load(rs["spec"]["serveConfigV2"])["applications"][0]["args"]
        assert AppConfig.model_validate(args).engine.cache.kv_dtype == want
    with pytest.raises(helm.HelmValuesError, match="/engine/cache/kvDtype"):
        helm.Chart.load(CHART).validate_schema({"engine": {"cache": {"kvDtype": "fp8"}}})


@pytest.mark.parametrize(
    ("option", "kind"),
    [
        ("podMonitor", "PodMonitor"),
        ("serviceMonitor", "ServiceMonitor"),
        ("prometheusRule", "PrometheusRule"),
        ("dashboards", "ConfigMap"),
    ],
)
def test_monitoring_options(option: str, kind: str) -> None:
    assert by_kind(render(), kind) == []
    (doc,) = by_kind(render({"monitoring": {option: {"enabled": True}}}), kind)
    assert doc["metadata"]["labels"]["app.kubernetes.io/instance"] == "chat"


def test_alerts_and_dashboards_match_the_deployed_files() -> None:
    (rule,) = by_kind(render(FULL), "PrometheusRule")
    deployed = yaml.safe_load((ROOT / "deploy" / "prometheus" / "alerts.yml").read_text())
    assert rule["spec"] == deployed and rule["metadata"]["labels"]["release"] == "prometheus"
    (cm,) = by_kind(render(FULL), "ConfigMap")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    for name, text in cm["data"].items():
        assert json.loads(text) == json.loads((ROOT / "deploy" / "grafana" / name).read_text())
    assert set(cm["data"]) == {p.name for p in (ROOT / "deploy" / "grafana").glob("*.json")}


def test_values_schema_rejects_bad_values() -> None:
    chart = helm.Chart.load(CHART)
    chart.validate_schema(FULL)
    for bad, where in [
        ({"replicas": {"count": "three"}}, "/replicas/count"),
        ({"engine": {"cache": {"pageSize": 3}}}, "/engine/cache/pageSize"),
        ({"modle": {}}, "modle"),
        ({"auth": {"apiKeys": ["sk-one,sk-two"]}}, "/auth/apiKeys/0"),  # commas separate keys
    ]:
        with pytest.raises(helm.HelmValuesError, match=where):
            chart.validate_schema(bad)


def test_notes_say_how_to_reach_the_api() -> None:
    out = helm.Chart.load(CHART).render({}, name="chat", namespace="llm")
    notes = out["sessionserve/templates/NOTES.txt"]
    assert "port-forward svc/chat-sessionserve-serve-svc 8000:8000" in notes
    assert "x-session-id" in notes


def _key_env(rs: dict) -> list[dict | None]:
    """SESSIONSERVE_API_KEYS of the head's and the workers' containers."""
    cluster = rs["spec"]["rayClusterConfig"]
    pods = [cluster["headGroupSpec"]] + cluster["workerGroupSpecs"]
    found = []
    for pod in pods:
        env = pod["template"]["spec"]["containers"][0].get("env") or []
        found.append(next((e for e in env if e["name"] == "SESSIONSERVE_API_KEYS"), None))
    return found


def test_api_keys_are_on_by_default_from_a_chart_made_secret() -> None:
    import base64

    docs = render()
    (secret,) = by_kind(docs, "Secret")
    assert secret["metadata"]["name"] == "chat-sessionserve-api-keys"
    generated = base64.b64decode(secret["data"]["api-keys"]).decode()
    assert generated.startswith("sk-") and len(generated) == 43  # a random key
    (rs,) = by_kind(docs, "RayService")
    for env in _key_env(rs):  # head and workers: the ingress may run on either
        assert env["valueFrom"]["secretKeyRef"] == {
            "name": "chat-sessionserve-api-keys",
            "key": "api-keys",
        }
    given = render({"auth": {"apiKeys": ["sk-team-a-0001", "sk-team-b-0002"]}})
    (secret,) = by_kind(given, "Secret")
    assert base64.b64decode(secret["data"]["api-keys"]).decode() == (
        "sk-team-a-0001,sk-team-b-0002"
    )


def test_an_existing_secret_or_no_auth_at_all() -> None:
    docs = render(FULL)  # auth.existingSecret: team-api-keys, entry "keys"
    assert by_kind(docs, "Secret") == []
    (rs,) = by_kind(docs, "RayService")
    for env in _key_env(rs):
        assert env["valueFrom"]["secretKeyRef"] == {"name": "team-api-keys", "key": "keys"}
    args = yaml.safe_load(rs["spec"]["serveConfigV2"])["applications"][0]["args"]
    ingress = AppConfig.model_validate(args).ingress
    assert (ingress.max_body_bytes, ingress.max_sessions_per_key) == (1048576, 64)
    off = render({"auth": {"enabled": False}})
    assert by_kind(off, "Secret") == [] and _key_env(by_kind(off, "RayService")[0]) == [None, None]
    out = helm.Chart.load(CHART).render({"auth": {"enabled": False}}, name="chat", namespace="llm")
    assert "API keys are OFF" in out["sessionserve/templates/NOTES.txt"]
