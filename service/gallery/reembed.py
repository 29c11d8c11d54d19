"""Re-embed a gallery for another model: ``sphereface gallery reembed --model NAME``.

Vectors of different models are never compared, so after a change of model the gallery's faces
must be embedded again by the new one. Every face enrolled from a photo keeps the region around it
(:mod:`service.gallery.face_images`); this cuts the new model's crop from that region with the
stored landmarks and enrolls the new vector under the same subject and photo hash. Faces enrolled
from embeddings, or with ``SPHEREFACE_STORE_FACE_IMAGES=false``, cannot be re-embedded: they are
counted and listed so their photos can be enrolled again.

It can run while the service runs (every worker picks the new faces up from the change stream);
the old model's faces stay until deleted, so switching back needs no work.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from service.gallery.face_images import FaceRegion
from service.gallery.store import FaceRecord, GalleryStore, NewFace


@dataclass
class ReembedReport:
    model_id: str
    dry_run: bool = False
    photos: int = 0
    reembedded: int = 0
    already: int = 0
    without_image: list[str] = field(default_factory=list)
    failed: list[tuple[str, str]] = field(default_factory=list)

    def summary(self) -> str:
        lines = [
            f"{self.photos} enrolled photos: {self.reembedded} "
            f"{'to re-embed' if self.dry_run else 're-embedded'} for {self.model_id}, "
            f"{self.already} already had a face of this model, "
            f"{len(self.without_image)} without a stored image"
        ]
        if self.without_image:
            lines.append(
                "  faces without an image (enrolled from embeddings or with "
                "SPHEREFACE_STORE_FACE_IMAGES=false; enroll their photos again): "
                + ", ".join(self.without_image[:10])
                + (" ..." if len(self.without_image) > 10 else "")
            )
        for face_id, message in self.failed[:10]:
            lines.append(f"  {face_id}: {message}")
        return "\n".join(lines)


def _pending(store: GalleryStore, model_id: str, report: ReembedReport) -> Iterator[tuple[str, FaceRecord]]:
    """(subject, a face of another model with an image) for each photo the model lacks."""
    for subject_id in store.subject_ids():
        by_photo: dict[str, list[FaceRecord]] = {}
        for face in store.subject_faces(subject_id):
            by_photo.setdefault(face.photo_sha256, []).append(face)
        for faces in by_photo.values():
            report.photos += 1
            if any(f.model_id == model_id for f in faces):
                report.already += 1
                continue
            source = next((f for f in faces if f.has_region), None)
            if source is None:
                report.without_image.append(faces[0].id)
                continue
            yield subject_id, source


def reembed_gallery(
    store: GalleryStore,
    embedder,  # models.embedder.Embedder  # noqa: ANN001
    *,
    batch_size: int = 32,
    dry_run: bool = False,
    progress: bool = True,
) -> ReembedReport:
    """Embed every enrolled photo the embedder's model has no face of; see the module docstring."""
    from tqdm import tqdm

    from models.align import align_face, get_template

    manifest = embedder.manifest
    template = get_template(manifest.template)
    report = ReembedReport(model_id=manifest.model_id, dry_run=dry_run)
    batch: list[tuple[str, FaceRecord, FaceRegion, np.ndarray]] = []

    def flush() -> None:
        if not batch:
            return
        vectors = embedder.embed(np.stack([crop for *_, crop in batch]))
        items = [
            (
                subject_id,
                NewFace(
                    vector,
                    face.photo_sha256,
                    face.box,
                    face.landmarks,
                    face.detection_score,
                    region=region,
                    quality=face.quality,
                ),
            )
            for (subject_id, face, region, _), vector in zip(batch, vectors, strict=True)
        ]
        for (_, face, *_), outcome in zip(batch, store.add_faces_bulk(items, manifest.model_id), strict=True):
            if isinstance(outcome, FaceRecord):
                report.reembedded += 1
            elif getattr(outcome, "code", "") == "duplicate_photo":
                report.already += 1
            else:
                report.failed.append((face.id, getattr(outcome, "message", str(outcome))))
        batch.clear()

    bar = tqdm(desc=f"re-embed for {manifest.model_id}", unit="face", disable=not progress)
    for subject_id, face in _pending(store, manifest.model_id, report):
        if dry_run:
            report.reembedded += 1
            continue
        region = store.face_region(face.id)
        if region is None:  # deleted meanwhile
            continue
        batch.append((subject_id, face, region, align_face(region.image(), region.landmarks, template)))
        bar.update(1)
        if len(batch) == batch_size:
            flush()
    flush()
    bar.close()
    return report
