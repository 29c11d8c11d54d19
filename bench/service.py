"""Service benchmark on CPU: /v1/verify latency, identification search latency, bulk enrollment.

(1) ``POST /v1/verify`` through the real FastAPI app, in process (``fastapi.testclient``:
    multipart encoding, decoding, detection, alignment, embedding, JSON answer), ONNX Runtime with
    ``--threads`` intra-op threads, against a hand-rolled baseline of what people do today: PIL
    decodes both photos, facenet-pytorch 2.6.0's own MTCNN code finds the largest face
    (``detect(..., landmarks=True)``), our ``models.align.align_faces`` aligns it (the same
    5-point similarity transform for both sides), PyTorch eager runs the same network (the
    MobileFaceNet checkpoint, or dlib's ResNet rebuilt from dlib's file for ``--model
    models/dlib_resnet_v1``) on the crop and its mirror (``torch.inference_mode``, fused like our
    embedder, L2-normalised), and the cosine of the two is the score. Same detector settings
    (min face, thresholds, pyramid factor) as the app's pipeline, same thread count. Pairs of real
    photos (genuine and impostor, ``photos/people``), interleaved rounds; median / p90 / mean per
    call, the ratio baseline / ours, the score difference and the decisions of both.
(2) Identification search: seeded random unit vectors (512-d, 1 to 5 faces per subject) at each
    of ``--sizes``; 50 random queries and 50 noisy copies of stored vectors (their subject is the
    right answer); top-5 subjects. In-process numpy (``service.gallery.index.VectorIndex``) and the
    Redis Query Engine FLAT index (``service.gallery.redis_search.RedisKnnSearch``, Redis Stack
    started by ``service.redis_server.start_redis_stack``), both checked against a brute-force
    ground truth computed here. Per-query latency (median, p90), build / load time, memory.
(3) Bulk enrollment: ``POST /v1/enroll`` with requests of ``--enroll-batch`` real photos from
    ``celeba_faces`` (a new subject per identity), through the in-process app on a local
    redis-server configured as ``sphereface serve`` runs it (AOF, ``appendfsync always``):
    faces per second and where the time goes.

Usage::

    .venv/bin/python bench/service.py --json docs/results/bench_service.json
    .venv/bin/python bench/service.py --quick          # a smoke run: 10k vectors, fewer repetitions
"""

from __future__ import annotations

import argparse
import functools
import gc
import io
import json
import os
import platform
import shutil
import sys
import tempfile
import threading
import time
import traceback
from collections import defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
# Run as ``python bench/service.py``, this file's folder comes first on sys.path, and this file
# would shadow the ``service`` package: put the repository first instead.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]
sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402
import onnxruntime as ort  # noqa: E402
import torch  # noqa: E402

from bench import gallery_data  # noqa: E402
from bench.baselines import (  # noqa: E402
    HandRolledVerifier,
    ensure_model,
    load_torch_baseline,
    torch_baseline_name,
)
from bench.face_path_report import json_default  # noqa: E402
from bench.face_path_settings import DEFAULT_MODEL  # noqa: E402
from bench.facenet_env import (  # noqa: E402
    DEFAULT_ENV,
    DEFAULT_WHEEL,
    FNP_VERSION,
    TORCHVISION_PYTHON,
    load_facenet,
    prepare_facenet_env,
)
from bench.paths import SHARED_DATA  # noqa: E402
from bench.timing import Contender, latency_summary, log, run_interleaved  # noqa: E402
from models.align import align_faces  # noqa: E402

DEFAULT_SIZES = (10_000, 100_000, 1_000_000)
QUICK_SIZES = (10_000,)
DIM = 512
TOP_K = 5
RANDOM_QUERIES = gallery_data.RANDOM_QUERIES
NOISY_QUERIES = gallery_data.NOISY_QUERIES
NOISE = gallery_data.NOISE
synthetic_gallery = gallery_data.synthetic_gallery
make_queries = gallery_data.make_queries
exact_top_subjects = gallery_data.exact_top_subjects
LOAD_BATCH = 1000
SEARCH_MODEL_ID = "bench-synthetic-512"
GOAL_VERIFY_SPEEDUP = 2.0
GOAL_SEARCH_SIZE = 1_000_000
GOAL_SEARCH_MS = 50.0
REDIS_STACK_CACHE = REPO / ".cache" / "redis-stack"


# --------------------------------------------------------------------------------------------
# Small helpers


