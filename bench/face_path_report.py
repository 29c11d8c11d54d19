"""The face-path benchmark's report: its tables as text, and its numbers as JSON."""

from __future__ import annotations

from typing import Any

import numpy as np

from bench.face_path_settings import GOAL_DETECT_SPEEDUP, GOAL_EMBED_SPEEDUP, GOAL_LANDMARK_PX, MATCH_IOU
from bench.facenet_env import FNP_VERSION


def table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    lines = [
        "  ".join(
            h.ljust(w) if i == 0 else h.rjust(w) for i, (h, w) in enumerate(zip(headers, widths, strict=True))
        )
    ]
    lines.append("  ".join("-" * w for w in widths))
    for r in rows:
        lines.append(
            "  ".join(
                c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True))
            )
        )
    return "\n".join(lines)


def worst_speedup(speed: dict[str, Any]) -> float:
    """The ratio a goal reads: with facenet-pytorch's NMS timed in the real torchvision when that
    was measured, the lower of equal threads and best against best; otherwise the most
    conservative of those and the NMS-free bound."""
    tv = speed.get("with_torchvision_nms")
    if tv is not None:
        return min(tv["speedup_same_threads"], tv["speedup_each_best"])
    keys = ("speedup_same_threads", "speedup_each_best", "speedup_each_best_facenet_nms_free")
    return min(speed[k] for k in keys if k in speed)


def _spread(speed: dict[str, Any]) -> str:
    """``median (min-max)`` of the per-pass ratios at equal threads."""
    p = speed.get("same_threads_per_pass")
    return "-" if p is None else f"{p['median']:.2f}x ({p['min']:.2f}-{p['max']:.2f})"


def _goal(speed: dict[str, Any], goal: float) -> str:
    """A speed goal is met when every ratio (equal threads, best against best) reaches it."""
    return "met" if worst_speedup(speed) >= goal else "NOT met"


def _short(function: str) -> str:
    """``<method 'resize' of 'ImagingCore' objects>`` -> ``ImagingCore.resize`` and the like."""
    if "onnxruntime" in function and ".run" in function:
        return "ORT session.run"
    if function.startswith("<method '"):
        name, _, owner = function[len("<method '") :].partition("' of '")
        return f"{owner.split(chr(39))[0]}.{name}"
    if function.startswith("<built-in method "):
        return function[len("<built-in method ") :].rstrip(">").rsplit(".", 1)[-1]
    return function


def _speed_line(s: dict[str, Any]) -> str:
    return f"best threads: ours {s['best_threads_ours']}, theirs {s['best_threads_theirs']}; " + ", ".join(
        f"ratio @{t}: {v:.2f}x" for t, v in s["per_threads"].items()
    )


def render(report: dict[str, Any]) -> str:
    cfg = report["config"]
    env = report["env"]
    t = cfg["threads"]
    variants = cfg["thread_variants"]
    out = [
        "Face-path benchmark (CPU)",
        f"threads: equal for both sides, {t} (torch.set_num_threads / ORT intra_op_num_threads); "
        f"each side also tried at {', '.join(str(v) for v in variants)} thread(s)",
        f"machine: {env['cpu_count']} logical CPUs, load average {env['loadavg_start'][0]:.2f} at start, "
        f"{env['loadavg_end'][0]:.2f} at end; torch {env['torch']}, onnxruntime {env['onnxruntime']}, "
        f"facenet-pytorch {FNP_VERSION} with a pure-torch torchvision stand-in",
        f"repeats: up to {cfg['repeats']} interleaved passes, {cfg['time_budget_s']:.0f} s budget per "
        "measurement (detector: per-image median over passes, "
        "then the mean over images; embedder: median over all calls); wall time "
        f"{env['wall_s']:.0f} s",
        "",
    ]
    det = report["detector"]
    out += _detector_speed_lines(det, t, variants)
    out.append("")
    out += _agreement_lines(det)
    out.append("")
    out += _profile_lines(det)
    out.append("")
    out += _embedder_lines(report["embedder"], t, variants)
    return "\n".join(out)


