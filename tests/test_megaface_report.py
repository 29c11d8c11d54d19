"""MegaFace report plots and Markdown tables, on small hand-made report dicts."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from training.evaluation.errors import MegaFaceDataError
from training.evaluation.megaface_report import (
    MISSING,
    PAPER_MEGAFACE,
    PLOT_FILES,
    load_reports,
    markdown_report,
    size_label,
    write_plots,
)

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
FARS = ["1e-03", "1e-04", "1e-05", "1e-06"]
NOT_COMPARABLE = "The papers used FaceScrub probes and the 1M MegaFace distractors"
COMPARISON = "## MegaFace Challenge 1 at 1M distractors: this run and the papers"


def _variant(
    sizes: list[int], rank1: dict[int, float], shift: float = 0.0, top_k: int = 20
) -> dict[str, Any]:
    """One result variant: rank-1 as given per size, rank-10 = rank-1 + 0.1, TAR defined at 1e-3 only
    (plus 1e-6 at 1M), a CMC climbing from rank-1 and a small ROC curve."""
    ident, verif, cmc, roc = {}, {}, {}, {}
    for n in sizes:
        r1 = min(1.0, rank1[n] + shift)
        ident[str(n)] = {"rank1": r1, "rank10": min(1.0, r1 + 0.1), "searches": 40}
        tar = {far: None for far in FARS}
        if n > 0:
            tar["1e-03"] = 0.9 - 0.1 * len(str(n)) / 10 + shift
        if n >= 1_000_000:
            tar["1e-06"] = 0.8555
        verif[str(n)] = {"n_genuine": 30, "n_impostor": 20 * n, "tar_at_far": tar, "threshold_at_far": {}}
        cmc[str(n)] = [min(1.0, r1 + 0.01 * k) for k in range(top_k)]
        roc[str(n)] = (
            {"far": [1e-4, 1e-3, 1e-2, 1e-1], "tar": [0.5, 0.7, 0.9, 0.99]}
            if n > 0
            else {"far": [], "tar": []}
        )
    return {
        "probe_images": 20,
        "identities": 5,
        "identification": ident,
        "verification": verif,
        "cmc": cmc,
        "roc": roc,
    }


def make_report(
    sizes: list[int] | None = None,
    rank1: dict[int, float] | None = None,
    *,
    protocol: str = "local-v1",
    model_id: str = "sf20-test",
    cleaned: bool = False,
    augmented: int = 0,
) -> dict[str, Any]:
    """A report dict shaped like :func:`training.evaluation.megaface.run_megaface`'s."""
    sizes = sizes if sizes is not None else [10, 100, 1000]
    rank1 = rank1 if rank1 is not None else {n: 0.975 - 0.1 * i for i, n in enumerate(sizes)}
    results = {"raw": _variant(sizes, rank1)}
    if cleaned:
        results["cleaned"] = _variant(sizes, rank1, shift=0.01)
        results["cleaned"]["probe_images"] = 18
    total = max(sizes) if sizes else 0
    return {
        "benchmark": "MegaFace Challenge 1 protocol (identification and verification)",
        "protocol": protocol,
        "protocol_description": f"description of {protocol}",
        "model_id": model_id,
        "embedding_size": 512,
        "search_device": "cpu",
        "probes": {
            "images": 20,
            "identities": 5,
            "max_per_identity": None,
            "no_face_images": 0,
            "removed": 2 if cleaned else None,
            "source": "probes",
        },
        "distractors": {
            "images": total - augmented,
            "augmented": augmented,
            "augmentation": "aug-v1: jittered copies" if augmented else None,
            "extra_features": None,
            "total": total,
            "removed": 3 if cleaned else None,
        },
        "sizes": sizes,
        "fars": FARS,
        "top_k": 20,
        "results": results,
        "timing_s": {"total": 1.0, "search": 0.5},
        "peak_rss_gib": 0.1,
    }


def table_rows(markdown: str, first_cell: str) -> list[list[str]]:
    """The cells of every table row of ``markdown`` whose first cell is ``first_cell``."""
    rows = []
    for line in markdown.splitlines():
        if line.startswith("| "):
            cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
            if cells[0] == first_cell:
                rows.append(cells)
    return rows


def main_header(markdown: str) -> list[str]:
    return table_rows(markdown, "model")[0]


# --------------------------------------------------------------------------------------------
# Plots
# --------------------------------------------------------------------------------------------