def rss_bytes() -> int:
    """Resident set size of this process (from /proc/self/status)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


class CpuWatch:
    """CPU time used on the machine by processes other than this one and its reaped children.

    Other work on a 2-core machine (tests of other sessions, say) slows every number; this says
    how much there was: core-seconds used by others over the wall time of a part.
    """

    def __init__(self) -> None:
        self.wall0 = time.perf_counter()
        self.busy0 = self._busy()
        self.own0 = self._own()

    @staticmethod
    def _busy() -> float:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
        return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")

    @staticmethod
    def _own() -> float:
        t = os.times()
        return t.user + t.system + t.children_user + t.children_system

    def result(self) -> dict[str, float]:
        wall = time.perf_counter() - self.wall0
        others = max(0.0, (self._busy() - self.busy0) - (self._own() - self.own0))
        return {"wall_s": wall, "other_processes_cpu_s": others, "other_processes_cores": others / wall}


def md_table(headers: list[str], rows: list[list[str]]) -> str:
    """A Markdown table; the first column left-aligned, the others right-aligned."""
    lines = ["| " + " | ".join(headers) + " |"]
    lines.append("|" + "|".join(":---" if i == 0 else "---:" for i in range(len(headers))) + "|")
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def _met(ok: bool | None) -> str:
    return "n/a" if ok is None else ("met" if ok else "NOT met")


def _fmt(value: Any, spec: str = ".1f") -> str:
    try:
        return format(float(value), spec)
    except (TypeError, ValueError):
        return "n/a"


def redis_server_info(client) -> dict[str, Any]:
    info = client.info("server")
    out = {"redis_version": info.get("redis_version"), "executable": info.get("executable")}
    try:
        out["modules"] = {
            m[b"name"].decode() if isinstance(m[b"name"], bytes) else m[b"name"]: m[b"ver"]
            for m in client.module_list()
        }
    except Exception:  # a server without MODULE LIST rights or support
        out["modules"] = {}
    return out


class StageTimer:
    """Wraps functions and methods to add up the time spent in named stages (outermost call only).

    Calls from several threads at once (``/v1/verify`` detects its two photos side by side) each
    add their own time, so a stage's seconds are added up over threads and can exceed wall time;
    ``busy_seconds`` is the wall time during which any thread was in a timed stage.
    """

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.busy_seconds = 0.0
        self._local = threading.local()  # per thread: how deep in timed stages it is
        self._lock = threading.Lock()
        self._inside = 0  # threads in a timed stage now
        self._busy_since = 0.0
        self._undo: list[Callable[[], None]] = []

    def _enter(self) -> float:
        now = time.perf_counter()
        with self._lock:
            if self._inside == 0:
                self._busy_since = now
            self._inside += 1
        return now

    def _leave(self, stage: str, t0: float) -> None:
        now = time.perf_counter()
        with self._lock:
            self.seconds[stage] += now - t0
            self.calls[stage] += 1
            self._inside -= 1
            if self._inside == 0:
                self.busy_seconds += now - self._busy_since

    def _wrap(self, stage: str, fn: Callable) -> Callable:
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            depth = getattr(self._local, "depth", 0)
            if depth:  # inside another timed stage of this thread: counted there
                return fn(*args, **kwargs)
            self._local.depth = 1
            t0 = self._enter()
            try:
                return fn(*args, **kwargs)
            finally:
                self._local.depth = 0
                self._leave(stage, t0)

        return timed

    def patch(self, owner: Any, attr: str, stage: str) -> None:
        original = getattr(owner, attr)
        own = attr in getattr(owner, "__dict__", {})
        setattr(owner, attr, self._wrap(stage, original))
        self._undo.append(lambda: setattr(owner, attr, original) if own else delattr(owner, attr))

    def patch_everywhere(self, function: Callable, stage: str, prefixes: Sequence[str]) -> list[str]:
        """Patch every loaded module under ``prefixes`` that imported ``function`` by name."""
        patched = []
        for name, module in list(sys.modules.items()):
            if module is None or not name.startswith(tuple(prefixes)):
                continue
            if getattr(module, function.__name__, None) is function:
                self.patch(module, function.__name__, stage)
                patched.append(name)
        return patched

    def restore(self) -> None:
        while self._undo:
            self._undo.pop()()

    def reset(self) -> None:
        self.seconds.clear()
        self.calls.clear()
        self.busy_seconds = 0.0


def instrument_app(app, timer: StageTimer) -> None:
    """Time decode / detect / align / embed inside the app (its pipeline and route modules)."""
    from models.image import decode_image

    pipeline = app.state.pipeline
    for attr in ("detect", "detect_batch", "detect_largest"):
        if hasattr(pipeline.detector, attr):
            timer.patch(pipeline.detector, attr, "detect")
    for attr in ("embed", "raw"):
        if hasattr(pipeline.embedder, attr):
            timer.patch(pipeline.embedder, attr, "embed")
    timer.patch_everywhere(decode_image, "decode", ("service.", "models.pipeline"))
    timer.patch_everywhere(align_faces, "align", ("service.", "models.pipeline"))


def scrape_metrics(client) -> dict[str, float] | None:
    """``/metrics`` as ``{sample name + labels: value}``, or None when the app has none."""
    response = client.get("/metrics")
    if response.status_code != 200:
        return None
    from prometheus_client.parser import text_string_to_metric_families

    samples = {}
    for family in text_string_to_metric_families(response.text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            samples[f"{s.name}{{{labels}}}"] = s.value
    return samples


def metrics_stage_delta(before: dict | None, after: dict | None) -> dict[str, dict[str, float]]:
    """Per stage of ``sphereface_stage_duration_seconds``: seconds and count added in between."""
    if not before or not after:
        return {}
    out: dict[str, dict[str, float]] = {}
    prefix = "sphereface_stage_duration_seconds_"
    for key, value in after.items():
        for part in ("sum", "count"):
            head = f"{prefix}{part}{{stage="
            if key.startswith(head):
                stage = key[len(head) : -1]
                delta = value - before.get(key, 0.0)
                out.setdefault(stage, {})["seconds" if part == "sum" else "count"] = delta
    return {k: v for k, v in out.items() if v.get("count", 0) > 0}


def metrics_request_delta(before: dict | None, after: dict | None, route: str) -> dict[str, float] | None:
    if not before or not after:
        return None
    found = {}
    for part in ("sum", "count"):
        for key, value in after.items():
            if key.startswith(f"sphereface_request_duration_seconds_{part}{{") and f"route={route}" in key:
                found[part] = value - before.get(key, 0.0)
    if found.get("count"):
        return {"seconds": found["sum"], "count": found["count"]}
    return None


# --------------------------------------------------------------------------------------------
# Environment


def machine_info(threads: int) -> dict[str, Any]:
    cpu = "unknown"
    flags: list[str] = []
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name") and cpu == "unknown":
            cpu = line.split(":", 1)[1].strip()
        if line.startswith("flags") and not flags:
            have = set(line.split(":", 1)[1].split())
            flags = [f for f in ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16") if f in have]
    mem = 0
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            mem = int(line.split()[1]) * 1024
    import fastapi
    import redis

    return {
        "cpu_model": cpu,
        "cpu_flags": flags,
        "logical_cpus": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)),
        "memory_gib": mem / 2**30,
        "threads": threads,
        "torch_num_threads": threads,
        "ort_intra_op_threads": threads,
        "numpy_blas_threads_env": {
            k: os.environ[k]
            for k in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")
            if k in os.environ
        },
        "python": platform.python_version(),
        "platform": platform.platform(),
        "numpy": np.__version__,
        "onnxruntime": ort.__version__,
        "torch": torch.__version__,
        "redis_py": redis.__version__,
        "fastapi": fastapi.__version__,
        "facenet_pytorch": FNP_VERSION,
        "loadavg_start": list(os.getloadavg()),
    }


# --------------------------------------------------------------------------------------------
# (1) /v1/verify


def verify_pairs(people: Path, count: int) -> list[dict[str, Any]]:
    """Genuine pairs (two photos of one person) and as many impostor pairs, alternating."""
    persons = {d.name: sorted(d.glob("*.jpg")) for d in sorted(people.iterdir()) if d.is_dir()}
    persons = {k: v for k, v in persons.items() if v}
    genuine, impostor = [], []
    for files in persons.values():
        for i in range(len(files)):
            for j in range(i + 1, len(files)):
                genuine.append((files[i], files[j]))
    names = list(persons)
    for i, a in enumerate(names):
        b = names[(i + 1) % len(names)]
        impostor.append((persons[a][0], persons[b][-1]))
        impostor.append((persons[a][-1], persons[names[(i + 3) % len(names)]][0]))
    g = [(p, True) for p in genuine[: max(1, count // 2)]]
    im = [(p, False) for p in impostor[: count - len(g)]]
    order = []
    for k in range(max(len(g), len(im))):
        order += g[k : k + 1] + im[k : k + 1]
    return [
        {
            "photo1": str(a.relative_to(people)),
            "photo2": str(b.relative_to(people)),
            "genuine": same,
            "bytes1": a.read_bytes(),
            "bytes2": b.read_bytes(),
        }
        for (a, b), same in order
    ]


def verify_poster(client) -> Callable[[dict[str, Any]], dict[str, Any]]:
    def post(pair: dict[str, Any]) -> dict[str, Any]:
        r = client.post(
            "/v1/verify",
            files={
                "photo1": (Path(pair["photo1"]).name, pair["bytes1"], "image/jpeg"),
                "photo2": (Path(pair["photo2"]).name, pair["bytes2"], "image/jpeg"),
            },
        )
        if r.status_code != 200:
            raise RuntimeError(f"/v1/verify answered {r.status_code}: {r.text[:300]}")
        return r.json()

    return post


def split_pass_app(app, post: Callable, pairs: list[dict[str, Any]]) -> dict[str, float]:
    """One pass over the pairs with decode / detect / align / embed timed: ms per call, each stage
    added up over the threads that ran it; ``other`` is the wall time in no stage."""
    timer = StageTimer()
    instrument_app(app, timer)
    try:
        t0 = time.perf_counter()
        for pair in pairs:
            post(pair)
        wall = time.perf_counter() - t0
    finally:
        timer.restore()
    n = len(pairs)
    stages = {k: timer.seconds.get(k, 0.0) / n * 1e3 for k in ("decode", "detect", "align", "embed")}
    stages["other"] = (wall - timer.busy_seconds) / n * 1e3
    stages["total"] = wall / n * 1e3
    return stages


class ServedOverSocket:
    """``sphereface serve`` in a child process on a local port (uvicorn, as users run it), and a
    client that posts multipart bodies encoded once per pair over one keep-alive connection: the
    latency a client on the same machine sees, without the in-process TestClient's own work."""

    def __init__(self, model: Path, redis_url: str, data_dir: Path, threads: int, ready_s: float = 180.0):
        import http.client

        from service.serve_process import Service

        self.service = Service(
            model,
            data_dir,
            redis_url,
            extra_env={"SPHEREFACE_AUTH": "off", "SPHEREFACE_INTRA_OP_THREADS": str(threads)},
            options=("--host", "127.0.0.1", "--workers", "1"),
            log=data_dir / "serve.log",  # its access log, kept out of the report
            ready_s=ready_s,
        )
        self._connection = http.client.HTTPConnection("127.0.0.1", self.service.port, timeout=60)
        self._bodies: dict[int, tuple[bytes, str]] = {}

    def _request(self, method: str, path: str, body: bytes | None, headers: dict) -> tuple[int, bytes]:
        self._connection.request(method, path, body=body, headers=headers)
        response = self._connection.getresponse()
        return response.status, response.read()

    def _body(self, pair: dict[str, Any]) -> tuple[bytes, str]:
        key = id(pair)
        if key not in self._bodies:
            boundary = f"bench{key:x}"
            parts = []
            for field in ("photo1", "photo2"):
                head = (
                    f'--{boundary}\r\nContent-Disposition: form-data; name="{field}"; '
                    f'filename="{Path(pair[field]).name}"\r\nContent-Type: image/jpeg\r\n\r\n'
                )
                parts.append(head.encode() + pair["bytes" + field[-1]] + b"\r\n")
            parts.append(f"--{boundary}--\r\n".encode())
            self._bodies[key] = (b"".join(parts), f"multipart/form-data; boundary={boundary}")
        return self._bodies[key]

    def __call__(self, pair: dict[str, Any]) -> dict[str, Any]:
        body, content_type = self._body(pair)
        status, answer = self._request("POST", "/v1/verify", body, {"Content-Type": content_type})
        if status != 200:
            raise RuntimeError(f"/v1/verify over the socket answered {status}: {answer[:300]!r}")
        return json.loads(answer)

    def close(self) -> None:
        self._connection.close()
        self.service.stop()


