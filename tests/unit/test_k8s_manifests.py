"""The KubeRay manifests under k8s/ (k8s/README.md): they are what `kubectl apply` accepts and
what Serve and the app accept, without a cluster.

- every YAML file under k8s/ parses; each RayService validates against the RayService CRD's
  openAPIV3Schema (../shared/k8s/ray.io_rayservices.yaml, the version named by the manifest's
  apiVersion), with unknown fields refused as `kubectl apply` does by default (strict field
  validation); the claim is a PersistentVolumeClaim;
- each serveConfigV2 validates as a Serve config (ServeDeploySchema) and its args as the app's
  (parse_app_config, which only builds pydantic and dataclass objects: it never opens
  engine.model_dir, which does not exist here); its keys and deployment names are
  serve_config.yaml's, so the two cannot drift;
- pods: the head runs no replicas and keeps KubeRay's probes; worker readiness checks /health on
  the serve port; the ports are named; GPU workers have tensor_parallel_size GPUs.
"""

from __future__ import annotations

import ast
import copy
from pathlib import Path

import pytest
import yaml

from deployments.config import parse_app_config

REPO = Path(__file__).resolve().parents[2]
K8S_DIR = REPO / "k8s"
SERVE_CONFIG = REPO / "serve_config.yaml"
# the local config each manifest carries the application of
LOCAL_CONFIGS = {"rayservice-cpu.yaml": SERVE_CONFIG, "rayservice-gpu.yaml": REPO / "serve_config_gpu.yaml"}
CRD_FILE = REPO.parent / "shared" / "k8s" / "ray.io_rayservices.yaml"

SERVE_PORT = 8000
METRICS_PORT = 8080
# Engine keys a manifest gives that serve_config.yaml leaves at their default: the default
# model_dir (next to the engine package) does not exist once `pip install .` put the package in
# site-packages, and the GPU model comes from the claim.
K8S_ONLY_ENGINE_KEYS = {"model_dir"}


def _documents(path: Path) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


YAML_FILES = sorted(K8S_DIR.glob("**/*.yaml")) + sorted(K8S_DIR.glob("**/*.yml"))
MANIFESTS = [(path, doc) for path in YAML_FILES for doc in _documents(path)]
RAY_SERVICES = [(path, doc) for path, doc in MANIFESTS if doc.get("kind") == "RayService"]
RAY_SERVICE_IDS = [path.name for path, _ in RAY_SERVICES]


def _serve_config(service: dict) -> dict:
    return yaml.safe_load(service["spec"]["serveConfigV2"])


def _application(service: dict) -> dict:
    (app,) = _serve_config(service)["applications"]
    return app


def _cluster(service: dict) -> dict:
    return service["spec"]["rayClusterConfig"]


def _ray_container(pod_template: dict) -> dict:
    """The Ray container of a group's pod template: KubeRay's rule is the first container."""
    return pod_template["spec"]["containers"][0]


def _ports(container: dict) -> dict[str, int]:
    return {port["name"]: port["containerPort"] for port in container.get("ports", [])}


# ----- files and CRD schema


def test_k8s_dir_has_the_manifests():
    names = {path.name for path in YAML_FILES}
    assert {"rayservice-gpu.yaml", "rayservice-cpu.yaml", "model-pvc.yaml"} <= names
    assert len(RAY_SERVICES) >= 2


@pytest.mark.parametrize("path", YAML_FILES, ids=[p.name for p in YAML_FILES])
def test_every_yaml_file_parses_into_kubernetes_objects(path):
    docs = _documents(path)
    assert docs, f"{path} has no document"
    for doc in docs:
        assert isinstance(doc, dict) and doc.get("apiVersion") and doc.get("kind"), path
        assert doc.get("metadata", {}).get("name"), f"{path}: {doc.get('kind')} without a name"


def _strict(schema):
    """The schema with unknown fields refused wherever it lists an object's fields (and does
    not say to keep unknown ones), as the API server's strict field validation does; jsonschema
    alone would accept a misspelled field that Kubernetes then drops."""
    if isinstance(schema, dict):
        schema = {key: _strict(value) for key, value in schema.items()}
        if ("properties" in schema and "additionalProperties" not in schema
                and not schema.get("x-kubernetes-preserve-unknown-fields")):
            schema["additionalProperties"] = False
        return schema
    if isinstance(schema, list):
        return [_strict(item) for item in schema]
    return schema


