"""Part (3) of the service benchmark: bulk enrollment of real photos through ``POST /v1/enroll``
on a local redis-server that persists every write (AOF, ``appendfsync always``)."""

from __future__ import annotations

import argparse
import gc
import shutil
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np

from bench.baselines import ensure_model
from bench.redis_info import redis_server_info
from bench.stage_timer import (
    StageTimer,
    instrument_app,
    metrics_request_delta,
    metrics_stage_delta,
    scrape_metrics,
)
from bench.timing import latency_summary, log


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


class EnrollPoster:
    """``POST /v1/enroll?create_subjects=true`` of ``(subject id, photo path)`` items; the photos'
    bytes are read ahead (``data``), so that a request times the service, not the disk."""

    def __init__(self, client, data: dict[Path, bytes]) -> None:
        self.client = client
        self.data = data

    def __call__(self, items: list[tuple[str, Path]]) -> dict[str, Any]:
        r = self.client.post(
            "/v1/enroll",
            params={"create_subjects": "true"},
            files=[("photos", (p.name, self.data[p], "image/jpeg")) for _, p in items],
            data={"subjects": [s for s, _ in items]},
        )
        if r.status_code != 200:
            raise RuntimeError(f"/v1/enroll answered {r.status_code}: {r.text[:300]}")
        return r.json()


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
            post = EnrollPoster(client, data)
            probe = client.post("/v1/enroll")
            if probe.status_code in (404, 405):
                raise RuntimeError(f"POST /v1/enroll not available (HTTP {probe.status_code})")
            post(warm_set)
            result.update(_timed_enroll(app, client, post, timed_sets, args.enroll_batch, server))
    finally:
        server.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    return result


def _timed_enroll(app, client, post: EnrollPoster, timed_sets, batch: int, server) -> dict[str, Any]:
    """Every timed set enrolled in requests of ``batch`` photos, the app's stages timed."""
    timer = StageTimer()
    instrument_app(app, timer)
    before = scrape_metrics(client)
    pass_rows = []
    request_s: list[float] = []
    statuses: dict[str, int] = defaultdict(int)
    try:
        for r, items in enumerate(timed_sets):
            row = _enroll_pass(post, items, batch, request_s, statuses)
            pass_rows.append(row)
            passes = len(timed_sets)
            log(f"(3) enroll pass {r + 1}/{passes}: {row['enrolled']} faces in {row['seconds']:.1f} s")
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
    return {
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


def _enroll_pass(
    post: EnrollPoster, items, batch: int, request_s: list[float], statuses: dict[str, int]
) -> dict[str, Any]:
    """One pass over ``items``: adds each request's seconds and each item's status; its row."""
    enrolled = failed = 0
    gc.collect()
    t_pass = time.perf_counter()
    for s in range(0, len(items), batch):
        t0 = time.perf_counter()
        body = post(items[s : s + batch])
        request_s.append(time.perf_counter() - t0)
        enrolled += int(body["enrolled"])
        failed += int(body["failed"])
        for item in body["items"]:
            statuses[item["status"]] += 1
    wall = time.perf_counter() - t_pass
    return {"photos": len(items), "enrolled": enrolled, "failed": failed, "seconds": wall,
            "faces_per_s": enrolled / wall, "photos_per_s": len(items) / wall}  # fmt: skip