VERIFY_NAMES = {
    "ours": "ours (POST /v1/verify, ORT {t} threads)",
    "ours_socket": "ours, sphereface serve over a local socket (uvicorn)",
    "ours_fullres": "ours, detection at full resolution (diagnostic)",
    "ours_full_scan": "ours, every face detected, then the largest (diagnostic)",
    "baseline": "baseline (facenet-pytorch + torch eager, {t} threads)",
    "baseline_1t": "baseline, torch 1 thread (diagnostic)",
}
OURS = ("ours", "ours_socket", "ours_fullres", "ours_full_scan")
BASELINES = ("baseline", "baseline_1t")


def _real_nms(verifiers, baselines, standin, pairs, args) -> dict[str, dict[str, Any]]:
    """Per baseline variant, torchvision's own time for the NMS calls of each verify call: one more
    pass records the stand-in's calls, the real torchvision times them in its own environment
    (``bench/torchvision_nms.py``). Empty without that environment (``make torchvision-env``)."""
    from bench.torchvision_nms import real_nms_per_item, record_per_item

    if not args.torchvision_python.is_file():
        log(
            f"  no torchvision environment at {args.torchvision_python} (make torchvision-env): "
            "NMS bounds only"
        )
        return {}
    measured = {}
    for name, verifier in verifiers.items():
        torch.set_num_threads(baselines[name])
        groups = record_per_item(standin, verifier, pairs)
        measured[name] = real_nms_per_item(groups, baselines[name], args.torchvision_python)
    torch.set_num_threads(args.threads)
    return measured


def bench_verify(args: argparse.Namespace) -> dict[str, Any]:
    from fastapi.testclient import TestClient

    from service.app import create_app
    from service.settings import Settings

    fnp_env = prepare_facenet_env(args.fnp_wheel, args.fnp_env)
    mtcnn_cls, standin = load_facenet(args.fnp_env)
    imported = ensure_model(args.model, args.checkpoint)
    net = load_torch_baseline(args.model, args.checkpoint)
    pairs = verify_pairs(args.data / "photos" / "people", args.verify_pairs)
    n = len(pairs)
    log(f"(1) verify: {n} pairs of photos/people")

    from service.redis_server import LocalRedis

    tmp = Path(tempfile.mkdtemp(prefix="sf-bench-verify-"))
    redis_server = LocalRedis(tmp / "redis", appendfsync="no").start()  # the gallery is not used
    stages: dict[str, dict[str, float]] = {}
    try:
        settings = Settings(
            model_dir=args.model,
            auth="off",
            redis_url=redis_server.url,
            intra_op_threads=args.threads,
            data_dir=tmp,
        )
        app = create_app(settings)
        apps = {"ours": app}
        if args.diagnostics:
            apps["ours_fullres"] = create_app(settings.model_copy(update={"detect_max_side": None}))
            apps["ours_full_scan"] = create_app(settings.model_copy(update={"largest_face_search": "full"}))
        clients = {name: TestClient(a) for name, a in apps.items()}
        served = None
        for c in clients.values():
            c.__enter__()
        try:
            pipeline = app.state.pipeline
            det = pipeline.detector
            detector_settings = {
                "min_face_size": det.min_face_size,
                "thresholds": list(det.thresholds),
                "factor": det.scale_factor,
                "face_choice": "largest (both)",
            }
            posters = {name: verify_poster(c) for name, c in clients.items()}
            contenders = {name: Contender(p) for name, p in posters.items()}
            served = ServedOverSocket(args.model, redis_server.url, tmp / "served", args.threads)
            contenders["ours_socket"] = Contender(served)
            baselines = {"baseline": args.threads}
            if args.diagnostics and args.threads != 1:
                baselines["baseline_1t"] = 1
            verifiers = {}
            for name, threads in baselines.items():
                verifiers[name] = HandRolledVerifier(
                    mtcnn_cls, standin, net, pipeline.manifest, detector_settings
                )
                contenders[name] = Contender(verifiers[name], torch_threads=threads)
            warmup = min(3, n)
            seconds, outputs = run_interleaved(
                contenders, pairs, args.verify_repeats, warmup, "verify", args.time_budget
            )
            passes = seconds["ours"].shape[0]
            # The stand-in NMS is pure torch (torchvision's is C++): the conservative ratios
            # count the baseline's NMS time as free.
            nms = {
                name: np.asarray(v.nms_seconds[warmup : warmup + passes * n]).reshape(passes, n)
                for name, v in verifiers.items()
            }
            real_nms = _real_nms(verifiers, baselines, standin, pairs, args)
            # One more pass each, not interleaved, with the stages timed (for "where the time goes").
            before = scrape_metrics(clients["ours"])
            for name, a in apps.items():
                stages[name] = split_pass_app(a, posters[name], pairs)
            after = scrape_metrics(clients["ours"])
            for name, v in verifiers.items():
                v.stages.clear()
                torch.set_num_threads(baselines[name])
                t0 = time.perf_counter()
                for pair in pairs:
                    v(pair)
                wall = time.perf_counter() - t0
                st = {k: v.stages.get(k, 0.0) / n * 1e3 for k in ("decode", "detect", "align", "embed")}
                st["other"] = wall / n * 1e3 - sum(st.values())
                st["total"] = wall / n * 1e3
                stages[name] = st
            torch.set_num_threads(args.threads)
            threshold = pipeline.manifest.thresholds.get("verification")
            model_id = pipeline.manifest.model_id
        finally:
            for c in clients.values():
                c.__exit__(None, None, None)
            if served is not None:
                served.close()
    finally:
        redis_server.stop()
        shutil.rmtree(tmp, ignore_errors=True)

    per_pair = []
    t = threshold.value if threshold else None
    for k, pair in enumerate(pairs):
        o = outputs["ours"][k]
        b = outputs["baseline"][k]
        per_pair.append(
            {
                "photo1": pair["photo1"],
                "photo2": pair["photo2"],
                "genuine": pair["genuine"],
                "score_ours": o["score"],
                "score_baseline": b,
                "score_diff": b - o["score"],
                "same_person_ours": o["same_person"],
                "same_person_baseline": None if t is None else b >= t,
                "median_ms": {name: float(np.median(s[:, k]) * 1e3) for name, s in seconds.items()},
            }
        )

    def score(name: str, k: int) -> float:
        out = outputs[name][k]
        return float(out["score"] if isinstance(out, dict) else out)

    variant_diff = {  # a diagnostic variant against the configuration it varies
        name: max(abs(score(name, k) - score("ours" if name in OURS else "baseline", k)) for k in range(n))
        for name in seconds
        if name not in ("ours", "baseline")
    }
    diffs = np.abs([p["score_diff"] for p in per_pair])
    timing = {name: latency_summary(s) for name, s in seconds.items()}
    timing.update({f"{b}_nms_free": latency_summary(seconds[b] - nms[b]) for b in nms})
    for b, real in real_nms.items():
        timing[f"{b}_tvnms"] = latency_summary(
            seconds[b] - nms[b] + np.asarray(real["per_item_seconds"])[None]
        )
    ratios = {}  # ratios[ours variant][baseline variant] = {median, p90, mean}
    for o in (x for x in OURS if x in timing):
        ratios[o] = {
            b: {q: timing[b][f"{q}_ms"] / timing[o][f"{q}_ms"] for q in ("median", "p90", "mean")}
            for b in timing
            if b.startswith("baseline")
        }
    r = ratios["ours"]
    if "baseline_tvnms" in r:  # the baseline with torchvision's own NMS, measured
        conservative = min(r["baseline_tvnms"]["median"], r["baseline_tvnms"]["mean"])
    else:  # bounds: the stand-in's NMS, and none
        conservative = min(
            r["baseline"]["median"],
            r["baseline"]["mean"],
            r["baseline_nms_free"]["median"],
            r["baseline_nms_free"]["mean"],
        )
    return {
        "model_dir": str(args.model),
        "model_id": model_id,
        "baseline_network": torch_baseline_name(args.model),
        "model_imported_now": imported,
        "threads": args.threads,
        "threshold": t,
        "pairs": n,
        "genuine_pairs": int(sum(p["genuine"] for p in pairs)),
        "passes": passes,
        "detector_settings": detector_settings,
        "facenet_pytorch": fnp_env,
        "contenders": {k: VERIFY_NAMES[k].format(t=args.threads) for k in seconds},
        "timing": timing,
        "ratios": ratios,
        "ratio_baseline_over_ours": r["baseline"],
        "baseline_standin_nms_ms_per_call": {b: latency_summary(x) for b, x in nms.items()},
        "baseline_torchvision_nms": {
            b: {k: v for k, v in real.items() if k != "per_item_seconds"} for b, real in real_nms.items()
        },
        "ratio_conservative": conservative,
        "goal_speedup": GOAL_VERIFY_SPEEDUP,
        "goal_met": conservative >= GOAL_VERIFY_SPEEDUP,
        "agreement": {
            "max_abs_score_diff": float(diffs.max()),
            "mean_abs_score_diff": float(diffs.mean()),
            "same_decision": int(sum(p["same_person_ours"] == p["same_person_baseline"] for p in per_pair)),
            "decisions_right_ours": int(sum(p["same_person_ours"] == p["genuine"] for p in per_pair)),
            "decisions_right_baseline": int(sum(p["same_person_baseline"] == p["genuine"] for p in per_pair)),
            "max_abs_score_diff_of_variants": variant_diff,
        },
        "stages_ms_per_call": stages,
        "metrics_stages_during_split_pass": metrics_stage_delta(before, after),
        "per_pair": per_pair,
        "photo_sizes": [list(_jpeg_size(p["bytes1"])) + list(_jpeg_size(p["bytes2"])) for p in pairs],
    }


