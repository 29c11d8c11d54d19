"""The GPU check's pack: aligned training crops and an LFW subset as JPEG, small enough to carry.

A lent GPU machine sees the checkout and nothing beside it, and what travels is limited to 64 MiB
(the checkout is about 17 MB of it). So the data the GPU check (``bench/gpu_check.py``) needs is
packed here, on the CPU machine, into one ignored folder (default ``.cache/gpu-pack``, at most
``--max-mib`` 40 MiB)::

    pack.json            what is in it: faces, identities, template, JPEG quality, LFW subset, bytes
    faces.txt            one "faces/<label>/<row>.jpg <label>" line per crop
    faces/<label>/*.jpg  aligned 112x96 training crops (a prepared folder's rows, JPEG quality 90)
    lfw/<i>.jpg          the images of an LFW subset, aligned with landmarks.txt
    lfw/pairs.json       its pairs: image indices, same/different, fold

Whole identities are packed in label order until the size budget is reached. On the GPU machine
:func:`unpack` decodes the crops once into a prepared folder (``sphereface prepare``'s format),
which the trainer and its loaders read as usual; the JPEG files themselves feed the plain
``DataLoader`` + PIL baseline. The training configs are not packed: they travel with the checkout.

    .venv/bin/python bench/gpu_pack.py --data .cache/data/celeba_faces --lfw ../shared/data/lfw \\
        --out .cache/gpu-pack
    .venv/bin/python bench/gpu_pack.py --synthetic 600 --out /tmp/pack   # random faces, for tests
"""

from __future__ import annotations

import argparse
import io
import json
import shutil
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]
# First, also under PYTHONPATH=.: the script's own folder holds a bench/models.py that would hide models/.
sys.path.insert(0, str(ROOT))

PACK_FORMAT = "sphereface_gpu_pack"
PACK_VERSION = 1
PACK_FILE = "pack.json"
FACES_LIST = "faces.txt"
DEFAULT_QUALITY = 90
DEFAULT_MAX_MIB = 40.0
#: Pairs per LFW fold kept in the pack (10 folds: 600 pairs, about 1,100 images, 4 MB).
DEFAULT_PAIRS_PER_FOLD = 60
CROP_SHAPE = (112, 96, 3)
#: Bytes of a crop's line in faces.txt (counted into the size budget with its JPEG).
LIST_LINE_BYTES = 32


@dataclass
class Pack:
    """A pack, read: the crops' JPEG files and labels, and the LFW subset when there is one."""

    path: Path
    info: dict[str, Any]
    files: list[Path]
    labels: np.ndarray  # (N,) int64

    @property
    def identities(self) -> list[str]:
        return list(self.info["identities"])

    @property
    def has_lfw(self) -> bool:
        return self.info.get("lfw") is not None


def _jpeg(image: np.ndarray, quality: int) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(image).save(buffer, format="JPEG", quality=quality)
    return buffer.getvalue()


def _start_folder(out: Path) -> None:
    """Empty ``out`` for a new pack; refuse a folder that holds anything but an earlier pack."""
    if out.exists():
        if any(out.iterdir()) and not (out / PACK_FILE).is_file():
            raise SystemExit(f"{out} exists and is not a GPU-check pack: choose another --out")
        shutil.rmtree(out)
    out.mkdir(parents=True)


def _write_lfw(out: Path, crops: np.ndarray, names: list[str], pairs: dict[str, Any], quality: int) -> int:
    """The LFW subset's crops and pairs; returns the bytes written."""
    folder = out / "lfw"
    folder.mkdir()
    written = 0
    for i, crop in enumerate(crops):
        data = _jpeg(crop, quality)
        (folder / f"{i:05d}.jpg").write_bytes(data)
        written += len(data)
    text = json.dumps({"names": names, **pairs}) + "\n"
    (folder / "pairs.json").write_text(text)
    return written + len(text)


