"""What scoring a subject by all its faces costs: ``POST /v1/identify`` of one embedding with each
subject score (``max``: the in-process index alone; the others re-rank the nearest subjects by
every face they have, read from Redis), on a gallery of synthetic unit vectors in a real
redis-server, through the app in-process (no HTTP socket, no face path).

    python bench/identify_aggregation.py --subjects 1000 --faces 3 --requests 200 --runs 5 \
        --json docs/results/identify_aggregation.json

Requests of the aggregations are interleaved (one of each in turn, the order rotated), so other
load on the machine falls on all alike. Printed: the CPU, then per aggregation the median
milliseconds of a request in each run, as min / median / max over the runs.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from fastapi.testclient import TestClient  # noqa: E402

from models.registry import resolve_model  # noqa: E402
from service.app import create_app  # noqa: E402
from service.redis_server import LocalRedis, find_redis_server  # noqa: E402
from service.settings import Settings  # noqa: E402

KEY = {"X-API-Key": "bench-identify-aggregation"}
AGGREGATIONS = ("max", "mean", "quality-max")


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown CPU"


def unit(x: np.ndarray) -> np.ndarray:
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def enroll(client: TestClient, vectors: np.ndarray, faces: int) -> None:
    """Subjects ``s0``, ``s1``, ... with ``faces`` embeddings each (bulk JSON enrollment)."""
    subjects = [f"s{i // faces}" for i in range(len(vectors))]
    for a in range(0, len(vectors), 256):
        body = {"subjects": subjects[a : a + 256], "embeddings": vectors[a : a + 256].tolist()}
        r = client.post("/v1/enroll", json={**body, "create_subjects": True}, headers=KEY)
        assert r.status_code == 200 and r.json()["failed"] == 0, r.text


def one_run(client: TestClient, queries: np.ndarray, rotation: int) -> dict[str, float]:
    """Median milliseconds per request of each aggregation over ``queries``."""
    times: dict[str, list[float]] = {how: [] for how in AGGREGATIONS}
    for i, query in enumerate(queries):
        shift = (i + rotation) % len(AGGREGATIONS)
        order = AGGREGATIONS[shift:] + AGGREGATIONS[:shift]
        for how in order:
            started = time.perf_counter()
            r = client.post(
                f"/v1/identify?aggregation={how}", json={"embeddings": [query.tolist()]}, headers=KEY
            )
            times[how].append((time.perf_counter() - started) * 1e3)
            assert r.status_code == 200, r.text
    return {how: float(np.median(t)) for how, t in times.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--subjects", type=int, default=1000)
    p.add_argument("--faces", type=int, default=3, help="faces per subject")
    p.add_argument("--requests", type=int, default=200, help="per aggregation and run")
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, help="also write the numbers (and this command) here")
    args = p.parse_args(argv)
    rng = np.random.default_rng(args.seed)
    model = resolve_model("default")
    work = Path(tempfile.mkdtemp(prefix="sf-bench-agg-"))
    try:
        with LocalRedis(work / "redis", binary=find_redis_server()) as redis:
            settings = Settings(model_dir=model, redis_url=redis.url, api_key=KEY["X-API-Key"])
            with TestClient(create_app(settings)) as client:
                dim = client.app.state.pipeline.manifest.output_size
                vectors = unit(rng.normal(size=(args.subjects * args.faces, dim))).astype(np.float32)
                enroll(client, vectors, args.faces)
                picks = rng.integers(0, len(vectors), size=args.requests)
                queries = unit(vectors[picks] + 0.05 * rng.normal(size=(args.requests, dim)))
                one_run(client, queries[:20], 0)  # warm-up
                runs = [one_run(client, queries, r) for r in range(args.runs)]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    result = {
        "command": "python bench/identify_aggregation.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "cpu": cpu_name(),
        "gallery": f"{args.subjects} subjects x {args.faces} faces, seed {args.seed}",
        "ms_per_request_min_median_max": {
            how: [round(f([r[how] for r in runs]), 2) for f in (min, np.median, max)] for how in AGGREGATIONS
        },
    }
    print(json.dumps(result, indent=1))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