def _jpeg_size(data: bytes) -> tuple[int, int]:
    from PIL import Image

    with Image.open(io.BytesIO(data)) as im:
        return im.size


# --------------------------------------------------------------------------------------------
# (2) search


def subject_name(code: int) -> str:
    return f"s{code:07d}"


def check_results(
    results: list[list[Any]], gt_codes: np.ndarray, gt_scores: np.ndarray, planted: np.ndarray, k: int
) -> dict[str, Any]:
    """Agreement of one path's answers with the brute-force truth and the planted subjects."""
    identical = 0
    overlap = []
    diffs = []
    top1_planted = []
    for q, hits in enumerate(results):
        got = [h.subject_id for h in hits]
        want = [subject_name(int(c)) for c in gt_codes[q]]
        identical += got == want
        overlap.append(len(set(got) & set(want)) / k)
        want_score = dict(zip(want, gt_scores[q].tolist(), strict=True))
        diffs += [abs(h.score - want_score[h.subject_id]) for h in hits if h.subject_id in want_score]
        if planted[q] >= 0:
            top1_planted.append(bool(hits) and hits[0].subject_id == subject_name(int(planted[q])))
    return {
        "queries": len(results),
        "topk_identical_to_brute_force": int(identical),
        "recall_at_k_vs_brute_force": float(np.mean(overlap)),
        "max_abs_score_diff_vs_brute_force": float(max(diffs)) if diffs else None,
        "recall_at_1_planted": float(np.mean(top1_planted)) if top1_planted else None,
        "exact": bool(identical == len(results)),
    }


def redis_wait_idle(client, timeout: float = 1800.0) -> float:
    """Wait until no AOF rewrite is running or scheduled; returns the seconds waited."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout:
        p = client.info("persistence")
        if not p.get("aof_rewrite_in_progress") and not p.get("aof_rewrite_scheduled"):
            break
        time.sleep(0.2)
    return time.perf_counter() - t0


def _text(value: Any) -> Any:
    return value.decode(errors="replace") if isinstance(value, bytes) else value


def _pairs(reply: Any) -> dict[str, Any]:
    """A Redis reply that is a map (RESP3 dict) or a flat key, value list (RESP2) as a dict."""
    if isinstance(reply, dict):
        items = reply.items()
    else:
        items = zip(reply[::2], reply[1::2], strict=False)
    return {str(_text(k)): _text(v) for k, v in items}


def ft_info(client, name: str) -> dict[str, Any]:
    """FT.INFO's scalar fields."""
    info = _pairs(client.execute_command("FT.INFO", name))
    return {k: v for k, v in info.items() if isinstance(v, (str, int, float))}


def load_faces_into_redis(
    client, prefix: str, face_ids: list[str], subjects: list[str], vectors: np.ndarray
) -> float:
    """Write every face as the service's face hash, pipelined HSET in batches; returns seconds."""
    little = vectors.astype("<f4", copy=False)
    created = "2026-01-01T00:00:00.000Z"
    t0 = time.perf_counter()
    for s in range(0, len(face_ids), LOAD_BATCH):
        pipe = client.pipeline(transaction=False)
        for i in range(s, min(len(face_ids), s + LOAD_BATCH)):
            pipe.hset(
                f"{prefix}face:{face_ids[i]}",
                mapping={
                    "subject": subjects[i],
                    "embedding": little[i].tobytes(),
                    "model_id": SEARCH_MODEL_ID,
                    "photo_sha256": f"{i:064x}",
                    "created_at": created,
                },
            )
        pipe.execute()
    return time.perf_counter() - t0


def redis_search_config(client) -> dict[str, Any]:
    """A few Query Engine settings that bear on KNN latency (as FT.CONFIG GET answers them)."""
    out = {}
    for name in ("TIMEOUT", "ON_TIMEOUT", "WORKERS", "MIN_OPERATION_WORKERS"):
        try:
            reply = client.execute_command("FT.CONFIG", "GET", name)
        except Exception:  # an option this version does not know
            continue
        if isinstance(reply, dict):
            values = _pairs(reply)
        else:
            values = {str(_text(r[0])): _text(r[1]) for r in reply or [] if len(r) == 2}
        if name in values:
            out[name] = values[name]
    return out