def test_write_plots_writes_three_valid_pngs(tmp_path: Path) -> None:
    report = make_report([0, 10, 100, 1000], cleaned=True)
    out = tmp_path / "new" / "plots"
    paths = write_plots(report, out)
    assert [p.name for p in paths] == list(PLOT_FILES)
    assert PLOT_FILES == ("identification_vs_distractors.png", "cmc.png", "roc.png")
    for path in paths:
        assert path.parent == out
        data = path.read_bytes()
        assert data[:8] == PNG_SIGNATURE
        assert len(data) > 5_000, f"{path.name} is suspiciously small ({len(data)} bytes)"


def test_write_plots_without_roc_points_still_writes(tmp_path: Path) -> None:
    report = make_report([10, 100])
    for size in ("10", "100"):
        report["results"]["raw"]["roc"][size] = {"far": [], "tar": []}
    paths = write_plots(report, tmp_path)
    assert all(p.read_bytes()[:8] == PNG_SIGNATURE for p in paths)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(PLOT_FILES)


# --------------------------------------------------------------------------------------------
# Markdown
# --------------------------------------------------------------------------------------------


def test_size_labels() -> None:
    assert [size_label(n) for n in (0, 10, 100, 1000, 10_000, 100_000, 1_000_000)] == [
        "0",
        "10",
        "100",
        "1k",
        "10k",
        "100k",
        "1M",
    ]
    assert size_label(10_318) == "10,318"
    assert size_label(1_027_060) == "1,027,060"


def test_markdown_main_table_rows_and_percentages() -> None:
    report = make_report([10, 100, 1000], {10: 0.975, 100: 0.9, 1000: 0.8125})
    text = markdown_report([report])
    assert text.startswith("# ")
    header = main_header(text)
    assert header[:5] == ["model", "variant", "protocol", "probe images / ids", "distractors"]
    assert header[5:8] == ["rank-1 @10", "rank-1 @100", "rank-1 @1k"]
    assert header[8:10] == ["largest N", "rank-10 @largest"]
    assert header[10:] == [f"TAR @{far}" for far in FARS]
    rows = table_rows(text, "sf20-test")
    assert len(rows) == 1
    assert rows[0] == [
        "sf20-test",
        "raw",
        "local-v1",
        "20 / 5",
        "1,000",
        "97.50",
        "90.00",
        "81.25",
        "1k",
        "91.25",
        "86.00",
        MISSING,
        MISSING,
        MISSING,
    ]
    assert "| 97.50 |" in text
    assert "- `local-v1`: description of local-v1" in text


def test_markdown_union_of_sizes_and_names() -> None:
    small = make_report([10, 100], {10: 0.5, 100: 0.25}, model_id="a")
    big = make_report(
        [100, 10_000, 10_318], {100: 0.75, 10_000: 0.6, 10_318: 0.59}, model_id="b", protocol="custom"
    )
    text = markdown_report([small, big], names=["first run", "second run"])
    header = main_header(text)
    assert header[5:9] == ["rank-1 @10", "rank-1 @100", "rank-1 @10k", "rank-1 @10,318"]
    first, second = table_rows(text, "first run")[0], table_rows(text, "second run")[0]
    assert first[5:11] == ["50.00", "25.00", MISSING, MISSING, "100", "35.00"]
    assert second[5:11] == [MISSING, "75.00", "60.00", "59.00", "10,318", "69.00"]
    assert "sf20" not in text and "| a |" not in text
    assert "- `local-v1`: description of local-v1" in text and "- `custom`: description of custom" in text


def test_markdown_cleaned_rows_and_augmentation() -> None:
    report = make_report([10, 100], {10: 0.9, 100: 0.8}, cleaned=True, augmented=40)
    text = markdown_report([report])
    rows = table_rows(text, "sf20-test")
    assert [r[1] for r in rows] == ["raw", "cleaned"]
    assert rows[0][3] == "20 / 5" and rows[1][3] == "18 / 5"
    assert rows[0][5:7] == ["90.00", "80.00"] and rows[1][5:7] == ["91.00", "81.00"]
    assert rows[0][4] == "100 (40 augmented)"
    assert "40 augmented distractors: aug-v1: jittered copies" in text
    assert "2 noisy probe images removed" in text


def test_markdown_not_comparable_lists_papers_apart() -> None:
    text = markdown_report([make_report(protocol="local-v1"), make_report(protocol="custom", model_id="x")])
    assert NOT_COMPARABLE in text
    assert "(`local-v1`, `custom`)" in text
    assert COMPARISON not in text
    paper = table_rows(text, "T2.10")
    assert ["T2.10", "SphereFace (m=4)", "SphereFace-64", "CASIA-WebFace", "72.729", "85.561"] in paper
    plus = table_rows(text, "T5.9")
    assert plus == [["T5.9", "SphereFace+ (m=4)", "SphereFace-64", "CASIA-WebFace", "73.03", MISSING]]