def _detector_speed_lines(det: dict[str, Any], t: int, variants: list[int]) -> list[str]:
    """(a) The detector's speed table and, per set, the thread counts, NMS times and ratios."""
    out = []
    w = det["weights_max_abs_diff"]
    out.append(
        "(a) MTCNN: ours (ONNX Runtime) vs facenet-pytorch (PyTorch eager), same weights "
        f"(max |diff| of the nets P/R/O: {w['pnet']:.1e}/{w['rnet']:.1e}/{w['onet']:.1e})"
    )
    rows = []
    for name, s in det["sets"].items():
        tm, sp = s["timing"], s["speed"]
        rows.append(
            [name, str(s["images"]), "{}-{} x {}-{}".format(*s["height_range"], *s["width_range"])]
            + [f"{tm[f'ours@{v}']['mean_ms_per_item']:.1f}" for v in variants]
            + [f"{tm[f'facenet@{v}']['mean_ms_per_item']:.1f}" for v in variants]
            + [
                f"{sp['speedup_same_threads']:.2f}x",
                _spread(sp),
                f"{sp['speedup_each_best']:.2f}x",
                f"{sp['speedup_each_best_facenet_nms_free']:.2f}x",
                _goal(sp, GOAL_DETECT_SPEEDUP),
            ]
        )
    out.append(
        table(
            ["set", "imgs", "size HxW"]
            + [f"ours@{v} ms" for v in variants]
            + [f"fnp@{v} ms" for v in variants]
            + [f"ratio@{t}", "per pass", "best/best", "b/b NMS free", f"goal >={GOAL_DETECT_SPEEDUP:g}x"],
            rows,
        )
    )
    out.append(
        "  (mean ms per image; ratio = facenet-pytorch / ours; best/best = each side at its best thread "
        "count; NMS free = best/best with facenet-pytorch's time in the pure-torch stand-in batched_nms "
        "taken out; the goal needs every ratio)"
    )
    for name, s in det["sets"].items():
        nms = ", ".join(f"@{k} {v:.1f}" for k, v in s["speed"]["facenet_standin_nms_ms_per_image"].items())
        passes = s["timing"][f"ours@{t}"]["passes"]
        out.append(f"  {name}: {passes} passes; {_speed_line(s['speed'])}; fnp stand-in NMS ms/image {nms}")
        tv = s["speed"].get("with_torchvision_nms")
        if tv is not None:
            real = ", ".join(
                f"@{v} {s['timing'][f'facenet@{v}']['torchvision_nms']['mean_ms_per_item']:.2f}"
                for v in variants
            )
            info = tv["torchvision"]
            out.append(
                f"  {name}, fnp with torchvision {info['torchvision']}'s C++ batched_nms (the same "
                f"{info['calls']} calls timed in its own environment; same boxes kept as the stand-in in "
                f"{info['same_kept_as_standin']}): NMS ms/image {real}; ratio@{t} "
                f"{tv['speedup_same_threads']:.2f}x, per pass {_spread(tv)}, best/best "
                f"{tv['speedup_each_best']:.2f}x (what the goal reads)"
            )
    return out


def _agreement_lines(det: dict[str, Any]) -> list[str]:
    """(a) What the two detectors found: faces, matches, landmark distances, box offsets."""
    nan = float("nan")
    out = []
    rows = []
    for name, s in det["sets"].items():
        a = s["agreement"]
        lm = a.get("landmarks", {})
        bx = a.get("boxes", {})
        rows.append(
            [
                name,
                str(a["faces_ours"]),
                str(a["faces_facenet"]),
                str(a["matched"]),
                str(a["only_ours"]),
                str(a["only_facenet"]),
                f"{lm.get('mean_px', nan):.2f}",
                f"{lm.get('median_px', nan):.2f}",
                f"{lm.get('p90_px', nan):.2f}",
                f"{lm.get('max_px', nan):.1f}",
                f"{100 * lm.get('share_faces_within_1px', nan):.0f}%",
                f"{bx.get('mean_iou', nan):.3f}",
                "met" if lm.get("mean_px", np.inf) <= GOAL_LANDMARK_PX else "NOT met",
            ]
        )
    out.append(
        table(
            [
                "set",
                "faces ours",
                "faces fnp",
                "matched",
                "only ours",
                "only fnp",
                "lm mean px",
                "median",
                "p90",
                "max",
                "<=1px",
                "box IoU",
                f"goal <={GOAL_LANDMARK_PX:g}px",
            ],
            rows,
        )
    )
    out.append(
        f"  (faces matched by box IoU > {MATCH_IOU}; landmark px = mean over the 5 points of the Euclidean "
        "distance, per matched face, then mean/median/p90/max over faces)"
    )
    for name, s in det["sets"].items():
        lm = s["agreement"].get("landmarks")
        if lm:
            pts = " ".join(f"{v:.2f}" for v in lm["per_point_mean_px"])
            off = lm["mean_offset_facenet_minus_ours_xy"]
            box = " ".join(
                f"{v:+.2f}" for v in s["agreement"]["boxes"]["mean_corner_offset_facenet_minus_ours"]
            )
            out.append(
                f"  {name}: per point (eyes, nose, mouth corners) {pts} px; mean offset fnp-ours "
                f"x {off[0]:+.2f} y {off[1]:+.2f} px; box x1 y1 x2 y2 fnp-ours {box} px"
            )
        ref = s["agreement"].get("vs_reference_landmarks")
        if ref and ref["ours"]["mean_px"] is not None and ref["facenet"]["mean_px"] is not None:
            out.append(
                f"  {name}: distance to lfw/landmarks.txt (MATLAB MTCNN on the 250x250 originals, "
                "integer px): "
                f"ours {ref['ours']['mean_px']:.2f} px, facenet-pytorch {ref['facenet']['mean_px']:.2f} px"
            )
    return out


