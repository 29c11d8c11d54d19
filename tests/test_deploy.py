"""The deployment files: every kustomize overlay renders and validates against the Kubernetes API's
schemas (kubernetes-validate, offline, strict), the compose files validate against the Compose
schema (from the docker-compose wheel that `make install` fetches), they keep the promises of
docs/guides/deploy.md (non-root, read-only root file system, probes, Redis reached only by the API,
AOF, ports on 127.0.0.1), and the serving image's dependencies hold no torch. The training Job
names configs that load and paths on its volume, and its own command line trains on two nodes
on loopback and resumes exactly after one of them is killed.

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