def test_markdown_megaface_below_1m_is_not_comparable() -> None:
    report = make_report([10, 100_000], {10: 0.9, 100_000: 0.7}, protocol="megaface")
    text = markdown_report([report])
    assert COMPARISON not in text
    assert NOT_COMPARABLE in text and "(`megaface`)" in text


def test_markdown_megaface_at_1m_is_compared_with_papers() -> None:
    sizes = [10, 1_000_000]
    report = make_report(
        sizes, {10: 0.99, 1_000_000: 0.7273}, protocol="megaface", model_id="sf64", cleaned=True
    )
    local = make_report(model_id="small")
    text = markdown_report([report, local])
    assert COMPARISON in text
    assert NOT_COMPARABLE not in text
    section = text.split(COMPARISON, 1)[1]
    lines = [line for line in section.splitlines() if line.startswith("| ")]
    assert lines[0] == "| method | arch | training data | rank-1 @1M | TAR @1e-6 |"
    assert lines[2] == f"| sf64 (raw, this run) | {MISSING} | {MISSING} | 72.73 | 85.55 |"
    assert lines[3] == f"| sf64 (cleaned, this run) | {MISSING} | {MISSING} | 73.73 | 85.55 |"
    assert len(lines) == 2 + 2 + len(PAPER_MEGAFACE)
    assert "| Softmax [T2.10] | SphereFace-64 | CASIA-WebFace | 54.855 | 65.925 |" in section
    assert "| SphereFace+ (m=4) [T5.8 / TD.7] | SphereFace-20 | CASIA-WebFace | 71.30 | 83.39 |" in section
    assert "Not in this comparison (not the MegaFace protocol at 1M): small." in section
    assert table_rows(text, "sf64")[0][header_index(text, "rank-1 @1M")] == "72.73"


def header_index(markdown: str, column: str) -> int:
    return main_header(markdown).index(column)


def test_paper_rows_cover_the_spec_tables() -> None:
    by_key = {(r.source, r.method, r.architecture): (r.mr1, r.mv) for r in PAPER_MEGAFACE}
    assert by_key[("T2.10", "SphereFace (m=4)", "SphereFace-64")] == (72.729, 85.561)
    assert by_key[("TA.2", "SphereFace (m=4)", "SphereFace-4")] == (57.529, 68.547)
    assert by_key[("T5.8 / TD.7", "SphereFace (m=4)", "SphereFace-20")] == (70.68, 82.56)
    assert by_key[("T5.9", "SphereFace+ (m=4)", "SphereFace-64")] == (73.03, None)
    assert {r.training_data for r in PAPER_MEGAFACE} == {"CASIA-WebFace"}
    assert len(PAPER_MEGAFACE) >= 14


# --------------------------------------------------------------------------------------------
# Errors and loading
# --------------------------------------------------------------------------------------------


def test_markdown_rejects_empty_and_non_reports() -> None:
    with pytest.raises(ValueError, match="no MegaFace report"):
        markdown_report([])
    with pytest.raises(ValueError, match="lacks 'results'"):
        markdown_report([make_report(), {"sizes": [10], "model_id": "lfw"}])
    with pytest.raises(ValueError, match="lacks 'sizes'"):
        markdown_report([{"results": {}}])
    with pytest.raises(ValueError, match="2 names given for 1 reports"):
        markdown_report([make_report()], names=["a", "b"])


def test_load_reports_round_trip_and_errors(tmp_path: Path) -> None:
    good = tmp_path / "good.json"
    good.write_text(json.dumps(make_report(model_id="from-file")))
    reports = load_reports([good, str(good)])
    assert [r["model_id"] for r in reports] == ["from-file", "from-file"]
    assert "| from-file | raw |" in markdown_report(reports[:1])

    missing = tmp_path / "missing.json"
    with pytest.raises(MegaFaceDataError, match="missing.json") as info:
        load_reports([good, missing])
    assert "does not exist" in info.value.message

    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    with pytest.raises(MegaFaceDataError, match=r"broken\.json is not valid JSON"):
        load_reports([broken])

    other = tmp_path / "lfw.json"
    other.write_text(json.dumps({"accuracy": 0.99}))
    with pytest.raises(MegaFaceDataError, match=r"lfw\.json is not a MegaFace report"):
        load_reports([other])
