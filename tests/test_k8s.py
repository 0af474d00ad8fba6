"""deploy/k8s, checked offline: every overlay renders (`kubectl kustomize`); every object validates,
core objects against Kubernetes' schemas (kubernetes-validate, strict, at a pinned version) and
the InferencePool and HTTPRoute against our own schemas of the fields we use (tests/k8s_schemas.py,
strict on unknown fields); the Deployment's probes, security context and shutdown timing agree with
what `specstream serve` does; what the pods reference exists; the endpoint picker reads series that
/metrics serves; checkov finds nothing unjustified.

Rendering needs kubectl (1.32, with kustomize 5.5); without it the checks of rendered overlays
skip, saying so, and the sources are still validated file by file. Those schemas are not the
upstream CRDs and express one of their CEL rules only: `kubectl apply --dry-run=server` against a
cluster with the CRDs installed is the full check (docs/KUBERNETES.md).
"""

from __future__ import annotations

import copy
import functools
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from unittest import mock

import jsonschema
import kubernetes_validate
import pytest
import yaml
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from k8s_schemas import SCHEMAS
from specstream.config import EngineConfig
from specstream.engine.metrics import CacheConfigInfo, EngineMetrics

ROOT = Path(__file__).resolve().parent.parent
K8S = ROOT / "deploy" / "k8s"
OVERLAYS = ("cpu", "gpu", "inference-extension")
KUBERNETES_VERSION = "1.32"
KUSTOMIZE_KINDS = ("Kustomization", "Component")
SERVER = "specstream"  # the model server's Deployment and container


