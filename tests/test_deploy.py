"""The deployment files: every kustomize overlay renders and validates against the Kubernetes API's
schemas (kubernetes-validate, offline, strict), the compose files validate against the Compose
schema (from the docker-compose wheel that `make install` fetches), they keep the promises of
docs/guides/deploy.md (non-root, read-only root file system, probes, Redis reached only by the API,
AOF, ports on 127.0.0.1), and the serving image's dependencies hold no torch. The Redis Cluster
deployment (deploy/overlays/redis-cluster, docker/compose.cluster.yaml) gives the API every node
and no REDIS_URL, admits only the API and the create Job to the nodes, and its create script makes
3 primaries with a replica each from 6 local redis-servers, then changes nothing when run again.
The training Job names configs that load and paths on its volume, and its own command line trains
on two nodes on loopback and resumes exactly after one of them is killed.

Building and running the image needs root, network and minutes: `make image-test`."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import tomllib
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT, fail_or_skip, require_shared

yaml = pytest.importorskip("yaml")
kubernetes_validate = pytest.importorskip("kubernetes_validate")

K8S_VERSION = "1.32.0"
KUSTOMIZATIONS = [
    "deploy/overlays/cpu", "deploy/overlays/gpu", "deploy/overlays/redis-cluster", "deploy/training",
    "deploy/megaface",
]  # fmt: skip
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


CONFIG_PATH = re.compile(r"training/configs/[\w./-]+\.toml")


def test_every_config_that_deploy_or_docker_names_exists_and_loads():
    from training.config import load_config

    named = set()
    for folder in ("deploy", "docker"):
        for path in sorted((REPO_ROOT / folder).rglob("*")):
            if path.is_file():
                named |= set(CONFIG_PATH.findall(path.read_text(errors="replace")))
    (configmap,) = by_kind(render("deploy/training"))["ConfigMap"]
    assert configmap["data"]["CONFIG"] in named
    for name in sorted(named):
        config = load_config(REPO_ROOT / name)
        assert config.network == "sphereface20" and config.head == "asoftmax", name


def test_the_training_job_names_its_paths_and_writes_only_to_its_volumes():
    from training.evaluation.cache import default_landmark_cache_dir

    kinds = by_kind(render("deploy/training"))
    (job,), (configmap,) = kinds["Job"], kinds["ConfigMap"]
    container = job["spec"]["template"]["spec"]["containers"][0]
    command = container["args"][0]
    mounts = {m["mountPath"] for m in container["volumeMounts"]}
    for key in ("data", "lfw", "out_dir"):  # given explicitly, on the shared volume
        (value,) = re.findall(rf"--set {key}=(\S+)", command)
        assert value.startswith("/shared/"), (key, value)
    assert "--resume" in command  # the same Job run again continues the run
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert {"/shared", "/tmp"} <= mounts
    with pytest.MonkeyPatch.context() as env:
        env.setenv("SPHEREFACE_CACHE", configmap["data"]["SPHEREFACE_CACHE"])
        assert default_landmark_cache_dir().parts[:2] == ("/", "shared")


# -- The training Job's own command line, as 2 nodes x 1 process on loopback (gloo, CPU) --

#: A 20-step run of the smallest network on two identities (added to the Job's command line; lr
#: 0.01: at the recipe's 0.1 a batch of 8 diverges within 10 steps).
TINY_RUN = (
    "network=sphereface4", "embedding_size=64", "batch_size=8", "steps=20", "lr=0.01", "log_every=1",
    "checkpoint_every=5", "threads=1",
)  # fmt: skip


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def tiny_lfw(root: Path) -> Path:
    """An LFW folder of the real images with 10 folds x (1 same + 1 different pair): 20 pairs."""
    real = require_shared("lfw")
    header, *body = (real / "pairs.txt").read_text().splitlines()
    folds, per_fold = (int(x) for x in header.split())
    kept = [body[fold * 2 * per_fold + k] for fold in range(folds) for k in (0, per_fold)]
    root.mkdir(parents=True)
    (root / "pairs.txt").write_text(f"{folds}\t1\n" + "\n".join(kept) + "\n")
    (root / "images").symlink_to(real / "images")
    return root


@dataclass
class LoopbackJob:
    """The training Job's pods as process groups on this machine: each node runs the Job's command
    line through ``sh -c`` with the Job's environment, the shared volume at ``shared`` and the
    rendezvous endpoint on 127.0.0.1, in a working directory holding only the configs."""

    command: str
    env: dict[str, str]
    shared: Path
    workdir: Path

    @classmethod
    def from_manifest(cls, tmp_path: Path) -> LoopbackJob:
        kinds = by_kind(render("deploy/training"))
        (job,), (configmap,) = kinds["Job"], kinds["ConfigMap"]
        container = job["spec"]["template"]["spec"]["containers"][0]
        assert container["command"] == ["sh", "-c"]
        (mount,) = [m["mountPath"] for m in container["volumeMounts"] if m["name"] == "shared"]
        shared, workdir = tmp_path / "shared", tmp_path / "workdir"
        (endpoint,) = re.findall(r"--rdzv-endpoint=(\S+)", container["args"][0])
        command = container["args"][0].replace(endpoint, "127.0.0.1:{port}").replace(mount, str(shared))
        env = {key: value.replace(mount, str(shared)) for key, value in configmap["data"].items()}
        shutil.copytree(REPO_ROOT / "training" / "configs", workdir / "training" / "configs")
        return cls(command, env, shared, workdir)

    def start(self, name: str) -> list[subprocess.Popen]:
        """Both nodes of run ``name`` (one process each), started at once."""
        port = free_port()
        extra = " ".join(f"--set {item}" for item in (*TINY_RUN, f"name={name}"))
        nodes = []
        for node in range(int(self.env["NNODES"])):
            env = {
                **os.environ, **self.env, "NPROC_PER_NODE": "1", "JOB_COMPLETION_INDEX": str(node),
                "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "OMP_NUM_THREADS": "1",
            }  # fmt: skip
            log = (self.shared / f"{name}-node{node}.log").open("a")
            nodes.append(subprocess.Popen(
                ["sh", "-c", f"{self.command.format(port=port)} {extra}"], cwd=self.workdir, env=env,
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            ))  # fmt: skip
        return nodes

    def run(self, name: str) -> None:
        self.wait(name, self.start(name))

    def wait(self, name: str, nodes: list[subprocess.Popen]) -> None:
        """Both nodes of run ``name`` end well (within 4 minutes)."""
        try:
            for node, process in enumerate(nodes):
                assert process.wait(timeout=240) == 0, self.log(name, node)
        finally:
            for process in nodes:
                stop(process)

    def log(self, name: str, node: int) -> str:
        return (self.shared / f"{name}-node{node}.log").read_text()[-3000:]


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (torchrun starts its workers in sessions of their own)."""
    parents: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        children = parents.get(todo.pop(), [])
        found += children
        todo += children
    return found


