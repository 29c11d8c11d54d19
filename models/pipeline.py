"""The whole face path in one object: photo -> faces -> aligned crops -> embeddings.

Dataset preparation, evaluation and the service call this (or its parts) so every face is cut
the same way (a face cut differently for training, evaluation and serving costs accuracy).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from models.align import align_faces, get_template, similarity_transform
from models.embedder import Embedder
from models.errors import MultipleFacesError, NoFaceError
from models.image import JPEG_REDUCTIONS, DecodedPhoto
from models.mtcnn import DEFAULT_THRESHOLDS, DetectedFace, MTCNNDetector, select_faces

#: What to do with a photo that shows several faces when one is expected.
MULTIPLE_FACE_POLICIES = ("reject", "largest", "central", "all")
#: How policy ``largest`` finds its face: ``coarse-to-fine`` stops scanning the pyramid once the
#: faces left to find are smaller (:meth:`models.mtcnn.MTCNNDetector.detect_largest`, 1.9 to 2.7
#: times as fast on phone photos, the same face and landmarks on all but 2 of 7,721 photos
#: measured); ``full`` detects every face and keeps the largest.
LARGEST_FACE_SEARCHES = ("coarse-to-fine", "full")


@dataclass
class PhotoCrops:
    """The faces of a decoded photo and their aligned crops.

    Attributes:
        faces: the faces chosen, box and landmarks in pixels of the full-size photo.
        crops: ``(N, H, W, 3)`` uint8 aligned crops, one per face.
        source: the decode the crops were cut from (the photo as decoded, or decoded again at a
            finer scale); :meth:`models.image.DecodedPhoto.from_full` maps the faces into it.
    """

    faces: list[DetectedFace]
    crops: np.ndarray
    source: DecodedPhoto


@dataclass
class EmbeddedFace:
    """A detected face with its fused, L2-normalised embedding (cosine = dot product)."""

    face: DetectedFace
    embedding: np.ndarray


def faces_to_full(photo: DecodedPhoto, faces: list[DetectedFace]) -> list[DetectedFace]:
    """Faces detected on a (possibly reduced) decode, in pixels of the full-size photo.

    MTCNN's landmarks are ``x1 + fraction * (x2 - x1 + 1)`` of crops cut from pixel x1's left edge
    to x2's right edge: measured from pixel edges, they scale about the image's corner, half a
    pixel off the pixel-centre mapping (which put them 0.5 px off the full decode's on LFW at 1/2).
    """
    return [
        DetectedFace(
            box=photo.box_to_full(f.box), score=f.score, landmarks=photo.to_full(f.landmarks - 0.5) + 0.5
        )
        for f in faces
    ]


class FacePipeline:
    """Detector + alignment + embedder for one model folder.

    Args:
        model_dir: folder with ``model.onnx`` and ``manifest.json``.
        providers: ONNX Runtime providers for both networks, e.g. ``"cpu"`` or ``"cuda,cpu"``.
        min_face_size: smallest face to detect, pixels.
        thresholds: MTCNN stage thresholds.
        intra_op_threads: ONNX Runtime threads per operator (0: one per core).
        max_image_side: detect in large photos as if their longer side were this long (see
            :class:`models.mtcnn.MTCNNDetector`); None: full resolution.
        largest_face_search: how policy ``largest`` finds its face (:data:`LARGEST_FACE_SEARCHES`).
    """

    def __init__(
        self,
        model_dir: str | Path,
        providers: str | Sequence[str] = "cpu",
        *,
        min_face_size: float = 20.0,
        thresholds: tuple[float, float, float] = DEFAULT_THRESHOLDS,
        intra_op_threads: int = 0,
        batch_size: int = 32,
        max_image_side: int | None = None,
        largest_face_search: str = "coarse-to-fine",
    ) -> None:
        if largest_face_search not in LARGEST_FACE_SEARCHES:
            raise ValueError(
                f"unknown largest_face_search {largest_face_search!r}; choose one of {LARGEST_FACE_SEARCHES}"
            )
        self.largest_face_search = largest_face_search
        self.embedder = Embedder(
            model_dir, providers, batch_size=batch_size, intra_op_threads=intra_op_threads
        )
        self.detector = MTCNNDetector(
            providers,
            min_face_size=min_face_size,
            thresholds=thresholds,
            intra_op_threads=intra_op_threads,
            max_image_side=max_image_side,
        )
        self.template = get_template(self.embedder.manifest.template)

    @property
    def manifest(self):
        return self.embedder.manifest

    def faces(self, image: np.ndarray, policy: str = "all") -> list[EmbeddedFace]:
        """Detect, select (see :data:`MULTIPLE_FACE_POLICIES`), align and embed faces of a photo.

        Raises:
            NoFaceError: no face was found.
            MultipleFacesError: several faces and ``policy="reject"``.
        """
        chosen, crops = self.crops(image, policy)
        embeddings = self.embedder.embed(crops)
        return [EmbeddedFace(face=f, embedding=e) for f, e in zip(chosen, embeddings, strict=True)]

    def crops(self, image: np.ndarray, policy: str = "all") -> tuple[list[DetectedFace], np.ndarray]:
        """Detect and select faces as :meth:`faces` does, and return them with their aligned crops
        (uint8, N x H x W x 3), so crops of many photos can be embedded in one batch."""
        chosen = self._find(image, policy)
        return chosen, align_faces(image, np.stack([f.landmarks for f in chosen]), self.template)

    @property
    def decode_side(self) -> int | None:
        """The longer side a photo needs to be decoded at for detection (the detector's
        ``max_image_side``; None: full size): :func:`models.image.decode_photo`'s ``min_side``."""
        return self.detector.max_image_side

    def photo_crops(
        self, photo: DecodedPhoto, policy: str = "all", *, min_face_side: float = 0.0
    ) -> PhotoCrops:
        """:meth:`crops` of a photo that may be decoded at a reduced scale.

        Faces are detected on the photo as decoded: with :attr:`decode_side` or more pixels on its
        longer side, the detector's pyramid is the one it makes of the full photo. Crops are cut from it
        when it has at least as many pixels across every chosen face as the crop has (the warp
        only shrinks) and at least ``min_face_side`` pixels on each face box's longer side;
        otherwise the photo is decoded again at the coarsest scale that has them (full size at
        most). The project's rule, so that a large photo costs a reduced decode and a small face
        in it is still cut from the pixels it has.

        Raises:
            NoFaceError, MultipleFacesError: as :meth:`faces`.
        """
        found = self._find(photo.image, policy)
        source = photo.finer(self._reduction_for(found, photo.reduction, min_face_side))
        faces = faces_to_full(photo, found)
        points = source.from_full(np.stack([f.landmarks for f in faces]))  # cut as the full decode's
        return PhotoCrops(faces, align_faces(source.image, points, self.template), source)

    def _reduction_for(self, faces: list[DetectedFace], reduction: int, min_face_side: float) -> int:
        """The coarsest DCT scale (at most ``reduction``) whose pixels cover every face's crop and
        ``min_face_side``; faces are in pixels of a decode at ``reduction``."""
        template = self.template.as_array()
        need = 1.0  # decoded pixels wanted per pixel of this decode, on each side
        for face in faces:
            matrix = similarity_transform(np.asarray(face.landmarks, np.float64), template)
            need = max(need, float(np.hypot(matrix[0, 0], matrix[1, 0])))
            side = max(face.box[2] - face.box[0], face.box[3] - face.box[1]) + 1
            need = max(need, min_face_side / max(float(side), 1e-6))
        for finer in (*JPEG_REDUCTIONS, 1):
            if finer <= reduction and reduction / finer >= need:
                return finer
        return 1

    def _find(self, image: np.ndarray, policy: str) -> list[DetectedFace]:
        """The faces of ``image`` that ``policy`` chooses (see :meth:`faces` for the errors)."""
        if policy not in MULTIPLE_FACE_POLICIES:
            raise ValueError(f"unknown policy {policy!r}; choose one of {MULTIPLE_FACE_POLICIES}")
        if policy == "largest" and self.largest_face_search == "coarse-to-fine":
            found = self.detector.detect_largest(image)
        else:
            found = self.detector.detect(image)
        if not found:
            raise NoFaceError("no face was found in the photo")
        if policy == "reject":
            if len(found) > 1:
                raise MultipleFacesError(
                    f"the photo shows {len(found)} faces; send a photo of one face, "
                    "or ask for its largest or most central face (policy largest or central)"
                )
            return found
        return select_faces(found, policy, image.shape)

    def embed_aligned(self, crops: np.ndarray) -> np.ndarray:
        """Embed crops that are already aligned to the model's template."""
        return self.embedder.embed(crops)