# ------------------------------------------------------------------------------------ loading
@functools.cache
def render(overlay: str) -> tuple[dict, ...]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed (Debian does not package it): overlays render with kubectl kustomize")
    done = subprocess.run(
        [kubectl, "kustomize", str(K8S / "overlays" / overlay)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return tuple(doc for doc in yaml.safe_load_all(done.stdout) if doc)


def named(objects, kind: str, name: str | None = None) -> list[dict]:
    return [o for o in objects if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]


def one(objects, kind: str, name: str | None = None) -> dict:
    [obj] = named(objects, kind, name)
    return obj


def kustomizations() -> list[Path]:
    return sorted(K8S.rglob("kustomization.yaml"))


def source_objects() -> list[tuple[Path, dict]]:
    """The objects of every file a kustomization lists as a resource (patches are partial and are
    checked once rendered)."""
    found = []
    for path in kustomizations():
        spec = yaml.safe_load(path.read_text())
        for entry in spec.get("resources", []):
            file = path.parent / entry
            if file.is_file():
                found += [(file, doc) for doc in yaml.safe_load_all(file.read_text()) if doc]
    return found


# --------------------------------------------------------------------------------- validation
def validate(obj: dict) -> None:
    key = (obj["apiVersion"], obj["kind"])
    if key in SCHEMAS:
        jsonschema.Draft202012Validator(SCHEMAS[key]).validate(obj)
    else:
        kubernetes_validate.validate(copy.deepcopy(obj), KUBERNETES_VERSION, strict=True)


def test_the_custom_resource_schemas_are_valid_schemas():
    for schema in SCHEMAS.values():
        jsonschema.Draft202012Validator.check_schema(schema)


def test_the_custom_resource_schemas_refuse_unknown_fields_missing_required_ones_and_bad_values():
    pool = {
        "apiVersion": "inference.networking.k8s.io/v1",
        "kind": "InferencePool",
        "metadata": {"name": "p"},
        "spec": {
            "selector": {"matchLabels": {"app": "x"}},
            "targetPorts": [{"number": 8000}],
            "endpointPickerRef": {"name": "epp", "port": {"number": 9002}},
        },
    }
    route = {
        "apiVersion": "gateway.networking.k8s.io/v1",
        "kind": "HTTPRoute",
        "metadata": {"name": "r"},
        "spec": {
            "parentRefs": [{"name": "gw"}],
            "rules": [
                {"backendRefs": [{"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": "p"}]}
            ],
        },
    }
    validate(pool)
    validate(route)
    # A picker that is not a Service may leave the port out.
    validate({**pool, "spec": {**pool["spec"], "endpointPickerRef": {"kind": "Picker", "name": "epp"}}})

    def broken(obj: dict, path: str, value=None, delete: bool = False) -> dict:
        out = copy.deepcopy(obj)
        *parents, last = path.split(".")
        node = out
        for part in parents:
            node = node[int(part)] if isinstance(node, list) else node[part]
        if delete:
            del node[last]
        else:
            node[last] = value
        return out

    bad = [
        broken(pool, "spec.selectr", {}),  # misspelled
        broken(pool, "spec.selector", delete=True),  # required
        broken(pool, "spec.selector.matchExpressions", []),  # not in v1: labels only
        broken(pool, "spec.targetPorts", [{"number": 70000}]),
        broken(pool, "spec.targetPorts", [{"number": 8000}, {"number": 8000}]),
        broken(pool, "spec.targetPorts", []),
        broken(pool, "spec.endpointPickerRef.name", delete=True),
        broken(pool, "spec.endpointPickerRef.port", delete=True),  # required for a Service
        broken(pool, "spec.endpointPickerRef.failureMode", "Open"),
        broken(pool, "spec.appProtocol", "grpc"),
        broken(pool, "metadata.nmae", "p"),
        broken(route, "spec.parentRef", [{"name": "gw"}]),
        broken(route, "spec.parentRefs.0.name", delete=True),
        broken(route, "spec.rules.0.backendRefs.0.nmae", "p"),
        broken(route, "spec.rules.0.backendRefs.0.name", delete=True),
        broken(route, "spec.rules.0.timeouts", {"request": "10 minutes"}),
        broken(route, "spec.rules.0.timeouts", {"requests": "600s"}),
        broken(route, "spec.rules.0.retry", {"attempts": 2}),  # experimental channel only
        broken(route, "spec.rules.0.matches", [{"path": {"type": "Prefix", "value": "/"}}]),
    ]
    for obj in bad:
        with pytest.raises(jsonschema.ValidationError):
            validate(obj)


def test_our_inference_pool_and_route_fail_with_any_spec_field_misspelled_or_a_required_one_missing():
    objects = [o for _, o in source_objects() if (o["apiVersion"], o["kind"]) in SCHEMAS]
    assert sorted(o["kind"] for o in objects) == ["HTTPRoute", "InferencePool"]

    def refusals(obj: dict) -> set[str]:
        with pytest.raises(jsonschema.ValidationError):
            validate(obj)
        validator = jsonschema.Draft202012Validator(SCHEMAS[(obj["apiVersion"], obj["kind"])])
        return {error.validator for error in validator.iter_errors(obj)}

    for obj in objects:
        validate(obj)
        required = SCHEMAS[(obj["apiVersion"], obj["kind"])]["properties"]["spec"].get("required", [])
        for field in obj["spec"]:
            misspelled = copy.deepcopy(obj)
            misspelled["spec"][field[:-1]] = misspelled["spec"].pop(field)
            assert "additionalProperties" in refusals(misspelled), (obj["kind"], field)
            if field in required:
                missing = copy.deepcopy(obj)
                del missing["spec"][field]
                assert "required" in refusals(missing), (obj["kind"], field)


def test_every_source_object_validates_without_rendering():
    objects = source_objects()
    assert {o["kind"] for _, o in objects} >= {"Deployment", "Service", "InferencePool", "HTTPRoute"}
    for path, obj in objects:
        try:
            validate(obj)
        except (jsonschema.ValidationError, kubernetes_validate.ValidationError) as exc:
            raise AssertionError(f"{path.relative_to(ROOT)}: {obj['kind']}: {exc}") from exc


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_overlay_renders_and_every_object_validates(overlay):
    objects = render(overlay)
    for obj in objects:
        validate(obj)
        assert obj["kind"] == "Namespace" or obj["metadata"].get("namespace") == "specstream", obj["metadata"]
    assert one(objects, "Deployment", SERVER) and one(objects, "HorizontalPodAutoscaler")


# ------------------------------------------------------------------------- the Deployment
def server_container(objects) -> dict:
    pod = one(objects, "Deployment", SERVER)["spec"]["template"]["spec"]
    return next(c for c in pod["containers"] if c["name"] == SERVER)


def serve_args(container: dict):
    """What `specstream serve` makes of the container's arguments and literal environment."""
    assert Path(container["command"][0]).name == "specstream" and container["args"][0] == "serve"
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPECSTREAM_")}
    env |= {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}
    with mock.patch.dict(os.environ, env, clear=True):
        from gateway.cli import build_parser

        return build_parser().parse_args(container["args"])


def probe_seconds(probe: dict) -> int:
    """How long a probe keeps failing before it acts."""
    return probe.get("periodSeconds", 10) * probe.get("failureThreshold", 3)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_probes_ask_health_and_the_startup_probe_allows_a_first_start_that_compiles(overlay):
    container = server_container(render(overlay))
    port = next(p for p in container["ports"] if p["name"] == "http")
    assert port["containerPort"] == serve_args(container).port
    for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[kind]["httpGet"] == {"path": "/health", "port": "http"}, kind
    assert probe_seconds(container["startupProbe"]) >= 15 * 60


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_shutdown_timing_agrees_with_the_servers_drain(overlay):
    objects = render(overlay)
    pod = one(objects, "Deployment", SERVER)["spec"]["template"]["spec"]
    container = server_container(objects)
    shutdown_timeout = serve_args(container).shutdown_timeout
    command = container["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "sleep"
    pre_stop = float(command[1])
    # preStop, then SIGTERM and the drain, then the engine's stop (uvicorn cuts at 1 s; a few more to spare).
    assert pod["terminationGracePeriodSeconds"] >= pre_stop + shutdown_timeout + 10
    # A draining pod answers 503 on /health: liveness must not restart it meanwhile.
    assert probe_seconds(container["livenessProbe"]) > pre_stop + shutdown_timeout
    picker = named(objects, "Deployment", "specstream-epp")
    for epp in picker:  # the picker routes until the pool's pods are gone
        assert epp["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] >= pod["terminationGracePeriodSeconds"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_container_is_non_root_read_only_without_capabilities_and_bounded(overlay):
    for deployment in named(render(overlay), "Deployment"):
        pod = deployment["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] >= 10000
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        for container in pod["containers"]:
            sc = container["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False and sc["privileged"] is False
            assert sc["readOnlyRootFilesystem"] is True and sc["runAsNonRoot"] is True
            assert sc["capabilities"] == {"drop": ["ALL"]}
            for bound in ("requests", "limits"):
                assert {"cpu", "memory"} <= set(container["resources"][bound]), (container["name"], bound)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_server_writes_only_to_volumes_and_reads_its_keys_from_a_secret(overlay):
    objects = render(overlay)
    container = server_container(objects)
    pod = one(objects, "Deployment", SERVER)["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: volumes[m["name"]] for m in container["volumeMounts"]}
    env = {e["name"]: e for e in container["env"]}
    cache = env["SPECSTREAM_CACHE_DIR"]["value"]
    assert "persistentVolumeClaim" in mounts[cache] and "emptyDir" in mounts["/tmp"]
    for name in ("HOME", "HF_HOME"):
        assert any(Path(env[name]["value"]).is_relative_to(path) for path in mounts), name
    assert "secretKeyRef" in env["SPECSTREAM_API_KEYS"]["valueFrom"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_secret_config_map_and_claim_a_pod_names_exists(overlay):
    objects = render(overlay)
    data = {(o["kind"], o["metadata"]["name"]): o.get("data", {}) for o in objects}
    for deployment in named(objects, "Deployment"):
        pod = deployment["spec"]["template"]["spec"]
        assert ("ServiceAccount", pod["serviceAccountName"]) in data
        for volume in pod.get("volumes", []):
            if "configMap" in volume:
                assert ("ConfigMap", volume["configMap"]["name"]) in data
            if "persistentVolumeClaim" in volume:
                assert ("PersistentVolumeClaim", volume["persistentVolumeClaim"]["claimName"]) in data
        for container in pod["containers"]:
            for env in container.get("env", []):
                ref = env.get("valueFrom", {}).get("secretKeyRef")
                if ref:
                    assert ref["key"] in data[("Secret", ref["name"])], ref


def test_the_gpu_overlay_asks_for_a_gpu_and_runs_the_cuda_image():
    container = server_container(render("gpu"))
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert container["image"].endswith("-cu128")
    assert {"name": "SPECSTREAM_DEVICE", "value": "cuda"} in container["env"]
    assert "nvidia.com/gpu" not in server_container(render("cpu"))["resources"]["limits"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_autoscaler_scales_the_server_on_a_series_it_serves(overlay):
    objects = render(overlay)
    hpa = one(objects, "HorizontalPodAutoscaler")["spec"]
    assert hpa["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": SERVER}
    [metric] = hpa["metrics"]
    assert metric["pods"]["metric"]["name"] in served_series()
    assert hpa["minReplicas"] > one(objects, "PodDisruptionBudget")["spec"]["maxUnavailable"]


# ------------------------------------------------------------------ the Inference Extension
def served_series() -> dict[str, dict]:
    """The families /metrics serves, by name, with one sample's labels."""
    metrics = EngineMetrics(model_name="m", cache=CacheConfigInfo(16, 100, True, "bfloat16"))
    text = generate_latest(metrics.registry).decode()
    return {f.name: (f.samples[0].labels if f.samples else {}) for f in text_string_to_metric_families(text)}


def test_the_inference_pool_selects_the_server_pods_and_names_its_picker():
    objects = render("inference-extension")
    pool = one(objects, "InferencePool")
    labels = one(objects, "Deployment", SERVER)["spec"]["template"]["metadata"]["labels"]
    assert pool["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert "inference.networking.k8s.io/engine-type" not in labels  # read as vLLM
    ports = [p["containerPort"] for p in server_container(objects)["ports"]]
    assert [p["number"] for p in pool["spec"]["targetPorts"]] == ports
    ref = pool["spec"]["endpointPickerRef"]
    service = one(objects, "Service", ref["name"])
    assert ref["port"]["number"] in [p["port"] for p in service["spec"]["ports"]]
    epp = one(objects, "Deployment", ref["name"])
    assert service["spec"]["selector"].items() <= epp["spec"]["template"]["metadata"]["labels"].items()
    args = epp["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--pool-name") + 1] == pool["metadata"]["name"]
    [rule] = one(objects, "HTTPRoute")["spec"]["rules"]
    [backend] = rule["backendRefs"]
    assert backend["kind"] == "InferencePool" and backend["name"] == pool["metadata"]["name"]


def picker_config(objects=None) -> dict:
    if objects is None:
        return yaml.safe_load((K8S / "components" / "inference-extension" / "epp-config.yaml").read_text())
    [config_map] = [o for o in named(objects, "ConfigMap") if o["metadata"]["name"].startswith("specstream-epp")]
    return yaml.safe_load(config_map["data"]["epp-config.yaml"])


def test_the_picker_scores_prefix_cache_queue_and_kv_usage_from_series_specstream_serves():
    config = picker_config()
    # EndpointPickerConfig's fields and plugin types as of the Inference Extension's v1.5.0.
    assert config["apiVersion"] == "inference.networking.x-k8s.io/v1alpha1" and config["kind"] == "EndpointPickerConfig"
    fields = {"plugins", "schedulingProfiles", "saturationDetector", "dataLayer", "flowControl", "parser"}
    assert set(config) - {"apiVersion", "kind"} <= fields | {"featureGates"}
    plugins = {p.get("name", p["type"]): p for p in config["plugins"]}
    scorers = {"prefix-cache-scorer", "queue-scorer", "kv-cache-utilization-scorer"}
    known = scorers | {"max-score-picker", "metrics-data-source", "core-metrics-extractor"}
    assert {p["type"] for p in plugins.values()} <= known
    [profile] = config["schedulingProfiles"]
    refs = {p["pluginRef"]: p.get("weight") for p in profile["plugins"]}
    assert set(refs) <= set(plugins) and all(refs[s] > 0 for s in scorers)
    prefix = plugins["prefix-cache-scorer"]["parameters"]
    assert prefix["autoTune"] is True and prefix["blockSizeTokens"] == EngineConfig().kv_block_size
    [engine] = plugins["core-metrics-extractor"]["parameters"]["engineConfigs"]
    served = served_series()
    specs = ("queuedRequestsSpec", "runningRequestsSpec", "kvUsageSpec", "cacheInfoSpec")
    for spec in specs:
        assert engine[spec] in served, spec
    assert {"block_size", "num_gpu_blocks"} <= set(served[engine["cacheInfoSpec"]])
    assert plugins["metrics-data-source"]["parameters"]["path"] == "/metrics"


def test_the_rendered_picker_config_is_the_component_file_and_is_mounted_where_the_picker_reads_it():
    objects = render("inference-extension")
    assert picker_config(objects) == picker_config()
    pod = one(objects, "Deployment", "specstream-epp")["spec"]["template"]["spec"]
    args = pod["containers"][0]["args"]
    path = Path(args[args.index("--config-file") + 1])
    [mount] = [m for m in pod["containers"][0]["volumeMounts"] if path.parent == Path(m["mountPath"])]
    [volume] = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    assert volume["configMap"]["name"].startswith("specstream-epp-config") and path.name == "epp-config.yaml"


# --------------------------------------------------------------------------------- checkov
def checkov() -> str:
    found = shutil.which("checkov") or str(Path(sys.prefix) / "checkov" / "bin" / "checkov")
    if not Path(found).exists():
        pytest.skip("checkov is not installed (make setup puts it in .venv/checkov)")
    return found


def test_checkov_finds_nothing_and_every_skip_says_why(tmp_path):
    command = checkov()
    for overlay in OVERLAYS:
        (tmp_path / f"{overlay}.yaml").write_text(yaml.safe_dump_all(render(overlay)))
    done = subprocess.run(
        [command, "-d", str(tmp_path), "--framework", "kubernetes", "--skip-download", "-o", "json"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    report = json.loads(done.stdout)
    results = report["results"]
    failed = [(c["check_id"], c["resource"]) for c in results["failed_checks"]]
    assert failed == [] and done.returncode == 0, failed or done.stderr[-3000:]
    assert report["summary"]["passed"] > 300 and report["summary"]["parsing_errors"] == 0
    # Skips are annotations (checkov.io/skipN: CHECK=why) on the objects, each with its reason.
    for skipped in results["skipped_checks"]:
        assert len(skipped["check_result"]["suppress_comment"]) > 40, (skipped["check_id"], skipped["resource"])
