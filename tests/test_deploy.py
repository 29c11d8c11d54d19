"""The deployment files: every kustomize overlay renders and validates against the Kubernetes API's
schemas (kubernetes-validate, offline, strict), the compose files validate against the Compose
schema (from the docker-compose wheel that `make install` fetches), they keep the promises of
docs/guides/deploy.md (non-root, read-only root file system, probes, Redis reached only by the API,
AOF, ports on 127.0.0.1), and the serving image's dependencies hold no torch.

Building and running the image needs root, network and minutes: `make image-test`."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import tomllib
import zipfile

import pytest

from tests.conftest import REPO_ROOT, fail_or_skip

yaml = pytest.importorskip("yaml")
kubernetes_validate = pytest.importorskip("kubernetes_validate")

K8S_VERSION = "1.32.0"
KUSTOMIZATIONS = ["deploy/overlays/cpu", "deploy/overlays/gpu", "deploy/training", "deploy/megaface"]
COMPOSE_WHEEL = REPO_ROOT / ".cache" / "wheels" / "docker_compose-1.29.2-py2.py3-none-any.whl"


def render(directory: str) -> list[dict]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed: the kustomize overlays cannot be rendered here")
    out = subprocess.run(
        [kubectl, "kustomize", str(REPO_ROOT / directory)], capture_output=True, text=True, check=True
    )
    return [doc for doc in yaml.safe_load_all(out.stdout) if doc]


def by_kind(objects: list[dict]) -> dict[str, list[dict]]:
    kinds: dict[str, list[dict]] = {}
    for obj in objects:
        kinds.setdefault(obj["kind"], []).append(obj)
    return kinds


@pytest.mark.parametrize("directory", KUSTOMIZATIONS)
def test_every_overlay_renders_and_validates_strictly(directory):
    objects = render(directory)
    assert objects
    for obj in objects:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


def test_the_validator_catches_a_wrong_field():
    (deployment,) = by_kind(render("deploy/overlays/cpu"))["Deployment"]
    deployment["spec"]["template"]["spec"]["containers"][0]["livenessProbes"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, K8S_VERSION, strict=True)


def test_the_service_runs_locked_down_with_probes_and_redis_behind_a_policy():
    kinds = by_kind(render("deploy/overlays/cpu"))
    assert {"Deployment", "StatefulSet", "Service", "ConfigMap", "Secret", "NetworkPolicy",
            "PodDisruptionBudget", "HorizontalPodAutoscaler"} <= set(kinds)  # fmt: skip
    (api,) = kinds["Deployment"]
    pod = api["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["topologySpreadConstraints"]
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert container["resources"]["requests"] and container["resources"]["limits"]
    (redis,) = kinds["StatefulSet"]
    args = redis["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--appendfsync") + 1] == "always" and redis["spec"]["volumeClaimTemplates"]
    (policy,) = kinds["NetworkPolicy"]
    assert policy["spec"]["podSelector"]["matchLabels"] == {"app.kubernetes.io/name": "sphereface-redis"}
    assert policy["spec"]["ingress"][0]["from"] == [
        {"podSelector": {"matchLabels": {"app.kubernetes.io/name": "sphereface-api"}}}
    ]
    (secret,) = kinds["Secret"]
    assert secret["stringData"]["SPHEREFACE_API_KEY"] == "change-me-before-use"  # a placeholder only

    gpu = by_kind(render("deploy/overlays/gpu"))["Deployment"][0]["spec"]["template"]["spec"]
    assert gpu["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert {"name": "SPHEREFACE_PROVIDERS", "value": "cuda,cpu"} in gpu["containers"][0]["env"]


def test_multi_node_training_uses_the_rendezvous_the_trainer_expects():
    kinds = by_kind(render("deploy/training"))
    (job,) = kinds["Job"]
    assert job["spec"]["completionMode"] == "Indexed"
    assert job["spec"]["completions"] == job["spec"]["parallelism"]
    command = job["spec"]["template"]["spec"]["containers"][0]["args"][0]
    assert '--node-rank="$JOB_COMPLETION_INDEX"' in command and "--rdzv-backend=c10d" in command
    assert "-m models.cli train" in command
    (service,) = kinds["Service"]
    assert service["spec"]["clusterIP"] == "None"
    assert job["spec"]["template"]["spec"]["subdomain"] == service["metadata"]["name"]


def test_megaface_shards_one_per_pod_then_one_search_over_all_of_them():
    jobs = {job["metadata"]["name"]: job for job in by_kind(render("deploy/megaface"))["Job"]}
    embed, search = jobs["sphereface-megaface-embed"], jobs["sphereface-megaface-search"]
    assert embed["spec"]["completionMode"] == "Indexed"
    command = embed["spec"]["template"]["spec"]["containers"][0]["args"][0]
    assert "evaluate megaface-shard" in command and '--shard "$JOB_COMPLETION_INDEX"' in command
    search_command = search["spec"]["template"]["spec"]["containers"][0]["args"][0]
    assert "--extra-features" in search_command and "shard-*.json" in search_command
    # the command the pods run exists, with the options the manifest passes
    from models.cli import main

    with pytest.raises(SystemExit) as shown:
        main(["evaluate", "megaface-shard", "--help"])
    assert shown.value.code == 0


def compose_schema() -> dict:
    if not COMPOSE_WHEEL.exists():
        fail_or_skip(f"missing {COMPOSE_WHEEL} (make install downloads it)")
    with zipfile.ZipFile(COMPOSE_WHEEL) as wheel:
        return json.loads(wheel.read("compose/config/compose_spec.json"))


@pytest.mark.parametrize("name", ["compose.yaml", "compose.gpu.yaml"])
def test_the_compose_files_validate(name):
    import jsonschema

    schema = compose_schema()
    document = yaml.safe_load((REPO_ROOT / "docker" / name).read_text())
    validator = jsonschema.validators.validator_for(schema)(schema)
    assert [e.message for e in validator.iter_errors(document)] == []
    broken = {**document, "servces": {}}
    assert list(validator.iter_errors(broken)), "the schema check must be able to fail"


def test_compose_publishes_only_on_localhost_and_keeps_redis_private():
    compose = yaml.safe_load((REPO_ROOT / "docker" / "compose.yaml").read_text())
    api, redis = compose["services"]["api"], compose["services"]["redis"]
    assert api["ports"] == ["${SPHEREFACE_PUBLISH:-127.0.0.1:8000}:8000"]
    assert "ports" not in redis
    assert api["depends_on"]["redis"]["condition"] == "service_healthy"
    assert "--appendfsync" in redis["command"] and "always" in redis["command"]
    assert api["environment"]["SPHEREFACE_API_KEY"] == "${SPHEREFACE_API_KEY:-}"  # never a value here
    assert "api-data:/data" in api["volumes"]  # where the first start writes the admin key it makes
    ignored = subprocess.run(
        ["git", "check-ignore", "docker/.env"], cwd=REPO_ROOT, capture_output=True, text=True
    )
    assert ignored.returncode == 0, "docker/.env (the admin key) must not be committed"


def test_an_empty_key_from_compose_means_no_key():
    from service.settings import Settings

    assert Settings(api_key="").api_key is None and Settings(api_key="  ").api_key is None
    assert Settings(api_key="s3cret").api_key.get_secret_value() == "s3cret"


def test_the_serving_image_installs_no_torch_no_training_code_and_no_matplotlib():
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    serving = project["dependencies"] + project["optional-dependencies"]["cpu"]
    serving += project["optional-dependencies"]["gpu"]
    assert not [d for d in serving if re.match(r"(torch|matplotlib)\b", d)], serving
    assert [d for d in project["optional-dependencies"]["train"] if d.startswith("matplotlib")]
    dockerfile = (REPO_ROOT / "docker" / "Dockerfile").read_text()
    assert re.search(r"ARG EXTRA=cpu", dockerfile) and "install --no-cache-dir" in dockerfile
    copied = re.findall(r"^COPY (\S+)", dockerfile, re.MULTILINE)
    assert "models" in copied and "service" in copied and "training" not in copied, copied
    # the build fails if any of them sneaks in
    assert "for m in ('torch', 'training', 'matplotlib')" in dockerfile
