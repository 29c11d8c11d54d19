"""dlib's own face pipeline on LFW, to set beside ours on the same pairs.

dlib itself (the ``dlib-bin`` wheel): its HOG face detector (one upsampling; the face nearest the
image centre; when it finds none, the central square of half the image side, as our LFW job does),
its 5-point shape predictor, ``get_face_chip`` (150x150, padding 0.25) and
``compute_face_descriptor`` without jitter, on every image of LFW View 2's pairs. Scored with the
LFW job's two protocols: the official SphereFace one (training-fold mean subtracted) and the same
folds on the plain cosine (what the service computes).

    .venv/bin/python bench/dlib_pipeline.py --data ../shared/data/lfw \\
        --json docs/results/dlib_own_pipeline_lfw.json
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]
sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402

from training.evaluation.report import write_json  # noqa: E402


def dlib_descriptors(lfw: Path, names: list[str], progress: bool = True) -> tuple[np.ndarray, list[str]]:
    """dlib's descriptor of each image (``(N, 128)``) and the images where HOG found no face."""
    import dlib
    from tqdm import tqdm

    from models.dlib_format import DLIB_RESNET_FILE
    from models.image import read_image
    from models.importers import cached_dlib_file

    detector = dlib.get_frontal_face_detector()
    predictor = dlib.shape_predictor(str(cached_dlib_file("shape_predictor_5_face_landmarks.dat")))
    model = dlib.face_recognition_model_v1(str(cached_dlib_file(DLIB_RESNET_FILE)))
    features, no_face = [], []
    for name in tqdm(names, desc="dlib pipeline", disable=not progress):
        image = read_image(lfw / "images" / name)
        h, w = image.shape[:2]
        boxes = list(detector(image, 1))
        if boxes:
            box = min(boxes, key=lambda r: np.hypot(r.center().x - w / 2, r.center().y - h / 2))
        else:
            no_face.append(name)
            side = 0.5 * min(h, w)
            box = dlib.rectangle(
                int(w / 2 - side / 2), int(h / 2 - side / 2), int(w / 2 + side / 2), int(h / 2 + side / 2)
            )
        features.append(np.array(model.compute_face_descriptor(image, predictor(image, box))))
    return np.array(features), no_face


def main(argv: list[str] | None = None) -> int:
    from training.evaluation.lfw_files import pair_features, read_pairs
    from training.evaluation.verification import lfw_10fold_accuracy

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", type=Path, required=True, help="LFW folder (images/, pairs.txt)")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)
    started = time.time()
    pairs = read_pairs(args.data / "pairs.txt")
    names = pairs.images()
    features, no_face = dlib_descriptors(args.data, names, not args.no_progress)
    left, right = pair_features(features, names, pairs)
    official = lfw_10fold_accuracy(left, right, pairs.is_same, pairs.fold)
    cosine = lfw_10fold_accuracy(left, right, pairs.is_same, pairs.fold, subtract_mean=False)
    distance = np.linalg.norm(left - right, axis=1)
    report = {
        "pipeline": "dlib 20.0.1 (dlib-bin): HOG detector (upsample 1), shape_predictor_5_face_landmarks, "
        "get_face_chip 150x150 padding 0.25, compute_face_descriptor (no jitter)",
        "images": len(names),
        "no_face_images": len(no_face),
        "official_protocol": official.to_dict(),
        "cosine_protocol": cosine.to_dict(),
        "dlib_fixed_threshold_0.6": float(np.mean((distance < 0.6) == pairs.is_same)),
        "seconds": time.time() - started,
    }
    print(
        f"dlib's own pipeline on {len(names)} LFW images ({len(no_face)} without a HOG face): "
        f"official protocol {100 * official.accuracy:.2f}% ± {100 * official.std:.2f}%, "
        f"cosine {100 * cosine.accuracy:.2f}% ± {100 * cosine.std:.2f}%, "
        f"distance < 0.6 {100 * report['dlib_fixed_threshold_0.6']:.2f}%"
    )
    if args.json:
        write_json(args.json, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
