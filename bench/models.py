"""The models side by side on the same photos: /v1/verify latency and decisions.

For each model (``--models``, names of ``sphereface models`` or folders), the real FastAPI app runs
in process (``fastapi.testclient``: multipart encoding, decoding, detection, alignment, embedding,
JSON) with its own calibrated thresholds. Every genuine pair of ``photos/people`` (different photos
of one person) and as many impostor pairs are sent to ``POST /v1/verify``. Rounds are interleaved
(round r: every model in turn, every pair), after one warm-up round; a model's latency is the
median of its per-round medians, with the smallest and largest round median beside it. Decisions
are counted against the truth: genuine pairs accepted, impostor pairs rejected.

Usage::

    .venv/bin/python bench/models.py --json docs/results/bench_models.json     # make bench-models
"""

from __future__ import annotations

import argparse
import itertools
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]
sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402

from training.evaluation.report import write_json  # noqa: E402


def photo_pairs(people: Path) -> list[tuple[Path, Path, bool]]:
    """Every genuine pair of ``people/<name>/*.jpg`` and as many impostor pairs (seeded)."""
    persons = {d.name: sorted(d.glob("*.jpg")) for d in sorted(people.iterdir()) if d.is_dir()}
    genuine = [(a, b, True) for photos in persons.values() for a, b in itertools.combinations(photos, 2)]
    across = [
        (a, b, False)
        for (_, pa), (_, pb) in itertools.combinations(persons.items(), 2)
        for a in pa[:1]
        for b in pb[-1:]
    ]
    rng = np.random.default_rng(0)
    chosen = [
        across[i] for i in sorted(rng.choice(len(across), min(len(genuine), len(across)), replace=False))
    ]
    return genuine + chosen


def run(models: list[str], pairs: list[tuple[Path, Path, bool]], rounds: int, threads: int) -> dict[str, Any]:
    from fastapi.testclient import TestClient

    from models.registry import resolve_model
    from service.app import create_app
    from service.redis_server import LocalRedis
    from service.settings import Settings

    tmp = Path(tempfile.mkdtemp(prefix="sf-bench-models-"))
    server = LocalRedis(tmp / "redis", appendfsync="no").start()
    bodies = [(a.read_bytes(), b.read_bytes()) for a, b, _ in pairs]
    clients, seconds, answers = {}, {}, {}
    try:
        for name in models:
            settings = Settings(
                model=str(resolve_model(name)), auth="off", redis_url=server.url, intra_op_threads=threads,
                data_dir=tmp, redis_prefix=f"{name}:",
            )  # fmt: skip
            clients[name] = TestClient(create_app(settings)).__enter__()
            seconds[name] = np.zeros((rounds, len(pairs)))
        for r in range(-1, rounds):  # round -1 warms up
            for name, client in clients.items():
                for i, (one, two) in enumerate(bodies):
                    t0 = time.perf_counter()
                    reply = client.post(
                        "/v1/verify", files={"photo1": ("1.jpg", one), "photo2": ("2.jpg", two)}
                    )
                    elapsed = time.perf_counter() - t0
                    if reply.status_code != 200:
                        raise RuntimeError(
                            f"{name}: /v1/verify answered {reply.status_code}: {reply.text[:200]}"
                        )
                    if r >= 0:
                        seconds[name][r, i] = elapsed
                    else:
                        answers.setdefault(name, []).append(reply.json())
    finally:
        for client in clients.values():
            client.__exit__(None, None, None)
        server.stop()
    return {name: summarise(seconds[name], answers[name], pairs) for name in models}


def summarise(
    seconds: np.ndarray, answers: list[dict], pairs: list[tuple[Path, Path, bool]]
) -> dict[str, Any]:
    per_round = np.median(seconds, axis=1) * 1e3
    truth = np.array([same for *_, same in pairs])
    decided = np.array([bool(a["same_person"]) for a in answers])
    scores = np.array([a["score"] for a in answers])
    return {
        "model_id": answers[0]["model_id"],
        "threshold": answers[0]["threshold"],
        "threshold_far": answers[0]["threshold_far"],
        "verify_ms": {
            "median": float(np.median(per_round)),
            "min": float(per_round.min()),
            "max": float(per_round.max()),
            "round_medians": per_round.round(2).tolist(),
        },
        "genuine_accepted": int(np.sum(decided & truth)),
        "genuine": int(truth.sum()),
        "impostor_rejected": int(np.sum(~decided & ~truth)),
        "impostor": int((~truth).sum()),
        "genuine_scores": scores[truth].round(4).tolist(),
        "impostor_scores": scores[~truth].round(4).tolist(),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="default,sphereface_celeba", help="comma-separated names or folders")
    ap.add_argument("--data", type=Path, default=REPO.parent / "shared" / "data")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved timed rounds (default 5)")
    ap.add_argument("--threads", type=int, default=0, help="ORT intra-op threads (0: one per core)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    people = args.data / "photos" / "people"
    if not people.is_dir():
        ap.error(f"{people} not found (the shared data folder)")
    pairs = photo_pairs(people)
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    started = time.time()
    results = run(models, pairs, args.rounds, args.threads)
    report = {
        "command": " ".join(["python", "bench/models.py", *(sys.argv[1:] if argv is None else argv)]),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "pairs": len(pairs),
        "rounds": args.rounds,
        "models": results,
        "seconds": time.time() - started,
    }
    print(f"{len(pairs)} pairs of photos/people ({sum(p[2] for p in pairs)} genuine), {args.rounds} rounds")
    for name, r in results.items():
        v = r["verify_ms"]
        latency = f"verify {v['median']:.0f} ms (rounds {v['min']:.0f}-{v['max']:.0f})"
        decisions = (
            f"genuine accepted {r['genuine_accepted']}/{r['genuine']}, impostors rejected "
            f"{r['impostor_rejected']}/{r['impostor']}"
        )
        rule = "no calibrated threshold" if r["threshold"] is None else f"cosine >= {r['threshold']:.3f}"
        print(f"{name:18} {r['model_id']:34} {latency}  {decisions} ({rule})")
    if args.json:
        write_json(args.json, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