def kill_node(process: subprocess.Popen) -> None:
    """SIGKILL the node's torchrun and every process under it, as a dying pod loses them all."""
    for pid in [process.pid, *descendants(process.pid)]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    process.wait()


def stop(process: subprocess.Popen) -> None:
    """Kill the node if it still runs."""
    if process.poll() is None:
        kill_node(process)


def wait_for(path: Path, nodes: list[subprocess.Popen], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert all(n.poll() is None for n in nodes), "a node ended before the first checkpoint"
        assert time.monotonic() < deadline, f"no {path} after {timeout} s"
        time.sleep(0.02)


@pytest.mark.shared_data
@pytest.mark.slow
def test_the_job_trains_on_two_nodes_and_a_killed_node_resumes_exactly(tiny_prepared, tmp_path):
    import torch

    job = LoopbackJob.from_manifest(tmp_path)
    (job.shared / "data").mkdir(parents=True)
    (job.shared / "data" / "casia_webface").symlink_to(tiny_prepared.path)
    tiny_lfw(job.shared / "data" / "lfw")
    runs = job.shared / "runs"
    whole = job.start("whole")  # the uninterrupted run, side by side with the one that is killed
    nodes = job.start("parts")
    try:
        wait_for(runs / "parts" / "checkpoint.pt", nodes, timeout=180)
        kill_node(nodes[1])  # node 1 dies mid-run
        assert nodes[0].wait(timeout=120) != 0, "the surviving node must fail the run, not finish or hang"
    finally:
        for process in nodes:
            stop(process)
    job.wait("whole", whole)
    summary = json.loads((runs / "whole" / "summary.json").read_text())
    assert summary["processes"] == 2 and summary["final"]["step"] == 20 and summary["lfw"]["pairs"] == 20
    assert len(set(summary["rank_weight_checksums"])) == 1
    # The LFW check's landmark cache went to the volume; the working dir got nothing.
    assert list((job.shared / "cache" / "lfw_landmarks").glob("*.npz"))
    assert [p.name for p in job.workdir.iterdir()] == ["training"]
    stopped_at = torch.load(runs / "parts" / "checkpoint.pt", weights_only=True)["step"]
    assert 5 <= stopped_at < 20 and not (runs / "parts" / "summary.json").exists()
    job.run("parts")  # both nodes again, with the Job's --resume

    a = torch.load(runs / "whole" / "checkpoint.pt", weights_only=True)
    b = torch.load(runs / "parts" / "checkpoint.pt", weights_only=True)
    assert b["step"] == 20
    for part in ("net", "head"):
        for key, value in a[part].items():
            assert torch.equal(value, b[part][key]), f"{part}.{key} differs after the node was killed"
    (entry,) = [json.loads(line) for line in (runs / "parts" / "resumes.jsonl").read_text().splitlines()]
    assert entry == {**entry, "step": stopped_at, "processes": 2, "changed": {}}


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


@pytest.mark.parametrize("name", ["compose.yaml", "compose.gpu.yaml", "compose.cluster.yaml"])
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


# -- The gallery on a Redis Cluster: deploy/overlays/redis-cluster and docker/compose.cluster.yaml --

CLUSTER_DIR = "deploy/components/redis-cluster"
CLUSTER_OVERLAY = "deploy/overlays/redis-cluster"
NODE_LABEL = {"app.kubernetes.io/name": "sphereface-redis-cluster"}


def named(objects: list[dict], kind: str, name: str) -> dict:
    (found,) = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    return found


def redis_config(text: str) -> dict[str, str]:
    """A redis.conf as directive -> value (comments and blank lines dropped)."""
    pairs = (line.split(None, 1) for line in text.splitlines() if line.strip() and not line.startswith("#"))
    return {key: value for key, value in pairs}


def test_the_cluster_overlay_runs_six_locked_down_nodes_instead_of_one_redis():
    objects = render(CLUSTER_OVERLAY)
    (nodes,) = by_kind(objects)["StatefulSet"]  # the base's single Redis is gone
    assert not [o for o in objects if o["metadata"]["name"] == "sphereface-redis"]
    assert nodes["metadata"]["name"] == "sphereface-redis-cluster" and nodes["spec"]["replicas"] == 6
    pod = nodes["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    single = by_kind(render("deploy/overlays/cpu"))["StatefulSet"][0]["spec"]["template"]["spec"]
    assert pod["securityContext"] == single["securityContext"]
    assert container["securityContext"] == single["containers"][0]["securityContext"]
    assert container["readinessProbe"] and container["livenessProbe"] and container["resources"]["limits"]
    assert nodes["spec"]["volumeClaimTemplates"][0]["metadata"]["name"] == "data"
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert mounts["data"] == "/data"
    # redis-server reads node.conf from the ConfigMap, keeps its data on the volume and announces
    # its stable DNS name <pod>.<headless service>
    args = container["args"]
    assert (
        args[:2] == ["redis-server", f"{mounts['config']}/node.conf"]
        and args[args.index("--dir") + 1] == "/data"
    )
    service = named(objects, "Service", nodes["spec"]["serviceName"])
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"] is True
    assert {p["port"] for p in service["spec"]["ports"]} == {6379, 16379}
    assert args[args.index("--cluster-announce-hostname") + 1] == f"$(POD_NAME).{service['metadata']['name']}"
    (pod_name,) = [e for e in container["env"] if e["name"] == "POD_NAME"]
    assert pod_name["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    (volume,) = [v for v in pod["volumes"] if v["name"] == "config"]
    conf = redis_config(named(objects, "ConfigMap", volume["configMap"]["name"])["data"]["node.conf"])
    assert conf["cluster-enabled"] == "yes" and conf["cluster-preferred-endpoint-type"] == "hostname"
    assert conf["appendonly"] == "yes" and conf["appendfsync"] == "always" and conf["save"] == '""'
    assert int(conf["cluster-node-timeout"]) > 0
    assert named(objects, "PodDisruptionBudget", "sphereface-redis-cluster")["spec"]["maxUnavailable"] == 1


def test_the_gpu_overlay_takes_the_cluster_component_as_well(tmp_path):
    """docs/guides/deploy.md: add the component to deploy/overlays/gpu for the GPU image."""
    (tmp_path / "kustomization.yaml").write_text(
        f"resources:\n  - {os.path.relpath(REPO_ROOT / 'deploy/overlays/gpu', tmp_path)}\n"
        f"components:\n  - {os.path.relpath(REPO_ROOT / CLUSTER_DIR, tmp_path)}\n"
    )
    objects = render(str(tmp_path))
    for obj in objects:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
    kinds = by_kind(objects)
    (api,), (nodes,) = kinds["Deployment"], kinds["StatefulSet"]
    assert api["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert nodes["metadata"]["name"] == "sphereface-redis-cluster"
    assert "REDIS_URL" not in named(objects, "ConfigMap", "sphereface-config")["data"]


def cluster_nodes_of(objects: list[dict]) -> list[str]:
    """HOST:PORT of every node of the rendered StatefulSet, by its headless Service's DNS names."""
    (nodes,) = by_kind(objects)["StatefulSet"]
    name, service = nodes["metadata"]["name"], nodes["spec"]["serviceName"]
    return [f"{name}-{index}.{service}:6379" for index in range(nodes["spec"]["replicas"])]


def test_the_api_and_the_job_get_every_node_in_sphereface_redis_cluster_and_no_redis_url():
    objects = render(CLUSTER_OVERLAY)
    (api,) = by_kind(objects)["Deployment"]
    (container,) = api["spec"]["template"]["spec"]["containers"]
    (source,) = [s["configMapRef"]["name"] for s in container["envFrom"] if "configMapRef" in s]
    config = named(objects, "ConfigMap", source)["data"]
    assert "REDIS_URL" not in config and "REDIS_URL" not in {e["name"] for e in container.get("env", [])}
    assert config["SPHEREFACE_REDIS_CLUSTER"].split(",") == cluster_nodes_of(objects)
    (job,) = by_kind(objects)["Job"]
    (create,) = job["spec"]["template"]["spec"]["containers"]
    (nodes_env,) = [e for e in create["env"] if e["name"] == "SPHEREFACE_REDIS_CLUSTER"]
    assert nodes_env["valueFrom"]["configMapKeyRef"] == {"name": source, "key": "SPHEREFACE_REDIS_CLUSTER"}


def test_the_job_creates_three_primaries_with_one_replica_each_only_when_no_cluster_exists():
    objects = render(CLUSTER_OVERLAY)
    (job,) = by_kind(objects)["Job"]
    pod = job["spec"]["template"]["spec"]
    (create,) = pod["containers"]
    env = {e["name"]: e.get("value") for e in create["env"]}
    primaries = len(cluster_nodes_of(objects)) // (int(env["CLUSTER_REPLICAS"]) + 1)
    assert (primaries, env["CLUSTER_REPLICAS"]) == (3, "1")
    (mount,) = create["volumeMounts"]
    assert create["command"] == ["sh", f"{mount['mountPath']}/cluster-create.sh"]
    (volume,) = pod["volumes"]
    script = named(objects, "ConfigMap", volume["configMap"]["name"])["data"]["cluster-create.sh"]
    assert script == (REPO_ROOT / CLUSTER_DIR / "cluster-create.sh").read_text()
    # the create runs only after every node was asked whether it is in a cluster already
    guard, create_line = script.index('if is_member "$node"'), script.index("\nredis-cli --cluster create")
    assert 0 < guard < create_line and "cluster_known_nodes" in script and "--cluster-yes" in script
    assert '--cluster-replicas "$replicas"' in script[create_line:]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert create["securityContext"]["readOnlyRootFilesystem"] is True


def test_only_the_api_and_the_job_reach_the_nodes_and_the_nodes_reach_each_other_on_the_bus():
    objects = render(CLUSTER_OVERLAY)
    (policy,) = by_kind(objects)["NetworkPolicy"]
    assert policy["spec"]["podSelector"]["matchLabels"] == NODE_LABEL
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    admitted = {
        (peer["podSelector"]["matchLabels"]["app.kubernetes.io/name"], port["port"])
        for rule in policy["spec"]["ingress"] for peer in rule["from"] for port in rule["ports"]
    }  # fmt: skip
    assert admitted == {
        ("sphereface-api", 6379), ("sphereface-redis-cluster-create", 6379),
        ("sphereface-redis-cluster", 6379), ("sphereface-redis-cluster", 16379),
    }  # fmt: skip
    # the labels the policy names are the pods' own
    (api,), (job,), (nodes,) = (by_kind(objects)[kind] for kind in ("Deployment", "Job", "StatefulSet"))
    labels = {
        obj["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/name"] for obj in (api, job, nodes)
    }
    assert labels == {name for name, _ in admitted}
    ports = {p["containerPort"] for p in nodes["spec"]["template"]["spec"]["containers"][0]["ports"]}
    assert ports == {6379, 16379}


def test_compose_cluster_keeps_redis_private_and_runs_the_same_files_as_kubernetes():
    docker = REPO_ROOT / "docker"
    compose = yaml.safe_load((docker / "compose.cluster.yaml").read_text())
    services = compose["services"]
    api, init = services.pop("api"), services.pop("redis-cluster-init")
    single_api = yaml.safe_load((docker / "compose.yaml").read_text())["services"]["api"]
    differ = {key for key in api.keys() | single_api.keys() if api.get(key) != single_api.get(key)}
    assert differ == {"environment", "depends_on"}  # the same API otherwise
    assert "REDIS_URL" not in api["environment"]
    assert {k: v for k, v in api["environment"].items() if k != "SPHEREFACE_REDIS_CLUSTER"} == {
        k: v for k, v in single_api["environment"].items() if k != "REDIS_URL"
    }
    assert api["depends_on"] == {"redis-cluster-init": {"condition": "service_completed_successfully"}}
    nodes = api["environment"]["SPHEREFACE_REDIS_CLUSTER"].split(",")
    assert nodes == [f"{name}:6379" for name in sorted(services)] and len(nodes) == 6
    k8s_files = REPO_ROOT / CLUSTER_DIR
    for name, node in services.items():
        assert "ports" not in node and node["image"] == "redis:8.0"
        mounts = dict(volume.rsplit(":", 2)[:2] for volume in node["volumes"] if volume.endswith(":ro"))
        ((source, target),) = mounts.items()
        assert (docker / source).resolve() == k8s_files / "node.conf"
        command = node["command"]
        assert command[:2] == ["redis-server", target] and command[command.index("--dir") + 1] == "/data"
        assert command[command.index("--cluster-announce-hostname") + 1] == name
        assert f"{node['volumes'][0].split(':')[0]}" in compose["volumes"]
    assert "ports" not in init and init["restart"] == "no"
    assert init["environment"]["SPHEREFACE_REDIS_CLUSTER"] == api["environment"]["SPHEREFACE_REDIS_CLUSTER"]
    assert init["environment"]["CLUSTER_REPLICAS"] == "1"
    assert init["depends_on"] == {name: {"condition": "service_healthy"} for name in services}
    (volume,) = init["volumes"]
    source, target, _ = volume.split(":")
    assert (docker / source).resolve() == k8s_files / "cluster-create.sh"
    assert init["command"] == ["sh", target]


# -- cluster-create.sh itself, against 6 cluster-enabled redis-server processes on loopback --


def redis_cli() -> str:
    found = shutil.which("redis-cli")
    if found is None:
        fail_or_skip("redis-cli not installed (make install runs apt-get install redis-server)")
    return found


def run_create_script(nodes: list[str], wait_seconds: int = 20) -> subprocess.CompletedProcess:
    """The rendered Job's script, run with ``sh`` as the Job runs it."""
    (config,) = [c for c in by_kind(render(CLUSTER_OVERLAY))["ConfigMap"] if "cluster-create.sh" in c["data"]]
    env = {**os.environ, "SPHEREFACE_REDIS_CLUSTER": ",".join(nodes), "CLUSTER_REPLICAS": "1",
           "CLUSTER_WAIT_SECONDS": str(wait_seconds)}  # fmt: skip
    return subprocess.run(
        ["sh", "-c", config["data"]["cluster-create.sh"]], env=env, capture_output=True, text=True, timeout=90
    )


@pytest.fixture
def six_cluster_nodes(redis_binary, workdir):
    """6 redis-servers started with the rendered node.conf, each announcing the name localhost;
    yields their ``localhost:PORT``; every process is stopped afterwards."""
    redis_cli()
    (config,) = [c for c in by_kind(render(CLUSTER_OVERLAY))["ConfigMap"] if "node.conf" in c["data"]]
    conf = workdir / "node.conf"
    conf.write_text(config["data"]["node.conf"])
    processes, nodes = [], []
    try:
        for index in range(6):
            port, data = free_port(), workdir / f"node-{index}"
            data.mkdir()
            processes.append(subprocess.Popen(
                [redis_binary, str(conf), "--dir", str(data), "--port", str(port), "--bind", "127.0.0.1 -::1",
                 "--cluster-port", str(free_port()), "--cluster-announce-hostname", "localhost"],
                stdout=(data / "log").open("w"), stderr=subprocess.STDOUT,
            ))  # fmt: skip
            nodes.append(f"localhost:{port}")
        for process, node in zip(processes, nodes, strict=True):
            wait_for_ping(process, node)
        yield nodes
    finally:
        for process in processes:
            process.terminate()
        for process in processes:
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def wait_for_ping(process: subprocess.Popen, node: str) -> None:
    deadline = time.monotonic() + 10
    while cli(node, "ping") != "PONG":
        assert process.poll() is None, f"redis-server for {node} exited with {process.returncode}"
        assert time.monotonic() < deadline, f"{node} does not answer"
        time.sleep(0.05)


def cli(node: str, *args: str) -> str:
    host, port = node.rsplit(":", 1)
    out = subprocess.run([redis_cli(), "-h", host, "-p", port, *args], capture_output=True, text=True)
    return out.stdout.strip()


def cluster_view(node: str) -> tuple[dict[str, str], list[tuple]]:
    """The node's CLUSTER INFO (less its message counters) and, from CLUSTER NODES, (id, role,
    primary id, slots, config epoch, link) per node."""
    lines = cli(node, "cluster", "info").splitlines()
    info = dict(line.split(":", 1) for line in lines if ":" in line and "_messages_" not in line)
    rows = []
    for line in cli(node, "cluster", "nodes").splitlines():
        node_id, _, flags, primary, _, _, epoch, link, *slots = line.split()
        role = "primary" if "master" in flags.split(",") else "replica"
        rows.append((node_id, role, primary, tuple(slots), epoch, link))
    return info, sorted(rows)


def primaries_and_replicas(rows: list[tuple]) -> tuple[dict[str, tuple], list[str]]:
    """{primary id: its slots} and the primary id of every replica."""
    primaries = {row[0]: row[3] for row in rows if row[1] == "primary"}
    return primaries, [row[2] for row in rows if row[1] == "replica"]


def settled_views(nodes: list[str], timeout: float = 15) -> list[tuple]:
    """Every node's view once all of them see 3 primaries and 3 replicas (the roles that
    redis-cli sets reach the other nodes by gossip, within seconds)."""
    deadline = time.monotonic() + timeout
    while True:
        views = [cluster_view(node) for node in nodes]
        if all(len(primaries_and_replicas(rows)[1]) == 3 for _, rows in views):
            return views
        assert time.monotonic() < deadline, views
        time.sleep(0.1)


def slot_count(ranges: tuple[str, ...]) -> int:
    bounds = [r.split("-") if "-" in r else (r, r) for r in ranges]
    return sum(int(end) - int(start) + 1 for start, end in bounds)


def test_the_create_script_makes_three_primaries_with_a_replica_each_and_then_changes_nothing(
    six_cluster_nodes,
):
    nodes = six_cluster_nodes
    first = run_create_script(nodes)
    assert first.returncode == 0, first.stdout + first.stderr
    views = settled_views(nodes)
    for info, rows in views:
        assert info["cluster_state"] == "ok" and info["cluster_known_nodes"] == "6"
        assert info["cluster_slots_assigned"] == "16384" and info["cluster_size"] == "3"
        assert all(row[-1] == "connected" for row in rows) and rows == views[0][1]
    primaries, replicas_of = primaries_and_replicas(views[0][1])
    assert len(primaries) == 3 and sorted(replicas_of) == sorted(primaries)  # one replica each
    assert sum(slot_count(slots) for slots in primaries.values()) == 16384

    second = run_create_script(nodes)
    assert second.returncode == 0, second.stdout + second.stderr
    assert "nothing to create" in second.stdout and "Performing hash slots allocation" not in second.stdout
    assert [cluster_view(node) for node in nodes] == views  # same ids, roles, slots and epochs

    # clients are sent to the announced name, and the keys spread over the 3 primaries
    import redis
    from redis.cluster import RedisCluster

    host, port = nodes[0].rsplit(":", 1)
    connection = redis.Connection(host=host, port=int(port))
    try:
        connection.send_command("CLUSTER", "SLOTS")
        ranges = connection.read_response()
    finally:
        connection.disconnect()
    assert {endpoint[0] for entry in ranges for endpoint in entry[2:]} == {b"localhost"} and len(ranges) == 3
    client = RedisCluster(host=host, port=int(port))
    try:
        for index in range(60):
            client.set(f"probe:{index}", index)
        sizes = [node.redis_connection.dbsize() for node in client.get_primaries()]
    finally:
        client.close()
    assert len(sizes) == 3 and min(sizes) > 0 and sum(sizes) == 60


def test_the_create_script_gives_up_on_a_node_that_does_not_answer():
    redis_cli()
    started = time.monotonic()
    result = run_create_script([f"127.0.0.1:{free_port()}"], wait_seconds=1)
    assert result.returncode == 1 and "does not answer PING" in result.stderr
    assert time.monotonic() - started < 10
