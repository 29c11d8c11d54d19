"""Part (a) of the face-path benchmark: our MTCNN on ONNX Runtime against facenet-pytorch's
(PyTorch eager), interleaved, on each set of images: speed, agreement, and where the time goes."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bench.detections import compare_detections, found_from_facenet, found_from_ours
from bench.detector_profile import profile_facenet, profile_ours
from bench.face_path_settings import DETECT_WARMUP, FACTOR, MIN_FACE, THRESHOLDS
from bench.timing import Contender, compare_speed, log, pass_ratio_spread, per_item_summary, run_interleaved
from models.mtcnn import MTCNNDetector, run_mtcnn_net
from models.mtcnn_convert import normalise_pixels


def mtcnn_weight_parity(det: MTCNNDetector, fnp) -> dict[str, float]:
    """Max abs difference of our ONNX nets and facenet-pytorch's torch nets on the same pixels."""
    rng = np.random.default_rng(0)

    def both(session, torch_net, shape):
        pixels = rng.integers(0, 256, shape, dtype=np.uint8)
        ours = run_mtcnn_net(session, pixels)
        return ours, [t.numpy() for t in torch_net(normalise_pixels(torch.from_numpy(pixels)))]

    def diff(a, b):
        return float(np.abs(a - b).max())

    with torch.inference_mode():
        (prob, reg), (t_reg, t_prob) = both(det.pnet, fnp.pnet, (2, 57, 83, 3))
        pnet = max(diff(prob, t_prob[:, 1]), diff(reg, t_reg))
        (prob, reg), (t_reg, t_prob) = both(det.rnet, fnp.rnet, (8, 24, 24, 3))
        rnet = max(diff(prob, t_prob[:, 1]), diff(reg, t_reg))
        (prob, reg, marks), (t_reg, t_marks, t_prob) = both(det.onet, fnp.onet, (8, 48, 48, 3))
        onet = max(diff(prob, t_prob[:, 1]), diff(reg, t_reg), diff(marks, t_marks))
    return {"pnet": pnet, "rnet": rnet, "onet": onet}


def _with_torchvision_nms(
    seconds: dict[str, np.ndarray],
    timing: dict[str, Any],
    standin_nms: dict[int, list[float]],
    images: list[np.ndarray],
    fnp,
    standin,
    threads: int,
    variants: list[int],
    tv_python: Path,
) -> dict[str, Any] | None:
    """facenet-pytorch's times with torchvision's own C++ NMS in place of the stand-in's.

    One more pass of facenet-pytorch records every stand-in ``batched_nms`` call; the real
    torchvision times the same calls in its own environment (``bench/torchvision_nms.py``); each
    image's time is then its measured time less the stand-in's NMS time plus torchvision's.
    Adds ``facenet_tvnms@T`` rows to ``timing``; returns the speed ratios against them, or None
    when there is no torchvision environment (``make torchvision-env``)."""
    from bench.torchvision_nms import real_nms_per_item, record_per_item

    if not tv_python.is_file():
        log(f"  no torchvision environment at {tv_python} (make torchvision-env): NMS bounds only")
        return None
    measured = {}
    for t in variants:
        torch.set_num_threads(t)
        groups = record_per_item(standin, lambda img: fnp.detect(img, landmarks=True), images)
        measured[t] = real_nms_per_item(groups, t, tv_python)
    torch.set_num_threads(threads)
    corrected = {}
    for t in variants:
        real = np.asarray(measured[t]["per_item_seconds"])
        stand = np.asarray(standin_nms[t]).reshape(-1, len(images))
        corrected[t] = seconds[f"facenet@{t}"] - stand + real[None, :]
        timing[f"facenet_tvnms@{t}"] = per_item_summary(corrected[t])
        timing[f"facenet@{t}"]["torchvision_nms"] = {
            k: v for k, v in measured[t].items() if k != "per_item_seconds"
        }
    speed = compare_speed(timing, "mean_ms_per_item", "ours", "facenet_tvnms", threads, variants)
    ours = seconds[f"ours@{threads}"]
    speed["same_threads_per_pass"] = pass_ratio_spread(corrected[threads], ours, np.mean)
    first = measured[threads]
    speed["torchvision"] = {k: first[k] for k in ("torch", "torchvision", "calls", "same_kept_as_standin")}
    return speed


class FacenetCall:
    """facenet-pytorch's detect; records the stand-in NMS seconds of every call, in call order."""

    def __init__(self, fnp, standin) -> None:
        self.fnp = fnp
        self.standin = standin
        self.nms_seconds: list[float] = []

    def __call__(self, img):
        before = self.standin.TIMING["batched_nms_seconds"]
        out = self.fnp.detect(img, landmarks=True)
        self.nms_seconds.append(self.standin.TIMING["batched_nms_seconds"] - before)
        return out


@dataclass
class DetectorRun:
    """What every measurement of part (a) shares: our detector at each thread count, facenet-pytorch's
    MTCNN and its torchvision stand-in, the thread counts, the passes and the time budget (s)."""

    ours: dict[int, MTCNNDetector]
    fnp: Any
    standin: Any
    threads: int
    variants: list[int]
    repeats: int
    budget_s: float
    tv_python: Path