def bench_search_size(n: int, args: argparse.Namespace, redis_ok: bool, repeats: int) -> dict[str, Any]:
    from service.gallery.index import VectorIndex

    seed = args.seed + n
    t0 = time.perf_counter()
    vectors, codes, starts = synthetic_gallery(n, DIM, seed)
    face_ids = [f"f{i:07d}" for i in range(n)]
    names = [subject_name(c) for c in range(len(starts))]
    subjects = [names[c] for c in codes]
    queries, planted = make_queries(vectors, codes, seed)
    gen_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    gt_codes, gt_scores = exact_top_subjects(vectors, starts, queries, TOP_K)
    gt_s = time.perf_counter() - t0
    gt_planted = float(np.mean(gt_codes[planted >= 0, 0] == planted[planted >= 0]))
    entry: dict[str, Any] = {
        "faces": n,
        "subjects": len(starts),
        "dim": DIM,
        "k": TOP_K,
        "queries": {"random": RANDOM_QUERIES, "noisy_copies": NOISY_QUERIES, "noise": NOISE},
        "generate_s": gen_s,
        "brute_force_s": gt_s,
        "brute_force_recall_at_1_planted": gt_planted,
        "vectors_bytes": int(vectors.nbytes),
    }
    log(f"(2) search at {n} faces, {len(starts)} subjects: data in {gen_s:.1f} s, truth in {gt_s:.1f} s")

    # numpy path
    gc.collect()
    rss0 = rss_bytes()
    t0 = time.perf_counter()
    index = VectorIndex(DIM)
    index.add(face_ids, subjects, vectors)
    build_s = time.perf_counter() - t0
    gc.collect()
    rss1 = rss_bytes()
    entry["numpy"] = {
        "build_s": build_s,
        "build_faces_per_s": n / build_s,
        "rss_growth_bytes": rss1 - rss0,
        "index_nbytes": int(getattr(index, "nbytes", 0)) or None,
        "len": len(index),
    }
    contenders = {"numpy": Contender(lambda q: index.search(q[None], TOP_K)[0])}

    # Redis path
    server = knn = client = None
    data_dir = None
    try:
        if redis_ok:
            from service.gallery.redis_search import RedisKnnSearch
            from service.redis_server import start_redis_stack

            data_dir = Path(tempfile.mkdtemp(prefix="sf-bench-stack-"))
            server = start_redis_stack(data_dir, cache_dir=REDIS_STACK_CACHE, appendfsync=args.appendfsync)
            client = server.client()
            knn = RedisKnnSearch(client, model_id=SEARCH_MODEL_ID, dim=DIM, prefix="sf:")
            knn.ensure_index()
            mem0 = int(client.info("memory")["used_memory"])
            load_s = load_faces_into_redis(client, "sf:", face_ids, subjects, vectors)
            t0 = time.perf_counter()
            knn.ensure_index()  # waits while the engine is still indexing
            index_wait_s = time.perf_counter() - t0
            idle_s = redis_wait_idle(client)
            mem = client.info("memory")
            fi = ft_info(client, knn.index_name)
            entry["redis"] = {
                "server": redis_server_info(client),
                "appendfsync": args.appendfsync,
                "transport": server.url.split(":", 1)[0],
                "load_s": load_s,
                "load_faces_per_s": n / load_s,
                "index_wait_after_load_s": index_wait_s,
                "aof_rewrite_wait_s": idle_s,
                "used_memory_before_bytes": mem0,
                "used_memory_bytes": int(mem["used_memory"]),
                "used_memory_rss_bytes": int(mem.get("used_memory_rss", 0)),
                "ft_info": {
                    k: fi[k]
                    for k in (
                        "num_docs",
                        "vector_index_sz_mb",
                        "total_index_memory_sz_mb",
                        "hash_indexing_failures",
                    )
                    if k in fi
                },
                "search_config": redis_search_config(client),
            }
            if int(fi.get("num_docs", n)) != n:
                log(f"WARNING: the Redis index holds {fi.get('num_docs')} faces, not {n}")
            contenders["redis"] = Contender(lambda q: knn.search(q[None], TOP_K)[0])

        items = list(queries)
        log(f"(2) search at {n}: {len(items)} queries x {len(contenders)} paths, {repeats} passes")
        seconds, outputs = run_interleaved(
            contenders, items, repeats, min(5, len(items)), f"search/{n}", args.time_budget
        )
        for name in contenders:
            entry[name]["latency"] = latency_summary(seconds[name])
            entry[name]["check"] = check_results(outputs[name], gt_codes, gt_scores, planted, TOP_K)
        # All 100 queries in one call (throughput of a batch, per query).
        t0 = time.perf_counter()
        index.search(queries, TOP_K)
        entry["numpy"]["batch_of_100_ms_per_query"] = (time.perf_counter() - t0) / len(queries) * 1e3

    finally:
        if client is not None:
            client.close()
        if server is not None:
            server.stop()
        if data_dir is not None:
            shutil.rmtree(data_dir, ignore_errors=True)
    contenders.clear()
    outputs.clear()
    return entry


