"""The service benchmark's report as Markdown: one section per part, then the goals."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from bench.gallery_data import NOISE, NOISY_QUERIES, RANDOM_QUERIES
from bench.service_search import DIM, GOAL_SEARCH_MS, GOAL_SEARCH_SIZE, LOAD_BATCH, TOP_K
from bench.service_verify import BASELINES, GOAL_VERIFY_SPEEDUP

LineMaker = Callable[[dict[str, Any]], list[str]]


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


def _section(title: str, part: dict[str, Any] | None, parts: Sequence[LineMaker]) -> list[str]:
    """A report section: its title, then each of ``parts`` on the part's numbers, or why it did not run."""
    out = [title, ""]
    if part is None or "error" in part:
        return out + [f"Not run: {part['error'] if part else 'not selected'}", ""]
    for lines in parts:
        out += lines(part)
    return out


def _render_verify(v: dict[str, Any] | None) -> list[str]:
    verify_parts = (
        _verify_setup_lines,
        _verify_timing_lines,
        _verify_goal_lines,
        _verify_pair_lines,
        _verify_stage_lines,
    )
    return _section("## 1. `/v1/verify` latency", v, verify_parts)


def _verify_setup_lines(v: dict[str, Any]) -> list[str]:
    """What was compared: the pairs, the detector settings, each contender."""
    out = []
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
    return out


def _verify_timing_lines(v: dict[str, Any]) -> list[str]:
    """Latency per contender, and the speed ratios baseline / ours."""
    out = []
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
    return out


def _verify_goal_lines(v: dict[str, Any]) -> list[str]:
    """The goal as it reads, and how far the two sides' scores and decisions agree."""
    out = []
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
    return out


def _verify_pair_lines(v: dict[str, Any]) -> list[str]:
    """Per pair: scores, decisions and each contender's median time."""
    out = []
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
    return out


def _verify_stage_lines(v: dict[str, Any]) -> list[str]:
    """Where the time goes, per stage and contender."""
    out = []
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
    search_parts = (_search_setup_lines, _search_latency_lines, _search_build_lines, _search_goal_lines)
    return _section("## 2. Identification search latency", s, search_parts)


def _search_setup_lines(s: dict[str, Any]) -> list[str]:
    """The synthetic gallery, the queries, and how Redis ran and was loaded."""
    out = []
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
    return out


def _search_latency_lines(s: dict[str, Any]) -> list[str]:
    """Per size and path: latency per query and agreement with the truth."""
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
    table = md_table(
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
    return [table, ""]


def _search_build_lines(s: dict[str, Any]) -> list[str]:
    """Per size: build and load times, memory, Redis against numpy."""
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
    table = md_table(
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
    )
    return [table, ""]


def _search_goal_lines(s: dict[str, Any]) -> list[str]:
    """The search goal per path, at its size."""
    out = []
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
    return _section("## 3. Bulk enrollment throughput", e, (_enroll_lines,))


def _enroll_lines(e: dict[str, Any]) -> list[str]:
    """Passes, requests and where the time goes."""
    out = []
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