def _write_faces(
    out: Path, images: np.ndarray, labels: np.ndarray, quality: int, budget: int
) -> tuple[list[str], int, int]:
    """Crops of whole identities in label order while they fit in ``budget`` bytes.

    Returns the ``faces.txt`` lines, the number of identities kept and the bytes written (with
    their lines of ``faces.txt``).
    """
    lines: list[str] = []
    written = 0
    kept = 0
    for label in np.unique(labels):
        rows = np.flatnonzero(labels == label)
        encoded = [_jpeg(images[r], quality) for r in rows]
        size = sum(len(e) + LIST_LINE_BYTES for e in encoded)
        if written + size > budget:
            break
        folder = out / "faces" / f"{kept:05d}"
        folder.mkdir(parents=True)
        for row, data in zip(rows, encoded, strict=True):
            name = f"faces/{kept:05d}/{row:06d}.jpg"
            (out / name).write_bytes(data)
            lines.append(f"{name} {kept}")
        written += size
        kept += 1
    return lines, kept, written


def write_pack(
    out: str | Path,
    images: np.ndarray,
    labels: np.ndarray,
    identities: list[str],
    *,
    source: str,
    template: str,
    lfw: tuple[np.ndarray, list[str], dict[str, Any]] | None = None,
    quality: int = DEFAULT_QUALITY,
    max_mib: float = DEFAULT_MAX_MIB,
) -> dict[str, Any]:
    """Write a pack of ``images`` ``(N, 112, 96, 3)`` uint8 with ``labels`` (indices into
    ``identities``) and an optional LFW subset ``(crops, names, pairs)``; returns ``pack.json``.

    The LFW subset is written first; the crops then fill what is left of ``max_mib`` MiB, whole
    identities at a time (identities are re-numbered ``0..C-1`` in the order kept).
    """
    out = Path(out)
    _start_folder(out)
    budget = int(max_mib * 2**20)
    lfw_bytes = _write_lfw(out, *lfw, quality) if lfw is not None else 0
    lines, kept, _ = _write_faces(out, images, labels, quality, budget - lfw_bytes - 16384)
    if not lines:
        raise SystemExit(f"not one identity's crops fit in {max_mib} MiB")
    (out / FACES_LIST).write_text("\n".join(lines) + "\n")
    kept_labels = [int(label) for label in np.unique(labels)[:kept]]
    info = {
        "format": PACK_FORMAT,
        "version": PACK_VERSION,
        "created": datetime.now(UTC).isoformat(timespec="seconds"),
        "source": source,
        "template": template,
        "image_shape": list(CROP_SHAPE),
        "jpeg_quality": quality,
        "faces": len(lines),
        "faces_left_out": int(len(labels) - len(lines)),
        "identities": [identities[label] for label in kept_labels],
        "lfw": None if lfw is None else {"images": len(lfw[0]), "pairs": len(lfw[2]["is_same"])},
    }
    (out / PACK_FILE).write_text(json.dumps(info, indent=1) + "\n")
    info["bytes"] = folder_bytes(out) + 32  # with the field itself
    (out / PACK_FILE).write_text(json.dumps(info, indent=1) + "\n")
    if info["bytes"] > budget:
        raise SystemExit(f"{out} holds {info['bytes'] / 2**20:.1f} MiB, more than --max-mib {max_mib}")
    return info


def folder_bytes(path: str | Path) -> int:
    """Bytes of every file under ``path`` (what the device tool carries)."""
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())


# --------------------------------------------------------------------------------------------
# Sources: a prepared folder and LFW, or synthetic faces
# --------------------------------------------------------------------------------------------


def lfw_subset(lfw_dir: str | Path, pairs_per_fold: int) -> tuple[np.ndarray, list[str], dict[str, Any]]:
    """LFW's first ``pairs_per_fold`` pairs of every fold, aligned with ``landmarks.txt``."""
    from training.evaluation.lfw import aligned_lfw_crops

    crops, names, pairs = aligned_lfw_crops(lfw_dir, pairs_per_fold, landmarks="file", workers=2)
    index = {name: i for i, name in enumerate(names)}
    return (
        crops,
        names,
        {
            "left": [index[n] for n in pairs.left],
            "right": [index[n] for n in pairs.right],
            "is_same": [bool(s) for s in pairs.is_same],
            "fold": [int(f) for f in pairs.fold],
            "landmarks": "file",
        },
    )