def bench_search(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {"sizes": {}}
    redis_ok = True
    try:
        import service.gallery.redis_search  # noqa: F401
        import service.redis_server  # noqa: F401
    except ImportError as exc:
        redis_ok = False
        out["redis_skipped"] = f"not available yet: {exc}"
        log(f"(2) Redis path skipped: {exc}")
    for n in args.sizes:
        out["sizes"][str(n)] = bench_search_size(n, args, redis_ok, args.search_repeats)
    goal = out["sizes"].get(str(GOAL_SEARCH_SIZE))
    out["goal"] = {"size": GOAL_SEARCH_SIZE, "ms": GOAL_SEARCH_MS}
    for path in ("numpy", "redis"):
        if goal and path in goal:
            out["goal"][path] = {
                "median_ms": goal[path]["latency"]["median_ms"],
                "p90_ms": goal[path]["latency"]["p90_ms"],
                "exact": goal[path]["check"]["exact"],
                "met": goal[path]["latency"]["median_ms"] < GOAL_SEARCH_MS and goal[path]["check"]["exact"],
                "met_p90": goal[path]["latency"]["p90_ms"] < GOAL_SEARCH_MS and goal[path]["check"]["exact"],
            }
    return out


# --------------------------------------------------------------------------------------------
# (3) bulk enrollment


def enroll_photo_sets(root: Path, per_identity: int, photos: int, sets: int) -> list[list[tuple[str, Path]]]:
    """``sets`` disjoint lists of ``photos`` (subject id, path), ``per_identity`` photos per identity."""
    identities = [
        d for d in sorted(root.iterdir()) if d.is_dir() and len(list(d.glob("*.jpg"))) >= per_identity
    ]
    per_set = -(-photos // per_identity)
    if len(identities) < per_set * sets:
        raise SystemExit(f"{root} has too few identities with {per_identity}+ photos for {sets} sets")
    out = []
    for s in range(sets):
        items = []
        for d in identities[s * per_set : (s + 1) * per_set]:
            items += [(f"celeba-{d.name}", p) for p in sorted(d.glob("*.jpg"))[:per_identity]]
        out.append(items[:photos])
    return out


def bench_enroll(args: argparse.Namespace) -> dict[str, Any]:
    from fastapi.testclient import TestClient

    from service.app import create_app
    from service.redis_server import LocalRedis
    from service.settings import Settings

    ensure_model(args.model, args.checkpoint)
    passes = args.enroll_passes
    sets = enroll_photo_sets(args.data / "celeba_faces", 5, args.enroll_photos, passes + 1)
    warm_set, timed_sets = sets[-1][:8], sets[:passes]
    data = {p: p.read_bytes() for s in sets for _, p in s}
    tmp = Path(tempfile.mkdtemp(prefix="sf-bench-enroll-"))
    server = LocalRedis(tmp / "redis", appendfsync="always").start()
    result: dict[str, Any] = {
        "photos_per_pass": len(timed_sets[0]),
        "batch": args.enroll_batch,
        "passes": passes,
        "redis": {"url_kind": "unix socket", "appendfsync": "always", "appendonly": "yes"},
    }
    try:
        settings = Settings(
            model_dir=args.model,
            auth="off",
            redis_url=server.url,
            intra_op_threads=args.threads,
            data_dir=tmp,
            max_bulk_items=max(256, args.enroll_batch),
        )
        app = create_app(settings)
        with TestClient(app) as client:
            result["redis"]["server"] = redis_server_info(server.client())

            def post(items: list[tuple[str, Path]]) -> dict[str, Any]:
                r = client.post(
                    "/v1/enroll",
                    params={"create_subjects": "true"},
                    files=[("photos", (p.name, data[p], "image/jpeg")) for _, p in items],
                    data={"subjects": [s for s, _ in items]},
                )
                if r.status_code != 200:
                    raise RuntimeError(f"/v1/enroll answered {r.status_code}: {r.text[:300]}")
                return r.json()

            probe = client.post("/v1/enroll")
            if probe.status_code in (404, 405):
                raise RuntimeError(f"POST /v1/enroll not available (HTTP {probe.status_code})")
            post(warm_set)
            timer = StageTimer()
            instrument_app(app, timer)
            before = scrape_metrics(client)
            pass_rows = []
            request_s = []
            statuses: dict[str, int] = defaultdict(int)
            try:
                for r, items in enumerate(timed_sets):
                    enrolled = failed = 0
                    gc.collect()
                    t_pass = time.perf_counter()
                    for s in range(0, len(items), args.enroll_batch):
                        t0 = time.perf_counter()
                        body = post(items[s : s + args.enroll_batch])
                        request_s.append(time.perf_counter() - t0)
                        enrolled += int(body["enrolled"])
                        failed += int(body["failed"])
                        for item in body["items"]:
                            statuses[item["status"]] += 1
                    wall = time.perf_counter() - t_pass
                    pass_rows.append(
                        {"photos": len(items), "enrolled": enrolled, "failed": failed, "seconds": wall,
                         "faces_per_s": enrolled / wall, "photos_per_s": len(items) / wall}
                    )  # fmt: skip
                    log(f"(3) enroll pass {r + 1}/{passes}: {enrolled} faces in {wall:.1f} s")
            finally:
                timer.restore()
            after = scrape_metrics(client)
            total_wall = sum(p["seconds"] for p in pass_rows)
            total_photos = sum(p["photos"] for p in pass_rows)
            stages = {k: v / total_photos * 1e3 for k, v in timer.seconds.items()}
            stages["other (HTTP, multipart, gallery, Redis, JSON)"] = total_wall / total_photos * 1e3 - sum(
                stages.values()
            )
            mem = server.client().info("memory")
            result.update(
                {
                    "pass": pass_rows,
                    "faces_per_s_median": float(np.median([p["faces_per_s"] for p in pass_rows])),
                    "photos_per_s_median": float(np.median([p["photos_per_s"] for p in pass_rows])),
                    "faces_per_s_overall": sum(p["enrolled"] for p in pass_rows) / total_wall,
                    "request": latency_summary(np.asarray(request_s)[None]),
                    "statuses": dict(statuses),
                    "stages_ms_per_photo": stages,
                    "metrics_stages": {
                        k: {"ms_per_photo": v["seconds"] / total_photos * 1e3, "count": v["count"]}
                        for k, v in metrics_stage_delta(before, after).items()
                    },
                    "metrics_request": metrics_request_delta(before, after, "/v1/enroll"),
                    "redis_used_memory_bytes": int(mem["used_memory"]),
                }
            )
    finally:
        server.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    return result


# --------------------------------------------------------------------------------------------
# Report


def _mb(x: float | None) -> str:
    return "n/a" if x is None else f"{x / 2**20:,.0f}"


def render(report: dict[str, Any]) -> str:
    env = report["env"]
    cfg = report["config"]
    out = [
        "# Service benchmark (CPU)",
        "",
        f"Machine: {env['cpu_model']} ({', '.join(env['cpu_flags'])}), {env['logical_cpus']} logical CPUs "
        f"({env['cpus_usable']} usable), {env['memory_gib']:.0f} GiB; load average "
        f"{env['loadavg_start'][0]:.2f} at start, {env['loadavg_end'][0]:.2f} at end. "
        f"Threads: {env['threads']} (ORT intra_op_num_threads, torch.set_num_threads). "
        f"Python {env['python']}, numpy {env['numpy']}, onnxruntime {env['onnxruntime']}, "
        f"torch {env['torch']}, "
        f"redis-py {env['redis_py']}, fastapi {env['fastapi']}, facenet-pytorch {env['facenet_pytorch']} "
        "(its own MTCNN code; torchvision replaced by the pure-torch stand-in of bench/face_path.py).",
        f"Command: `{cfg['command']}`; wall time {env['wall_s']:.0f} s.",
        "",
    ]
    out += _render_verify(report.get("verify")) + _load_line(report.get("verify"))
    out += _render_search(report.get("search")) + _load_line(report.get("search"))
    out += _render_enroll(report.get("enroll")) + _load_line(report.get("enroll"))
    out.append("## Goals")
    out.append("")
    out.append(md_table(["goal", "result"], [[k, v] for k, v in report["goal_lines"].items()]))
    return "\n".join(out)


def _load_line(part: dict[str, Any] | None) -> list[str]:
    if not part or "machine_load" not in part:
        return []
    m = part["machine_load"]
    return [
        f"Part wall time {m['wall_s']:.0f} s; other processes on the machine used "
        f"{m['other_processes_cpu_s']:.0f} CPU-s meanwhile "
        f"({m['other_processes_cores']:.2f} cores on average).",
        "",
    ]


def _render_verify(v: dict[str, Any] | None) -> list[str]:
    out = ["## 1. `/v1/verify` latency", ""]
    if v is None or "error" in v:
        return out + [f"Not run: {v['error'] if v else 'not selected'}", ""]
    ds = v["detector_settings"]
    out.append(
        f"{v['pairs']} pairs of real photos from photos/people ({v['genuine_pairs']} genuine, "
        f"{v['pairs'] - v['genuine_pairs']} impostor), {v['passes']} interleaved pass(es) after warm-up; "
        f"model {v['model_id']}; detector min face {ds['min_face_size']:g} px, thresholds "
        f"{'/'.join(f'{t:g}' for t in ds['thresholds'])}, factor {ds['factor']:g}, largest face."
    )
    out.append(
        "Ours: POST /v1/verify through the FastAPI app in process (TestClient: multipart encoding, "
        "decoding, detection, alignment, embedding, JSON). Baseline: PIL decode + facenet-pytorch MTCNN "
        "(PyTorch eager) + `models.align.align_faces` (the shared alignment step, same for both) + "
        f"PyTorch eager {v.get('baseline_network', 'MobileFaceNet')} on the crop fused as the "
        "manifest says (crop and mirror: concatenated or summed, L2-normalised) + cosine; "
        "the baseline has no HTTP layer."
    )
    if "ours_socket" in v["contenders"]:
        out.append(
            "Ours over a socket: `sphereface serve` (uvicorn, one worker) in a child process, posted "
            "multipart bodies encoded once per pair over one keep-alive connection from this process: "
            "what a client on the same machine waits for, without the TestClient's own encoding."
        )
    if any(name in v["contenders"] for name in ("ours_fullres", "ours_full_scan", "baseline_1t")):
        out.append(
            "Diagnostic rows (not the goal's configuration): ours with detection at full resolution "
            "(`SPHEREFACE_DETECT_MAX_SIDE` unset; the service default searches photos over 1024 px as if "
            "scaled to 1024 px, R-Net/O-Net and landmarks at full resolution), ours detecting every face "
            "and keeping the largest (`SPHEREFACE_LARGEST_FACE_SEARCH=full`; the default searches the "
            "pyramid coarse to fine and stops once the faces left are smaller, as facenet-pytorch's "
            "baseline does not), and the baseline at 1 torch thread."
        )
    out.append("")
    t = v["timing"]
    names = {**v["contenders"]}
    for b in BASELINES:
        if f"{b}_nms_free" in t:
            names[f"{b}_nms_free"] = f"{v['contenders'][b]} minus its stand-in NMS time"
        if f"{b}_tvnms" in t:
            names[f"{b}_tvnms"] = f"{v['contenders'][b]} with torchvision's C++ NMS (measured)"
    rows = [
        [names[name], f"{t[name]['median_ms']:.1f}", f"{t[name]['p90_ms']:.1f}", f"{t[name]['mean_ms']:.1f}",
         f"{t[name]['min_ms']:.1f}", str(t[name]["calls"])]
        for name in names
    ]  # fmt: skip
    out.append(md_table(["per verify call", "median ms", "p90 ms", "mean ms", "min ms", "calls"], rows))
    out.append("")
    ratio_cols = [b for b in names if b.startswith("baseline")]
    rows = [
        [v["contenders"][o]]
        + [f"{v['ratios'][o][b]['median']:.2f}x / {v['ratios'][o][b]['mean']:.2f}x" for b in ratio_cols]
        for o in v["ratios"]
    ]
    short = {
        "baseline": f"baseline@{v['threads']}",
        "baseline_1t": "baseline@1",
        "baseline_nms_free": f"baseline@{v['threads']} NMS-free",
        "baseline_1t_nms_free": "baseline@1 NMS-free",
        "baseline_tvnms": f"baseline@{v['threads']} torchvision NMS",
        "baseline_1t_tvnms": "baseline@1 torchvision NMS",
    }
    out.append("Speed ratio baseline / ours (median / mean; NMS-free: minus the stand-in NMS time):")
    out.append("")
    out.append(md_table(["ours"] + [short.get(b, b) for b in ratio_cols], rows))
    out.append("")
    r = v["ratio_baseline_over_ours"]
    nms = v["baseline_standin_nms_ms_per_call"]["baseline"]["median_ms"]
    tv = v.get("baseline_torchvision_nms", {}).get("baseline")
    if tv is not None:
        reads = (
            f"the goal reads the lower of median and mean with the baseline's NMS timed in torchvision "
            f"{tv['torchvision']}'s C++ kernel on the same calls ({tv['calls']} calls, same boxes kept as "
            f"the stand-in in {tv['same_kept_as_standin']}; {tv['mean_ms_per_item']:.2f} ms per verify "
            f"call against the stand-in's median {nms:.1f} ms)"
        )
    else:
        reads = (
            "the goal counts the most conservative of median and mean, with and without the stand-in NMS; "
            f"the baseline's NMS runs in the pure-torch torchvision stand-in (median {nms:.1f} ms per call) "
            "and torchvision's C++ NMS would be faster, so the NMS-free rows bound the baseline from below "
            "(`make torchvision-env` times the real one)"
        )
    out.append(
        f"Goal: ours {GOAL_VERIFY_SPEEDUP:g}x faster than the baseline (both at {v['threads']} threads): "
        f"{_met(v['goal_met'])} (median {r['median']:.2f}x, p90 {r['p90']:.2f}x, mean {r['mean']:.2f}x; "
        f"{reads}: {v['ratio_conservative']:.2f}x)."
    )
    a = v["agreement"]
    variants = ", ".join(f"{k} vs its base {x:.1e}" for k, x in a["max_abs_score_diff_of_variants"].items())
    out.append(
        f"Scores: max |baseline - ours| {a['max_abs_score_diff']:.4f}, mean {a['mean_abs_score_diff']:.4f}; "
        f"same decision at threshold {_fmt(v['threshold'], '.4f')} on "
        f"{a['same_decision']}/{v['pairs']} pairs; right decisions ours {a['decisions_right_ours']}/"
        f"{v['pairs']}, baseline {a['decisions_right_baseline']}/{v['pairs']}"
        + (f"; max score difference of the diagnostic variants: {variants}." if variants else ".")
    )
    out.append("")
    cols = list(v["timing"])
    cols = [c for c in cols if not c.endswith(("_nms_free", "_tvnms"))]
    rows = []
    for p in v["per_pair"]:
        rows.append(
            [f"{p['photo1']} vs {p['photo2']}", "genuine" if p["genuine"] else "impostor",
             f"{p['score_ours']:.4f}", f"{p['score_baseline']:.4f}", f"{p['score_diff']:+.4f}",
             f"{p['same_person_ours']}/{p['same_person_baseline']}"]
            + [f"{p['median_ms'][name]:.0f}" for name in cols]
        )  # fmt: skip
    out.append(
        md_table(
            ["pair", "kind", "score ours", "score base", "diff", "same ours/base"]
            + [f"{c} ms" for c in cols],
            rows,
        )
    )
    out.append("")
    st = v["stages_ms_per_call"]
    labels = {
        "other": "other (ours: HTTP, multipart, FastAPI, JSON; baseline: glue)",
        "total": "total (one extra pass, not interleaved)",
    }
    rows = [
        [labels.get(s, s)] + [_fmt(st[c].get(s)) for c in st]
        for s in ("decode", "detect", "align", "embed", "other", "total")
    ]
    out.append(
        "Where the time goes (ms per verify call, both photos; a stage's time is added up over the "
        "threads that ran it, so with the two photos side by side the stages can add up to more than "
        "the total; other: the time in no stage):"
    )
    out.append("")
    out.append(md_table(["stage"] + list(st), rows))
    out.append("")
    return out


def _render_search(s: dict[str, Any] | None) -> list[str]:
    out = ["## 2. Identification search latency", ""]
    if s is None or "error" in s:
        return out + [f"Not run: {s['error'] if s else 'not selected'}", ""]
    out.append(
        f"Synthetic gallery: seeded random unit vectors, {DIM}-d float32, 1 to 5 faces per subject; "
        f"{RANDOM_QUERIES} random queries + {NOISY_QUERIES} noisy copies of stored vectors "
        f"(unit(v + {NOISE:g} * random unit)); top-{TOP_K} subjects (max over a subject's faces); one query "
        "per call; numpy and Redis interleaved query by query. Exactness: top-5 subject lists compared "
        "with a brute-force truth computed by the benchmark."
    )
    if "redis_skipped" in s:
        out.append(f"Redis path skipped: {s['redis_skipped']}")
    else:
        first = next(iter(s["sizes"].values()), {}).get("redis", {})
        srv = first.get("server", {})
        out.append(
            f"Redis: Redis Stack {srv.get('redis_version')} "
            f"(search module {srv.get('modules', {}).get('search')}), "
            f"started by service.redis_server.start_redis_stack (appendonly yes, appendfsync "
            f"{first.get('appendfsync')}, {first.get('transport')} socket), FLAT FLOAT32 COSINE index by "
            "RedisKnnSearch.ensure_index() before the load. Loading shortcut: the faces are written "
            f"directly as the service's face hashes with pipelined HSET (batches of {LOAD_BATCH}, "
            "non-transactional), without the service's other keys (subject sets, change stream); "
            f"search settings {first.get('search_config')}."
        )
    out.append("")
    rows = []
    for n, e in s["sizes"].items():
        for path in ("numpy", "redis"):
            if path not in e:
                continue
            p = e[path]
            lat, chk = p["latency"], p["check"]
            rows.append(
                [f"{int(n):,}", path, f"{lat['median_ms']:.2f}", f"{lat['p90_ms']:.2f}",
                 f"{lat['mean_ms']:.2f}",
                 str(lat["calls"]), f"{chk['topk_identical_to_brute_force']}/{chk['queries']}",
                 f"{chk['recall_at_1_planted']:.2f}", f"{chk['max_abs_score_diff_vs_brute_force']:.1e}"]
            )  # fmt: skip
    out.append(
        md_table(
            [
                "faces",
                "path",
                "median ms",
                "p90 ms",
                "mean ms",
                "calls",
                "top-5 = exact",
                "recall@1",
                "max abs score diff",
            ],
            rows,
        )
    )
    out.append("")
    rows = []
    for n, e in s["sizes"].items():
        nb = e["numpy"]
        rd = e.get("redis")
        ratio = f"{rd['latency']['median_ms'] / nb['latency']['median_ms']:.1f}x" if rd else "n/a"
        rows.append(
            [f"{int(n):,}", f"{e['subjects']:,}", f"{nb['build_s']:.2f}", _mb(nb["rss_growth_bytes"]),
             f"{nb['batch_of_100_ms_per_query']:.2f}",
             f"{rd['load_s']:.1f}" if rd else "n/a", f"{rd['load_faces_per_s']:,.0f}" if rd else "n/a",
             _mb(rd["used_memory_bytes"]) if rd else "n/a",
             _fmt(rd["ft_info"].get("vector_index_sz_mb")) if rd else "n/a", ratio]
        )  # fmt: skip
    out.append(
        md_table(
            [
                "faces",
                "subjects",
                "numpy build s",
                "numpy RSS growth MiB",
                "numpy batch-100 ms/query",
                "Redis load s",
                "Redis load faces/s",
                "Redis used_memory MiB",
                "FT vector index MB",
                "Redis/numpy median",
            ],
            rows,
        )  # fmt: skip
    )
    out.append("")
    g = s.get("goal", {})
    for path in ("numpy", "redis"):
        if path in g:
            x = g[path]
            out.append(
                f"Goal < {GOAL_SEARCH_MS:g} ms at {GOAL_SEARCH_SIZE:,} faces, exact, {path}: median "
                f"{x['median_ms']:.1f} ms -> {_met(x['met'])} "
                f"(p90 {x['p90_ms']:.1f} ms -> {_met(x['met_p90'])})."
            )
    out.append("")
    return out


def _render_enroll(e: dict[str, Any] | None) -> list[str]:
    out = ["## 3. Bulk enrollment throughput", ""]
    if e is None or "error" in e:
        return out + [f"Not run: {e['error'] if e else 'not selected'}", ""]
    out.append(
        f"POST /v1/enroll?create_subjects=true through the in-process app, requests of {e['batch']} "
        f"real photos of celeba_faces (250x250 JPEG, 5 photos per identity, a new subject per identity), "
        f"{e['passes']} pass(es) of {e['photos_per_pass']} different photos each "
        "(after one warm-up request); "
        f"Redis: local redis-server {e['redis'].get('server', {}).get('redis_version')} on a unix socket, "
        "AOF appendfsync always (as `sphereface serve` runs it)."
    )
    out.append("")
    rows = [
        [str(i + 1), str(p["photos"]), str(p["enrolled"]), str(p["failed"]), f"{p['seconds']:.2f}",
         f"{p['faces_per_s']:.1f}", f"{p['photos_per_s']:.1f}"]
        for i, p in enumerate(e["pass"])
    ]  # fmt: skip
    rows.append(
        ["median", "", "", "", "", f"{e['faces_per_s_median']:.1f}", f"{e['photos_per_s_median']:.1f}"]
    )
    out.append(md_table(["pass", "photos", "enrolled", "failed", "seconds", "faces/s", "photos/s"], rows))
    out.append("")
    req = e["request"]
    out.append(
        f"Per request of up to {e['batch']} photos: median {req['median_ms']:.0f} ms, "
        f"p90 {req['p90_ms']:.0f} ms; "
        f"statuses {e['statuses']}."
    )
    out.append("")
    rows = [[k, f"{v:.2f}"] for k, v in e["stages_ms_per_photo"].items()]
    out.append("Where the time goes (timed pass, ms per photo; the app's own /metrics stages beside):")
    out.append("")
    ms = e.get("metrics_stages", {})
    rows = [
        [k, f"{v:.2f}", _fmt(ms.get(k, {}).get("ms_per_photo"), ".2f")]
        for k, v in e["stages_ms_per_photo"].items()
    ]
    rows += [
        [f"/metrics {k}", "", f"{v['ms_per_photo']:.2f}"]
        for k, v in ms.items()
        if k not in e["stages_ms_per_photo"]
    ]
    out.append(md_table(["stage", "benchmark timer", "/metrics"], rows))
    out.append("")
    return out


def goal_lines(report: dict[str, Any]) -> dict[str, str]:
    lines = {}
    v = report.get("verify")
    if v and "error" not in v:
        r = v["ratio_baseline_over_ours"]
        lines[f"verify {GOAL_VERIFY_SPEEDUP:g}x faster than the baseline"] = (
            f"{_met(v['goal_met'])} (median {r['median']:.2f}x, mean {r['mean']:.2f}x, "
            f"most conservative {v['ratio_conservative']:.2f}x)"
        )
    else:
        lines[f"verify {GOAL_VERIFY_SPEEDUP:g}x faster than the baseline"] = "not measured"
    s = report.get("search")
    g = (s or {}).get("goal", {})
    for path in ("numpy", "redis"):
        key = f"search < {GOAL_SEARCH_MS:g} ms at {GOAL_SEARCH_SIZE:,} faces, exact ({path})"
        if path in g:
            x = g[path]
            lines[key] = f"{_met(x['met'])} (median {x['median_ms']:.1f} ms, p90 {x['p90_ms']:.1f} ms)"
        else:
            lines[key] = "not measured (size not in --sizes, or the path did not run)"
    e = report.get("enroll")
    lines["bulk enrollment faces/s (no goal set)"] = (
        f"{e['faces_per_s_median']:.1f}" if e and "error" not in e else "not measured"
    )
    return lines


# --------------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--json", type=Path, default=None, help="write every number to this JSON file")
    p.add_argument(
        "--sizes",
        default=",".join(str(s) for s in DEFAULT_SIZES),
        help="gallery sizes for the search benchmark (default: 10000,100000,1000000)",
    )
    p.add_argument("--quick", action="store_true", help="smoke run: 10000 faces, fewer repetitions")
    p.add_argument(
        "--parts", default="verify,search,enroll", help="which parts to run (default: verify,search,enroll)"
    )
    p.add_argument(
        "--threads", type=int, default=2, help="ORT intra-op threads and torch threads (default 2)"
    )
    p.add_argument(
        "--model",
        type=Path,
        default=DEFAULT_MODEL,
        help="model folder: the reference MobileFaceNet (default) or the dlib model (models/dlib_resnet_v1), "
        "whose PyTorch baseline is rebuilt from dlib's file",
    )
    p.add_argument(
        "--checkpoint",
        type=Path,
        default=None,
        help="the MobileFaceNet's checkpoint, for the PyTorch baseline",
    )
    p.add_argument("--data", type=Path, default=SHARED_DATA, help="shared data folder")
    p.add_argument("--verify-pairs", type=int, default=12, help="photo pairs for /v1/verify (default 12)")
    p.add_argument("--verify-repeats", type=int, default=5, help="interleaved passes over the pairs")
    p.add_argument(
        "--no-diagnostics",
        dest="diagnostics",
        action="store_false",
        help="leave out the diagnostic verify rows (ours detecting at full resolution, baseline at 1 thread)",
    )
    p.add_argument("--search-repeats", type=int, default=3, help="passes over the 100 queries")
    p.add_argument("--enroll-photos", type=int, default=200, help="photos per enrollment pass (default 200)")
    p.add_argument("--enroll-batch", type=int, default=32, help="photos per enrollment request (default 32)")
    p.add_argument("--enroll-passes", type=int, default=3, help="enrollment passes, new photos each")
    p.add_argument(
        "--appendfsync",
        default="everysec",
        choices=("always", "everysec", "no"),
        help="AOF policy of the Redis Stack server of the search benchmark (default everysec)",
    )
    p.add_argument("--seed", type=int, default=20240601)
    p.add_argument(
        "--time-budget", type=float, default=240.0, help="seconds per timed measurement before passes stop"
    )
    p.add_argument("--fnp-wheel", type=Path, default=DEFAULT_WHEEL)
    p.add_argument("--fnp-env", type=Path, default=DEFAULT_ENV)
    p.add_argument(
        "--torchvision-python",
        type=Path,
        default=TORCHVISION_PYTHON,
        help="Python of an environment with the real torchvision, to time the baseline's NMS calls in its "
        "C++ kernel (default: the one `make torchvision-env` builds)",
    )
    args = p.parse_args(argv)
    args.sizes = [int(x) for x in str(args.sizes).replace("_", "").split(",") if x.strip()]
    if args.quick:
        args.sizes = list(QUICK_SIZES)
        args.verify_pairs = min(args.verify_pairs, 4)
        args.verify_repeats = 1
        args.search_repeats = 1
        args.enroll_photos = min(args.enroll_photos, 64)
        args.enroll_passes = 1
    args.parts = [x.strip() for x in args.parts.split(",") if x.strip()]
    unknown = set(args.parts) - {"verify", "search", "enroll"}
    if unknown:
        p.error(f"unknown parts {sorted(unknown)}")
    if args.checkpoint is None:
        args.checkpoint = args.data / "reference_models" / "mobilefacenet_casia" / "068.ckpt"
    if min(args.sizes, default=1) < 10 or args.threads < 1:
        p.error("sizes must be at least 10, threads at least 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.time()
    torch.set_num_threads(args.threads)
    report: dict[str, Any] = {
        "config": {
            "command": " ".join(["python", "bench/service.py", *(sys.argv[1:] if argv is None else argv)]),
            "quick": args.quick,
            "parts": args.parts,
            "threads": args.threads,
            "sizes": args.sizes,
            "dim": DIM,
            "k": TOP_K,
            "verify_pairs": args.verify_pairs,
            "verify_repeats": args.verify_repeats,
            "search_repeats": args.search_repeats,
            "enroll_photos": args.enroll_photos,
            "enroll_batch": args.enroll_batch,
            "enroll_passes": args.enroll_passes,
            "appendfsync_search": args.appendfsync,
            "seed": args.seed,
            "time_budget_s": args.time_budget,
            "model": str(args.model),
            "checkpoint": str(args.checkpoint),
        },
        "env": machine_info(args.threads),
    }
    runners = {"verify": bench_verify, "enroll": bench_enroll, "search": bench_search}
    for part in ("verify", "enroll", "search"):  # search last: it needs the most memory
        if part not in args.parts:
            continue
        watch = CpuWatch()
        try:
            report[part] = runners[part](args)
        except Exception as exc:  # keep going: the other parts may still run
            traceback.print_exc()
            report[part] = {"error": f"{type(exc).__name__}: {exc}"}
        report[part]["machine_load"] = watch.result()
        report[part]["wall_s"] = report[part]["machine_load"]["wall_s"]
    report["env"]["loadavg_end"] = list(os.getloadavg())
    report["env"]["wall_s"] = time.time() - started
    report["goal_lines"] = goal_lines(report)
    if args.json:  # before rendering, so that no number is lost
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2, default=json_default) + "\n")
        log(f"wrote {args.json}")
    print(render(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