def bench_detector(
    sets: dict[str, dict[str, Any]],
    threads: int,
    variants: list[int],
    repeats: int,
    fnp,
    standin,
    budget_s: float,
    tv_python: Path,
) -> dict[str, Any]:
    ours = {
        t: MTCNNDetector(
            "cpu", min_face_size=MIN_FACE, thresholds=THRESHOLDS, scale_factor=FACTOR, intra_op_threads=t
        )
        for t in variants
    }
    run = DetectorRun(ours, fnp, standin, threads, variants, repeats, budget_s, tv_python)
    parity = mtcnn_weight_parity(ours[threads], fnp)
    results: dict[str, Any] = {"weights_max_abs_diff": parity, "sets": {}}
    for set_name, spec in sets.items():
        results["sets"][set_name] = _bench_set(run, set_name, spec)
    for set_name, spec in sets.items():
        log(f"(a) profiling on {set_name}")
        entry = results["sets"][set_name]
        entry["profile_ours"] = profile_ours(spec["images"], entry["speed"]["best_threads_ours"])
        entry["profile_facenet"] = profile_facenet(
            fnp, spec["images"][:8], entry["speed"]["best_threads_theirs"]
        )
    return results


def _bench_set(run: DetectorRun, set_name: str, spec: dict[str, Any]) -> dict[str, Any]:
    """Both detectors on one set of images, interleaved: timing, speed ratios, agreement."""
    images = spec["images"]
    threads, variants = run.threads, run.variants
    calls = {t: FacenetCall(run.fnp, run.standin) for t in variants}
    contenders = {f"ours@{t}": Contender(run.ours[t].detect) for t in variants}
    contenders.update({f"facenet@{t}": Contender(calls[t], torch_threads=t) for t in variants})
    log(
        f"(a) detector on {set_name}: {len(images)} images x {len(contenders)} contenders, "
        f"{run.repeats} passes"
    )
    seconds, outputs = run_interleaved(
        contenders, images, run.repeats, DETECT_WARMUP, f"detect/{set_name}", run.budget_s
    )
    timing = {name: per_item_summary(s) for name, s in seconds.items()}
    warm = min(DETECT_WARMUP, len(images))
    for t in variants:
        nms = np.asarray(calls[t].nms_seconds[warm:]).reshape(-1, len(images))
        timing[f"facenet@{t}"]["standin_nms"] = per_item_summary(nms)
    standin_nms = {t: calls[t].nms_seconds[warm:] for t in variants}
    speed = _detector_speed(run, seconds, timing, standin_nms, images)
    ours_found = [found_from_ours(o) for o in outputs[f"ours@{threads}"]]
    fnp_found = [found_from_facenet(o) for o in outputs[f"facenet@{threads}"]]
    # Do the thread settings change what is found? (They should not.)
    same_counts = {
        name: int(
            sum(len(o) == len(r) for o, r in zip(outputs[name], outputs[f"ours@{threads}"], strict=True))
        )
        for name in contenders
        if name.startswith("ours@")
    }
    agreement = compare_detections(ours_found, fnp_found, spec["names"], spec.get("reference"))
    shapes = np.array([img.shape[:2] for img in images])
    return {
        "images": len(images),
        "height_range": [int(shapes[:, 0].min()), int(shapes[:, 0].max())],
        "width_range": [int(shapes[:, 1].min()), int(shapes[:, 1].max())],
        "megapixels_mean": float((shapes[:, 0] * shapes[:, 1]).mean() / 1e6),
        "timing": timing,
        "speed": speed,
        "images_where_ours_at_other_threads_finds_as_many_faces": same_counts,
        "agreement": agreement,
    }


def _detector_speed(
    run: DetectorRun,
    seconds: dict[str, np.ndarray],
    timing: dict[str, Any],
    standin_nms: dict[int, list[float]],
    images: list[np.ndarray],
) -> dict[str, Any]:
    """Speed ratios facenet-pytorch / ours of one set: as measured, with its stand-in NMS counted as
    free, and with torchvision's own NMS in its place when that environment exists."""
    threads, variants = run.threads, run.variants
    speed = compare_speed(timing, "mean_ms_per_item", "ours", "facenet", threads, variants)
    speed["same_threads_per_pass"] = pass_ratio_spread(
        seconds[f"facenet@{threads}"], seconds[f"ours@{threads}"], np.mean
    )
    # The stand-in NMS is pure torch (the real torchvision runs it in C++): the most
    # conservative ratio counts it as free.
    best_ours = timing[f"ours@{speed['best_threads_ours']}"]["mean_ms_per_item"]
    best_fnp = min(
        timing[f"facenet@{t}"]["mean_ms_per_item"] - timing[f"facenet@{t}"]["standin_nms"]["mean_ms_per_item"]
        for t in variants
    )
    speed["facenet_standin_nms_ms_per_image"] = {
        str(t): timing[f"facenet@{t}"]["standin_nms"]["mean_ms_per_item"] for t in variants
    }
    speed["speedup_each_best_facenet_nms_free"] = best_fnp / best_ours
    with_torchvision = _with_torchvision_nms(
        seconds, timing, standin_nms, images, run.fnp, run.standin, threads, variants, run.tv_python
    )
    if with_torchvision is not None:
        speed["with_torchvision_nms"] = with_torchvision
    return speed