def synthetic_crops(labels: np.ndarray, identities: int, seed: int = 0) -> np.ndarray:
    """Random ``(len(labels), 112, 96, 3)`` uint8 "faces": one smooth pattern per identity plus noise.

    Not faces: they let the check run its machinery (and a network tell the classes apart a
    little) without any data set.
    """
    rng = np.random.default_rng(seed)
    coarse = rng.uniform(0, 255, size=(identities, 14, 12, 3))
    patterns = coarse.repeat(8, axis=1).repeat(8, axis=2)
    noise = rng.normal(0, 24, size=(len(labels), *CROP_SHAPE))
    return np.clip(patterns[labels] + noise, 0, 255).astype(np.uint8)


def synthetic_faces(faces: int, identities: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """``faces`` synthetic crops of ``identities`` classes (:func:`synthetic_crops`), label-sorted."""
    labels = np.sort(np.random.default_rng(seed).integers(0, identities, size=faces)).astype(np.int64)
    return (
        synthetic_crops(labels, identities, seed),
        labels,
        [f"synthetic_{i:04d}" for i in range(identities)],
    )


def synthetic_lfw(pairs_per_fold: int, seed: int = 1) -> tuple[np.ndarray, list[str], dict[str, Any]]:
    """A stand-in for the LFW subset: 10 folds of pairs of synthetic crops, two crops per identity;
    a same pair is an identity's two crops, a different pair one crop of each of two identities."""
    n_pairs = 10 * pairs_per_fold
    crops = synthetic_crops(np.repeat(np.arange(n_pairs), 2), n_pairs, seed)
    is_same = np.tile(np.repeat([True, False], pairs_per_fold // 2), 10)
    left = np.arange(0, 2 * n_pairs, 2)
    right = np.where(is_same, left + 1, np.roll(left, 1) + 1)
    return (
        crops,
        [f"synthetic_{i:05d}.jpg" for i in range(len(crops))],
        {
            "left": left.tolist(),
            "right": right.tolist(),
            "is_same": is_same.tolist(),
            "fold": np.repeat(np.arange(10), pairs_per_fold).tolist(),
            "landmarks": "synthetic",
        },
    )


# --------------------------------------------------------------------------------------------
# Reading a pack (on the GPU machine)
# --------------------------------------------------------------------------------------------


def read_pack(path: str | Path) -> Pack:
    """A pack folder written by :func:`write_pack` (``SystemExit`` with what to do if it is not)."""
    path = Path(path)
    try:
        info = json.loads((path / PACK_FILE).read_text())
    except FileNotFoundError:
        raise SystemExit(
            f"{path} holds no {PACK_FILE}: build the pack on the CPU machine first (make gpu-pack) and "
            "name it in the device tool's carry"
        ) from None
    if info.get("format") != PACK_FORMAT or info.get("version") != PACK_VERSION:
        raise SystemExit(f"{path / PACK_FILE} is not a version-{PACK_VERSION} GPU-check pack")
    files, labels = [], []
    for line in (path / FACES_LIST).read_text().splitlines():
        name, label = line.rsplit(" ", 1)
        files.append(path / name)
        labels.append(int(label))
    return Pack(path, info, files, np.asarray(labels, dtype=np.int64))


def decode(path: Path) -> np.ndarray:
    """One JPEG as ``(H, W, 3)`` uint8 RGB."""
    with Image.open(path) as image:
        return np.asarray(image.convert("RGB"), dtype=np.uint8)


def decode_all(paths: list[Path], workers: int = 8) -> np.ndarray:
    """Every JPEG of ``paths`` decoded, ``(N, H, W, 3)`` uint8, in order (PIL in ``workers`` threads)."""
    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        return np.stack(list(pool.map(decode, paths, chunksize=64)))


def lfw_of(pack: Pack, workers: int = 8) -> tuple[np.ndarray, dict[str, Any]]:
    """The LFW subset's crops ``(n, 112, 96, 3)`` uint8 and its pairs (``pairs.json``)."""
    folder = pack.path / "lfw"
    pairs = json.loads((folder / "pairs.json").read_text())
    crops = decode_all([folder / f"{i:05d}.jpg" for i in range(len(pairs["names"]))], workers)
    return crops, pairs


def unpack(pack: Pack, out: str | Path, shard_size: int = 2048, workers: int = 8) -> Path:
    """Decode the pack's crops into a prepared folder (``sphereface prepare``'s format) at ``out``."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    images = decode_all(pack.files, workers)
    shards = []
    for k, a in enumerate(range(0, len(images), shard_size)):
        names = {"images": f"images_{k:05d}.npy", "labels": f"labels_{k:05d}.npy"}
        np.save(out / names["images"], images[a : a + shard_size])
        np.save(out / names["labels"], pack.labels[a : a + shard_size].astype(np.int32))
        count = len(images[a : a + shard_size])
        shards.append({**names, "count": count, "photos": count})
    (out / "manifest.json").write_text(json.dumps(_manifest(pack, shards, time.perf_counter() - started)))
    return out


def _manifest(pack: Pack, shards: list[dict[str, Any]], seconds: float) -> dict[str, Any]:
    from training.prepare import FORMAT_NAME, FORMAT_VERSION

    identities = pack.identities
    counts = np.bincount(pack.labels, minlength=len(identities))
    return {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "source": f"GPU-check pack of {pack.info['source']}",
        "template": pack.info["template"],
        "image_shape": pack.info["image_shape"],
        "image_dtype": "uint8",
        "label_dtype": "int32",
        "color": "RGB",
        "identities": identities,
        "num_classes": len(identities),
        "num_images": len(pack.labels),
        "num_photos": len(pack.labels),
        "identity_counts": {name: int(c) for name, c in zip(identities, counts, strict=True)},
        "dropped_identities": [],
        "excluded_identities": [],
        "shard_size": shards[0]["count"],
        "shards": shards,
        "num_skipped": 0,
        "skipped_by_reason": {},
        "skipped": [],
        "detector": {"name": "none (decoded from the pack's JPEGs)", "face_policy": "central", "workers": 1},
        "elapsed_seconds": seconds,
        "photos_processed": len(pack.labels),
    }


# --------------------------------------------------------------------------------------------
# The command
# --------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    raw = argparse.RawDescriptionHelpFormatter
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=raw)
    ap.add_argument("--data", default=".cache/data/celeba_faces", help="a sphereface prepare folder")
    ap.add_argument("--lfw", default="../shared/data/lfw", help="LFW folder ('' to leave LFW out)")
    ap.add_argument("--out", default=".cache/gpu-pack")
    ap.add_argument("--pairs-per-fold", type=int, default=DEFAULT_PAIRS_PER_FOLD)
    ap.add_argument("--quality", type=int, default=DEFAULT_QUALITY, help="JPEG quality")
    ap.add_argument("--max-mib", type=float, default=DEFAULT_MAX_MIB, help="size limit of the pack")
    ap.add_argument("--synthetic", type=int, default=0, help="pack this many random faces instead (tests)")
    ap.add_argument("--identities", type=int, default=20, help="identities of the synthetic faces")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    if args.synthetic:
        images, labels, identities = synthetic_faces(args.synthetic, args.identities)
        lfw = synthetic_lfw(args.pairs_per_fold) if args.pairs_per_fold else None
        source, template = f"{args.synthetic} synthetic faces", "sphereface_112x96"
    else:
        from training.prepare import load_prepared

        data = load_prepared(args.data)
        images, labels = data.concatenate()
        identities, source = data.identities, str(args.data)
        template = str(data.manifest.get("template"))
        lfw = lfw_subset(args.lfw, args.pairs_per_fold) if args.lfw and args.pairs_per_fold else None
    info = write_pack(
        args.out, images, labels, identities, source=source, template=template, lfw=lfw,
        quality=args.quality, max_mib=args.max_mib,
    )  # fmt: skip
    size = folder_bytes(args.out)
    lfw_text = f", LFW {info['lfw']['pairs']} pairs of {info['lfw']['images']} images" if info["lfw"] else ""
    print(
        f"{args.out}: {info['faces']:,} crops of {len(info['identities'])} identities{lfw_text}, "
        f"{size / 2**20:.1f} MiB on disk, in {time.perf_counter() - started:.0f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
