"""Part (1) of the service benchmark: ``POST /v1/verify`` in process, over a local socket, and
the hand-rolled facenet-pytorch + PyTorch eager baseline, interleaved on pairs of real photos."""

from __future__ import annotations

import argparse
import http.client
import io
import json
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bench.baselines import HandRolledVerifier, ensure_model, load_torch_baseline, torch_baseline_name
from bench.facenet_env import load_facenet, prepare_facenet_env
from bench.stage_timer import StageTimer, instrument_app, metrics_stage_delta, scrape_metrics
from bench.timing import Contender, latency_summary, log, run_interleaved

GOAL_VERIFY_SPEEDUP = 2.0


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
        """One request on the kept-alive connection; once more on a new one when the server has closed
        it (uvicorn drops a connection idle for 5 s, e.g. while the other contenders run a round)."""
        try:
            self._connection.request(method, path, body=body, headers=headers)
            response = self._connection.getresponse()
        except (BrokenPipeError, ConnectionResetError, http.client.RemoteDisconnected):
            self._connection.close()
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


@dataclass
class VerifyMeasurements:
    """What the interleaved verify passes and the extra stage-timed pass measured."""

    seconds: dict[str, np.ndarray]  # per contender: (passes, pairs) seconds
    outputs: dict[str, list[Any]]  # per contender: its answer to each pair (first pass)
    nms: dict[str, np.ndarray]  # per baseline: (passes, pairs) seconds in the stand-in NMS
    real_nms: dict[str, dict[str, Any]]  # per baseline: torchvision's own NMS times (when measured)
    stages: dict[str, dict[str, float]]  # per contender: ms per call in each stage
    metrics_before: dict[str, float] | None
    metrics_after: dict[str, float] | None
    detector_settings: dict[str, Any]
    threshold: float | None  # the model's verification threshold (cosine)
    model_id: str


def bench_verify(args: argparse.Namespace) -> dict[str, Any]:
    fnp_env = prepare_facenet_env(args.fnp_wheel, args.fnp_env)
    mtcnn_cls, standin = load_facenet(args.fnp_env)
    imported = ensure_model(args.model, args.checkpoint)
    net = load_torch_baseline(args.model, args.checkpoint)
    pairs = verify_pairs(args.data / "photos" / "people", args.verify_pairs)
    log(f"(1) verify: {len(pairs)} pairs of photos/people")
    measured = _measure_verify(args, pairs, mtcnn_cls, standin, net)
    return _verify_report(args, pairs, measured, fnp_env, imported)


def _measure_verify(
    args: argparse.Namespace, pairs: list[dict[str, Any]], mtcnn_cls, standin, net
) -> VerifyMeasurements:
    """Every contender on a local redis-server (the gallery is not used): the apps in process,
    ``sphereface serve`` over a socket, the baselines."""
    from fastapi.testclient import TestClient

    from service.redis_server import LocalRedis

    tmp = Path(tempfile.mkdtemp(prefix="sf-bench-verify-"))
    redis_server = LocalRedis(tmp / "redis", appendfsync="no").start()  # the gallery is not used
    try:
        apps = _verify_apps(args, redis_server.url, tmp)
        clients = {name: TestClient(a) for name, a in apps.items()}
        served = None
        for c in clients.values():
            c.__enter__()
        try:
            served = ServedOverSocket(args.model, redis_server.url, tmp / "served", args.threads)
            return _run_verify(args, pairs, apps, clients, served, (mtcnn_cls, standin, net))
        finally:
            for c in clients.values():
                c.__exit__(None, None, None)
            if served is not None:
                served.close()
    finally:
        redis_server.stop()
        shutil.rmtree(tmp, ignore_errors=True)


def _verify_apps(args: argparse.Namespace, redis_url: str, data_dir: Path) -> dict[str, Any]:
    """The app as served (``ours``) and, with diagnostics, its two diagnostic variants."""
    from service.app import create_app
    from service.settings import Settings

    settings = Settings(
        model_dir=args.model,
        auth="off",
        redis_url=redis_url,
        intra_op_threads=args.threads,
        data_dir=data_dir,
    )
    apps = {"ours": create_app(settings)}
    if args.diagnostics:
        apps["ours_fullres"] = create_app(settings.model_copy(update={"detect_max_side": None}))
        apps["ours_full_scan"] = create_app(settings.model_copy(update={"largest_face_search": "full"}))
    return apps