@pytest.fixture(scope="module")
def crd():
    if not CRD_FILE.is_file():
        reason = f"RayService CRD not found at {CRD_FILE}"
        print(reason)
        pytest.skip(reason)
    return yaml.safe_load(CRD_FILE.read_text())


def _validator(crd: dict, api_version: str):
    """A JSON-schema validator for the CRD version that `api_version` ("group/version") names."""
    from jsonschema import Draft7Validator

    group, _, version = api_version.partition("/")
    assert group == crd["spec"]["group"], f"apiVersion {api_version} is not of {crd['spec']['group']}"
    (entry,) = [v for v in crd["spec"]["versions"] if v["name"] == version]
    assert entry["served"], f"CRD version {version} is not served"
    schema = _strict(entry["schema"]["openAPIV3Schema"])
    Draft7Validator.check_schema(schema)
    return Draft7Validator(schema)


def _crd_errors(crd: dict, service: dict) -> list[str]:
    validator = _validator(crd, service["apiVersion"])
    return [f"{'.'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}"
            for e in validator.iter_errors(service)]


@pytest.mark.parametrize("path,service", RAY_SERVICES, ids=RAY_SERVICE_IDS)
def test_ray_service_validates_against_the_crd(crd, path, service):
    assert service["apiVersion"] == "ray.io/v1"
    assert _crd_errors(crd, service) == []


def _gpu_service() -> dict:
    (service,) = [doc for path, doc in RAY_SERVICES if path.name == "rayservice-gpu.yaml"]
    return copy.deepcopy(service)


def _delete_head_group(service):
    del service["spec"]["rayClusterConfig"]["headGroupSpec"]


