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
import json
import os
import sys
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
# Run as ``python bench/service.py``, this file's folder comes first on sys.path, and this file
# would shadow the ``service`` package: put the repository first instead.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from bench.face_path_report import json_default  # noqa: E402
from bench.face_path_settings import DEFAULT_MODEL  # noqa: E402
from bench.facenet_env import DEFAULT_ENV, DEFAULT_WHEEL, TORCHVISION_PYTHON  # noqa: E402
from bench.machine import CpuWatch, machine_info  # noqa: E402
from bench.paths import SHARED_DATA  # noqa: E402
from bench.service_enroll import bench_enroll  # noqa: E402
from bench.service_report import goal_lines, render  # noqa: E402
from bench.service_search import DEFAULT_SIZES, DIM, QUICK_SIZES, TOP_K, bench_search  # noqa: E402
from bench.service_verify import bench_verify  # noqa: E402
from bench.timing import log  # noqa: E402


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
