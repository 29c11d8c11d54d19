"""LFW's files: ``pairs.txt`` (View 2 pairs in folds), ``landmarks.txt`` (5 points per image) and
the ``images/`` folder, and the features of each pair's two images."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from training.evaluation.errors import LFWDataError

PAIRS_FILE = "pairs.txt"
LANDMARKS_FILE = "landmarks.txt"
IMAGES_DIR = "images"


def image_name(name: str, number: int) -> str:
    """``("Abel_Pacheco", 1)`` -> ``"Abel_Pacheco/Abel_Pacheco_0001.jpg"`` (relative to images/)."""
    return f"{name}/{name}_{number:04d}.jpg"


def identity_of(name: str) -> str:
    """``"Abel_Pacheco/Abel_Pacheco_0001.jpg"`` -> ``"Abel_Pacheco"``."""
    return name.split("/", 1)[0]


@dataclass(frozen=True)
class LFWPairs:
    """The pairs of a protocol file.

    ``left[i]`` and ``right[i]`` are image names relative to ``images/`` (``Name/Name_NNNN.jpg``),
    ``is_same[i]`` says whether they show the same person and ``fold[i]`` is the 0-based fold.
    """

    left: tuple[str, ...]
    right: tuple[str, ...]
    is_same: np.ndarray
    fold: np.ndarray

    def __len__(self) -> int:
        return len(self.left)

    @property
    def n_folds(self) -> int:
        return int(len(np.unique(self.fold)))

    def images(self) -> list[str]:
        """Every image named by a pair, once, sorted."""
        return sorted(set(self.left) | set(self.right))

    def subset(self, pairs_per_fold: int) -> LFWPairs:
        """The first ``pairs_per_fold / 2`` same and different pairs of every fold (file order)."""
        if pairs_per_fold < 2 or pairs_per_fold % 2:
            raise ValueError(f"pairs_per_fold must be an even number >= 2, got {pairs_per_fold}")
        keep: list[int] = []
        for k in np.unique(self.fold):
            for same in (True, False):
                idx = np.flatnonzero((self.fold == k) & (self.is_same == same))
                keep.extend(idx[: pairs_per_fold // 2].tolist())
        keep.sort()
        return LFWPairs(
            left=tuple(self.left[i] for i in keep),
            right=tuple(self.right[i] for i in keep),
            is_same=self.is_same[keep],
            fold=self.fold[keep],
        )


def _read_lines(path: Path, what: str) -> list[str]:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise LFWDataError(f"{what} file {path} does not exist") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise LFWDataError(f"cannot read {what} file {path}: {exc}") from exc
    lines = text.splitlines()
    while lines and not lines[-1].strip():
        lines.pop()
    return lines


def _positive_int(text: str) -> int | None:
    return int(text) if text.isdigit() and int(text) > 0 else None


def read_pairs(path: str | Path) -> LFWPairs:
    """Parse an LFW View-2 ``pairs.txt``.

    Format: a header ``<folds>\\t<n>``, then per fold ``n`` same-person lines ``name i j`` followed
    by ``n`` different-person lines ``name1 i name2 j``.

    Raises:
        LFWDataError: the file is missing or a line is malformed (the message gives path:line).
    """
    path = Path(path)
    lines = _read_lines(path, "pairs")
    if not lines:
        raise LFWDataError(f"pairs file {path} is empty")
    header = lines[0].split()
    counts = [_positive_int(h) for h in header]
    if len(header) != 2 or None in counts:
        raise LFWDataError(
            f"{path}:1: expected the header '<folds> <pairs per class>' (e.g. '10\\t300'), got {lines[0]!r}"
        )
    n_folds, per_class = counts  # type: ignore[misc]
    body = lines[1:]
    expected = n_folds * 2 * per_class
    if len(body) != expected:
        raise LFWDataError(
            f"{path}: the header promises {n_folds} folds x {2 * per_class} pairs = {expected} pair "
            f"lines, the file has {len(body)}"
        )
    left: list[str] = []
    right: list[str] = []
    is_same = np.zeros(expected, dtype=bool)
    fold = np.zeros(expected, dtype=np.int64)
    for k, line in enumerate(body):
        lineno = k + 2
        fold[k], position = divmod(k, 2 * per_class)
        same = position < per_class
        fields = line.split()
        if same:
            ok = len(fields) == 3 and _positive_int(fields[1]) and _positive_int(fields[2])
            if not ok:
                raise LFWDataError(
                    f"{path}:{lineno}: expected a same-person line 'name i j' (fold {fold[k] + 1}, "
                    f"pair {position + 1}), got {line!r}"
                )
            left.append(image_name(fields[0], int(fields[1])))
            right.append(image_name(fields[0], int(fields[2])))
        else:
            ok = len(fields) == 4 and _positive_int(fields[1]) and _positive_int(fields[3])
            if not ok:
                raise LFWDataError(
                    f"{path}:{lineno}: expected a different-person line 'name1 i name2 j' "
                    f"(fold {fold[k] + 1}, pair {position + 1}), got {line!r}"
                )
            left.append(image_name(fields[0], int(fields[1])))
            right.append(image_name(fields[2], int(fields[3])))
        is_same[k] = same
    return LFWPairs(left=tuple(left), right=tuple(right), is_same=is_same, fold=fold)


def read_landmarks(path: str | Path) -> dict[str, np.ndarray]:
    """Parse ``landmarks.txt``: ``Name/Name_NNNN.jpg x1 y1 ... x5 y5`` per line (tab-separated).

    Returns:
        image name (relative to ``images/``) -> ``(5, 2)`` float64 landmarks (x, y), in the order
        left eye, right eye, nose, left mouth corner, right mouth corner.

    Raises:
        LFWDataError: the file is missing, a line is malformed or an image is listed twice.
    """
    path = Path(path)
    lines = _read_lines(path, "landmarks")
    out: dict[str, np.ndarray] = {}
    for k, line in enumerate(lines):
        lineno = k + 1
        fields = line.split()
        if len(fields) != 11:
            raise LFWDataError(
                f"{path}:{lineno}: expected 'Name/Name_NNNN.jpg' and 10 coordinates (11 fields), "
                f"got {len(fields)} fields: {line!r}"
            )
        try:
            values = np.array([float(v) for v in fields[1:]], dtype=np.float64)
        except ValueError:
            raise LFWDataError(f"{path}:{lineno}: coordinates must be numbers, got {line!r}") from None
        if not np.all(np.isfinite(values)):
            raise LFWDataError(f"{path}:{lineno}: coordinates must be finite, got {line!r}")
        if fields[0] in out:
            raise LFWDataError(f"{path}:{lineno}: {fields[0]} is listed twice")
        out[fields[0]] = values.reshape(5, 2)
    if not out:
        raise LFWDataError(f"landmarks file {path} is empty")
    return out


def require_images(data_dir: Path) -> Path:
    """``data_dir/images``; LFWDataError when ``data_dir`` has no such folder."""
    images = data_dir / IMAGES_DIR
    if not images.is_dir():
        raise LFWDataError(f"{data_dir} is not an LFW folder: {images} is missing")
    return images


def load_pairs(data_dir: Path, pairs_per_fold: int | None = None) -> LFWPairs:
    """The pairs of an LFW folder (checked to have ``images/``), the first ``pairs_per_fold`` of
    each fold when given (:meth:`LFWPairs.subset`)."""
    require_images(data_dir)
    pairs = read_pairs(data_dir / PAIRS_FILE)
    return pairs if pairs_per_fold is None else pairs.subset(pairs_per_fold)


def pair_features(
    features: np.ndarray, names: Sequence[str], pairs: LFWPairs
) -> tuple[np.ndarray, np.ndarray]:
    """Rows of ``features`` (one per name) for the left and right image of every pair."""
    index = {name: i for i, name in enumerate(names)}
    return features[[index[n] for n in pairs.left]], features[[index[n] for n in pairs.right]]