def _profile_lines(det: dict[str, Any]) -> list[str]:
    """(a) Where each detector spends its time, per set (ms per image)."""
    out = []
    out.append("  where the time goes (one pass, each side at its best thread count, ms per image):")
    for name, s in det["sets"].items():
        p = s["profile_ours"]
        ort_ms = p["ort_run_ms_per_image"]
        top = ", ".join(
            f"{_short(f['function'])} {f['self_ms_per_image']:.1f}" for f in p["top_functions"][:6]
        )
        nets = f"P-Net {ort_ms['pnet']:.1f}, R-Net {ort_ms['rnet']:.1f}, O-Net {ort_ms['onet']:.1f}"
        if p.get("outside_ort_ms_per_image") is None:
            out.append(
                f"  {name} ours@{p['ort_intra_op_threads']}: {p['ms_per_image_unprofiled']:.1f} wall; "
                f"inside ORT, added up over the detector's threads: {nets}"
            )
        else:
            out.append(
                f"  {name} ours@{p['ort_intra_op_threads']}: {p['ms_per_image_unprofiled']:.1f} = ORT "
                f"{nets.replace(', ', ' + ')} + outside ORT {p['outside_ort_ms_per_image']:.1f}"
            )
        out.append(f"    self time under cProfile (calling thread): {top}")
        f = s["profile_facenet"]
        ftop = ", ".join(
            f"{_short(x['function'])} {x['self_ms_per_image']:.1f}" for x in f["top_functions"][:4]
        )
        out.append(f"    facenet@{f['torch_threads']} (first {f['images']} images) self time: {ftop}")
    return out


def _embedder_lines(emb: dict[str, Any], t: int, variants: list[int]) -> list[str]:
    """(b) The embedder's parity, its speed table per batch size, and the calls timed."""
    out = []
    out.append(
        f"(b) Embedder {emb['model_id']}: ours (ONNX Runtime) vs PyTorch eager (same checkpoint, eval, "
        f"inference_mode), {emb['crops']} aligned LFW crops; "
        f"parity max |diff| {emb['parity_max_abs_diff']:.1e}, "
        f"min cosine {emb['parity_min_cosine']:.6f}"
    )
    rows = []
    for bs, b in emb["batches"].items():
        tm, sp = b["timing"], b["speed"]
        rows.append(
            [bs]
            + [f"{tm[f'ours@{v}']['median_ms_per_batch']:.2f}" for v in variants]
            + [f"{tm[f'torch@{v}']['median_ms_per_batch']:.2f}" for v in variants]
            + [
                f"{tm[f'ours@{t}']['images_per_s']:.0f}",
                f"{tm[f'torch@{t}']['images_per_s']:.0f}",
                f"{sp['speedup_same_threads']:.2f}x",
                _spread(sp),
                f"{sp['speedup_each_best']:.2f}x",
                _goal(sp, GOAL_EMBED_SPEEDUP),
            ]
        )
    out.append(
        table(
            ["batch"]
            + [f"ours@{v} ms" for v in variants]
            + [f"torch@{v} ms" for v in variants]
            + [
                f"ours@{t} img/s",
                f"torch@{t} img/s",
                f"ratio@{t}",
                "per pass",
                "best/best",
                f"goal >={GOAL_EMBED_SPEEDUP:g}x",
            ],
            rows,
        )
    )
    out.append("  (median ms per batch; ratio = torch / ours)")
    for bs, b in emb["batches"].items():
        calls = b["timing"][f"ours@{t}"]["calls"]
        out.append(f"  batch {bs}: {calls} timed calls each; {_speed_line(b['speed'])}")
    return out


def json_default(obj):
    """numpy scalars and arrays as JSON numbers and lists (``json.dumps(..., default=...)``)."""
    if isinstance(obj, np.integer):
        return int(obj)
    if isinstance(obj, np.floating):
        return float(obj)
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    raise TypeError(f"not JSON serialisable: {type(obj).__name__}")