def _run_verify(args, pairs, apps, clients, served, baseline_parts) -> VerifyMeasurements:
    """Interleaved passes of every contender, then one more stage-timed pass of each.
    ``baseline_parts``: facenet-pytorch's MTCNN class, the torchvision stand-in, the eager network."""
    mtcnn_cls, standin, net = baseline_parts
    n = len(pairs)
    pipeline = apps["ours"].state.pipeline
    det = pipeline.detector
    detector_settings = {
        "min_face_size": det.min_face_size,
        "thresholds": list(det.thresholds),
        "factor": det.scale_factor,
        "face_choice": "largest (both)",
    }
    posters = {name: verify_poster(c) for name, c in clients.items()}
    contenders = {name: Contender(p) for name, p in posters.items()}
    contenders["ours_socket"] = Contender(served)
    baselines = {"baseline": args.threads}
    if args.diagnostics and args.threads != 1:
        baselines["baseline_1t"] = 1
    verifiers = {}
    for name, threads in baselines.items():
        verifiers[name] = HandRolledVerifier(mtcnn_cls, standin, net, pipeline.manifest, detector_settings)
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
    stages = {name: split_pass_app(a, posters[name], pairs) for name, a in apps.items()}
    after = scrape_metrics(clients["ours"])
    stages.update(_baseline_stage_pass(verifiers, baselines, pairs, args.threads))
    threshold = pipeline.manifest.thresholds.get("verification")
    return VerifyMeasurements(
        seconds, outputs, nms, real_nms, stages, before, after, detector_settings,
        threshold.value if threshold else None, pipeline.manifest.model_id,
    )  # fmt: skip


def _baseline_stage_pass(verifiers, baselines, pairs, threads: int) -> dict[str, dict[str, float]]:
    """One pass of each baseline over the pairs, its stages timed: ms per verify call."""
    n = len(pairs)
    stages = {}
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
    torch.set_num_threads(threads)
    return stages


def _per_pair(pairs: list[dict[str, Any]], m: VerifyMeasurements) -> list[dict[str, Any]]:
    """Per pair: both scores and decisions, and each contender's median time (ms)."""
    per_pair = []
    t = m.threshold
    for k, pair in enumerate(pairs):
        o = m.outputs["ours"][k]
        b = m.outputs["baseline"][k]
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
                "median_ms": {name: float(np.median(s[:, k]) * 1e3) for name, s in m.seconds.items()},
            }
        )
    return per_pair


def _variant_diff(m: VerifyMeasurements, n: int) -> dict[str, float]:
    """Per diagnostic variant: the largest score difference from the configuration it varies."""

    def score(name: str, k: int) -> float:
        out = m.outputs[name][k]
        return float(out["score"] if isinstance(out, dict) else out)

    return {
        name: max(abs(score(name, k) - score("ours" if name in OURS else "baseline", k)) for k in range(n))
        for name in m.seconds
        if name not in ("ours", "baseline")
    }


def _verify_timing(m: VerifyMeasurements) -> dict[str, dict[str, Any]]:
    """Latency of each contender, and of each baseline without its stand-in NMS time and with
    torchvision's own in its place (when measured)."""
    seconds, nms = m.seconds, m.nms
    timing = {name: latency_summary(s) for name, s in seconds.items()}
    timing.update({f"{b}_nms_free": latency_summary(seconds[b] - nms[b]) for b in nms})
    for b, real in m.real_nms.items():
        timing[f"{b}_tvnms"] = latency_summary(
            seconds[b] - nms[b] + np.asarray(real["per_item_seconds"])[None]
        )
    return timing


def _verify_ratios(timing: dict[str, dict[str, Any]]) -> tuple[dict[str, Any], float]:
    """``ratios[ours variant][baseline variant] = {median, p90, mean}``, and the ratio the goal reads."""
    ratios = {}
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
    return ratios, conservative


def _verify_report(args, pairs, m: VerifyMeasurements, fnp_env: dict[str, Any], imported: bool) -> dict:
    """Part (1)'s numbers as the report stores them."""
    n = len(pairs)
    per_pair = _per_pair(pairs, m)
    diffs = np.abs([p["score_diff"] for p in per_pair])
    timing = _verify_timing(m)
    ratios, conservative = _verify_ratios(timing)
    return {
        "model_dir": str(args.model),
        "model_id": m.model_id,
        "baseline_network": torch_baseline_name(args.model),
        "model_imported_now": imported,
        "threads": args.threads,
        "threshold": m.threshold,
        "pairs": n,
        "genuine_pairs": int(sum(p["genuine"] for p in pairs)),
        "passes": m.seconds["ours"].shape[0],
        "detector_settings": m.detector_settings,
        "facenet_pytorch": fnp_env,
        "contenders": {k: VERIFY_NAMES[k].format(t=args.threads) for k in m.seconds},
        "timing": timing,
        "ratios": ratios,
        "ratio_baseline_over_ours": ratios["ours"]["baseline"],
        "baseline_standin_nms_ms_per_call": {b: latency_summary(x) for b, x in m.nms.items()},
        "baseline_torchvision_nms": {
            b: {k: v for k, v in real.items() if k != "per_item_seconds"} for b, real in m.real_nms.items()
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
            "max_abs_score_diff_of_variants": _variant_diff(m, n),
        },
        "stages_ms_per_call": m.stages,
        "metrics_stages_during_split_pass": metrics_stage_delta(m.metrics_before, m.metrics_after),
        "per_pair": per_pair,
        "photo_sizes": [list(_jpeg_size(p["bytes1"])) + list(_jpeg_size(p["bytes2"])) for p in pairs],
    }


def _jpeg_size(data: bytes) -> tuple[int, int]:
    from PIL import Image

    with Image.open(io.BytesIO(data)) as im:
        return im.size