def _max_replicas_as_text(service):
    service["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["maxReplicas"] = "four"


def _port_as_text(service):
    _ray_container(service["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["template"])[
        "ports"][0]["containerPort"] = "8000"


def _unknown_upscaling_mode(service):
    service["spec"]["rayClusterConfig"]["autoscalerOptions"]["upscalingMode"] = "Eager"


def _misspelled_optional_field(service):
    cluster = service["spec"]["rayClusterConfig"]
    cluster["enableInTreeAutoScaling"] = cluster.pop("enableInTreeAutoscaling")


def _serve_config_as_mapping(service):
    service["spec"]["serveConfigV2"] = yaml.safe_load(service["spec"]["serveConfigV2"])


@pytest.mark.parametrize("mutate,named", [
    (_delete_head_group, "'headGroupSpec' is a required property"),
    (_max_replicas_as_text, "maxReplicas: 'four' is not of type 'integer'"),
    (_port_as_text, "containerPort: '8000' is not of type 'integer'"),
    (_unknown_upscaling_mode, "upscalingMode: 'Eager' is not one of"),
    (_misspelled_optional_field, "'enableInTreeAutoScaling' was unexpected"),
    (_serve_config_as_mapping, "serveConfigV2: "),
], ids=lambda value: getattr(value, "__name__", ""))
def test_crd_validation_refuses_a_broken_manifest(crd, mutate, named):
    """The validator checks required fields, types, enums and unknown fields: each broken
    manifest gets exactly the one error its change causes."""
    service = _gpu_service()
    assert _crd_errors(crd, service) == []
    mutate(service)
    errors = _crd_errors(crd, service)
    assert len(errors) == 1 and named in errors[0], errors


def test_model_claim_is_a_persistent_volume_claim():
    (claim,) = _documents(K8S_DIR / "model-pvc.yaml")
    assert claim["apiVersion"] == "v1" and claim["kind"] == "PersistentVolumeClaim"
    spec = claim["spec"]
    assert spec["accessModes"] and set(spec["accessModes"]) <= {
        "ReadWriteOnce", "ReadOnlyMany", "ReadWriteMany", "ReadWriteOncePod"}
    assert str(spec["resources"]["requests"]["storage"])[0].isdigit()
    # the GPU pods mount exactly this claim
    claim_names = {
        volume["persistentVolumeClaim"]["claimName"]
        for group in [_cluster(_gpu_service())["headGroupSpec"],
                      *_cluster(_gpu_service())["workerGroupSpecs"]]
        for volume in group["template"]["spec"].get("volumes", [])
        if "persistentVolumeClaim" in volume
    }
    assert claim_names == {claim["metadata"]["name"]}


# ----- the Serve config and the app's args


@pytest.mark.parametrize("path,service", RAY_SERVICES, ids=RAY_SERVICE_IDS)
def test_serve_config_is_a_valid_serve_deploy_config(path, service):
    from ray.serve.schema import ServeDeploySchema

    config = ServeDeploySchema.model_validate(_serve_config(service))
    assert config.http_options.host == "0.0.0.0" and config.http_options.port == SERVE_PORT
    (app,) = config.applications
    assert app.import_path == "deployments.app:build_app"


def _deployment_class_names() -> set[str]:
    """Deployment names in deployments/ (read from the source): classes decorated with
    @serve.deployment, and `serve.deployment(name=...)(cls)` calls."""
    names = set()
    for source in (REPO / "deployments").rglob("*.py"):
        for node in ast.walk(ast.parse(source.read_text())):
            if isinstance(node, ast.ClassDef):
                for decorator in node.decorator_list:
                    target = decorator.func if isinstance(decorator, ast.Call) else decorator
                    if ast.unparse(target) in ("serve.deployment", "deployment"):
                        names.add(node.name)
            elif isinstance(node, ast.Call) and ast.unparse(node.func) == "serve.deployment":
                names.update(kw.value.value for kw in node.keywords
                             if kw.arg == "name" and isinstance(kw.value, ast.Constant))
    return names


def test_deployment_classes_are_found():
    assert {"LLMServer", "Renderer", "OpenAIIngress", "CheckpointIngressRouter"} <= _deployment_class_names()


@pytest.mark.parametrize("path,service", RAY_SERVICES, ids=RAY_SERVICE_IDS)
def test_args_parse_and_match_serve_config_yaml(path, service):
    app = _application(service)
    (local_app,) = yaml.safe_load(LOCAL_CONFIGS[Path(path).name].read_text())["applications"]
    args, local_args = app["args"], local_app["args"]

    config = parse_app_config(args)  # pydantic only: model_dir is not opened
    assert config.engine.model_dir == args["engine"]["model_dir"]
    assert set(args) == set(local_args)
    assert set(args["engine"]) - K8S_ONLY_ENGINE_KEYS == set(local_args["engine"]) - K8S_ONLY_ENGINE_KEYS
    assert K8S_ONLY_ENGINE_KEYS <= set(args["engine"])

    names = [d["name"] for d in app["deployments"]]
    assert names == [d["name"] for d in local_app["deployments"]]
    assert set(names) <= _deployment_class_names()


@pytest.mark.parametrize("path,service", RAY_SERVICES, ids=RAY_SERVICE_IDS)
def test_llm_server_autoscales_within_the_worker_group(path, service):
    """One LLM server replica a worker pod: the group can grow to max_replicas pods."""
    (llm,) = [d for d in _application(service)["deployments"] if d["name"] == "LLMServer"]
    scaling = llm["autoscaling_config"]
    assert 1 <= scaling["min_replicas"] < scaling["max_replicas"]
    cluster = _cluster(service)
    assert cluster["enableInTreeAutoscaling"] is True
    assert {"upscalingMode", "idleTimeoutSeconds", "resources"} <= set(cluster["autoscalerOptions"])
    (group,) = cluster["workerGroupSpecs"]
    assert group["minReplicas"] >= 1  # the head runs no replicas
    assert group["maxReplicas"] >= scaling["max_replicas"]


def test_gpu_manifest_engine_runs_on_cuda_from_the_claim():
    engine = parse_app_config(_application(_gpu_service())["args"]).engine
    assert engine.device == "cuda" and engine.dtype == "bfloat16"
    mounts = {m["mountPath"] for m in _ray_container(
        _cluster(_gpu_service())["workerGroupSpecs"][0]["template"])["volumeMounts"]}
    assert any(engine.model_dir.startswith(mount.rstrip("/") + "/") for mount in mounts)


def test_cpu_manifest_serves_the_embedded_model():
    (service,) = [doc for path, doc in RAY_SERVICES if path.name == "rayservice-cpu.yaml"]
    engine = parse_app_config(_application(service)["args"]).engine
    assert engine.device == "cpu" and engine.dtype == "float32"
    # where k8s/Dockerfile copies the repository, and the model is there in the repository
    assert engine.model_dir == "/home/ray/hybrid-serve/models/tiny-granite-hybrid"
    assert (REPO / "models" / "tiny-granite-hybrid" / "config.json").is_file()
    assert "COPY --chown=ray:users . /home/ray/hybrid-serve" in (K8S_DIR / "Dockerfile").read_text()


# ----- pods


@pytest.mark.parametrize("path,service", RAY_SERVICES, ids=RAY_SERVICE_IDS)
def test_every_ray_container_sets_the_lean_path_switches(path, service):
    """The lean path's switches must be in the environment of every Ray process (Serve reads
    them when it starts), so in the head's and every worker's Ray container."""
    from deployments.serving_path import LEAN_CLUSTER_ENV

    assert parse_app_config(_application(service)["args"]).direct_ingress
    cluster = _cluster(service)
    templates = [cluster["headGroupSpec"]["template"]] + [
        group["template"] for group in cluster["workerGroupSpecs"]]
    for template in templates:
        env = {var["name"]: var.get("value") for var in _ray_container(template).get("env", [])}
        assert {k: env.get(k) for k in LEAN_CLUSTER_ENV} == LEAN_CLUSTER_ENV, \
            _ray_container(template)["name"]


@pytest.mark.parametrize("path,service", RAY_SERVICES, ids=RAY_SERVICE_IDS)
def test_head_runs_no_replicas_and_keeps_kuberay_probes(path, service):
    head = _cluster(service)["headGroupSpec"]
    assert head["rayStartParams"]["num-cpus"] == "0"
    assert head["rayStartParams"].get("num-gpus", "0") == "0"
    container = _ray_container(head["template"])
    assert "nvidia.com/gpu" not in container.get("resources", {}).get("limits", {})
    # KubeRay submits serveConfigV2 only once the head is ready: a probe on the application
    # would never pass, so the head keeps KubeRay's own (raylet and GCS).
    assert "readinessProbe" not in container and "livenessProbe" not in container
    assert service["spec"]["excludeHeadPodFromServeSvc"] is True
    assert _ports(container)["serve"] == SERVE_PORT
    assert _ports(container)["metrics"] == METRICS_PORT


@pytest.mark.parametrize("path,service", RAY_SERVICES, ids=RAY_SERVICE_IDS)
def test_worker_readiness_checks_health_on_the_serve_port(path, service):
    for group in _cluster(service)["workerGroupSpecs"]:
        container = _ray_container(group["template"])
        assert _ports(container) == {"serve": SERVE_PORT, "metrics": METRICS_PORT}
        assert group["rayStartParams"]["metrics-export-port"] == str(METRICS_PORT)
        probe = container["readinessProbe"]
        script = " ".join(probe["exec"]["command"])
        assert f"http://localhost:{SERVE_PORT}/health" in script      # the application
        assert f"http://localhost:{SERVE_PORT}/-/healthz" in script   # the proxy, drain-aware
        # both wget timeouts fit in the probe's
        assert probe["timeoutSeconds"] >= 2 + 5
        # liveness is KubeRay's (raylet): the application's health is not this pod's
        assert "livenessProbe" not in container
    assert _cluster(service)["headGroupSpec"]["rayStartParams"]["metrics-export-port"] == str(METRICS_PORT)


def test_gpu_workers_have_a_gpu_per_tensor_parallel_rank():
    """Each pod holds whole model copies: nvidia.com/gpu is a multiple of tensor_parallel_size
    (the ranks of one copy are STRICT_PACKed on one Ray node, which is one pod)."""
    service = _gpu_service()
    tp = parse_app_config(_application(service)["args"]).engine.tensor_parallel_size
    (group,) = _cluster(service)["workerGroupSpecs"]
    resources = _ray_container(group["template"])["resources"]
    gpus = int(resources["limits"]["nvidia.com/gpu"])
    assert gpus >= tp and gpus % tp == 0
    assert int(resources["requests"].get("nvidia.com/gpu", gpus)) == gpus


@pytest.mark.parametrize("path,service", RAY_SERVICES, ids=RAY_SERVICE_IDS)
def test_all_ray_containers_run_one_image(path, service):
    cluster = _cluster(service)
    groups = [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]
    images = {_ray_container(group["template"])["image"] for group in groups}
    assert len(images) == 1, images
    (image,) = images
    assert image.rsplit(":", 1)[-1].startswith("0.1.0")
    assert cluster["rayVersion"] == "2.60.0"
    assert "rayproject/ray:2.60.0-" in (K8S_DIR / "Dockerfile").read_text()
