"""MTCNN face detector (Zhang et al. 2016) on ONNX Runtime: boxes, scores and 5 landmarks.

Three cascaded networks: P-Net scans an image pyramid for candidate windows, R-Net rejects and
refines them on 24x24 crops, O-Net scores them on 48x48 crops and places 5 landmarks. Between
stages, candidate boxes are regressed, squared and thinned by non-maximum suppression.

Coordinates are 0-based pixels; a box ``(x1, y1, x2, y2)`` includes both corner pixels (the
convention of the original MATLAB code, whose box widths are ``x2 - x1 + 1``). Landmarks are
``(5, 2)`` (x, y): left eye, right eye, nose, left mouth corner, right mouth corner.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image

from models.mtcnn_convert import DEFAULT_MTCNN_DIR, PIXELS_INPUT
from models.runtime import create_session, session_provider

FACE_POLICIES = ("largest", "central", "all")

#: Face-probability thresholds of P-Net, R-Net, O-Net. SphereFace's MATLAB code used 0.6/0.7/0.9;
#: O-Net's is raised to 0.95 because 0.9 passes a telephone (0.943) in a test photo, while on
#: 1,500 random LFW photos the share with a face found is 100% at both (docs/reference/face-path.md).
DEFAULT_THRESHOLDS = (0.6, 0.7, 0.95)
#: Each pyramid level is resized from an image at least this many times its size on each side
#: (MTCNNDetector._pyramid_plan): close to resizing the full photo, at a fraction of the pixels read.
PYRAMID_OVERSAMPLING = 3.0
#: Photos of fewer pixels make every level from the photo (reading them is cheap; LFW's and the
#: training sets' 250x250 photos keep exactly the pyramid they had).
PYRAMID_CASCADE_MIN_PIXELS = 1_000_000
#: Photos of at least this many pixels have their pyramid levels made and scanned by P-Net side by
#: side in threads, each level on a one-thread P-Net (MTCNNDetector._pnet_levels); on smaller ones
#: the thread hand-offs cost about what they save (docs/results/face-path.md).
PYRAMID_PARALLEL_MIN_PIXELS = 250_000
#: :meth:`MTCNNDetector.detect_largest` stops once its largest face is at least this many times,
#: on a side, the window that the next finer pyramid level would scan (P-Net's 12 pixels at that
#: level's scale): the faces left to find start from smaller windows. At 2.5 the face and its
#: landmarks were exactly a full scan's on every phone photo and on 7,697 of the 7,699 LFW photos
#: of the pairs (the other two within 2.2 px); at 1.5 (two levels fewer) 29% of LFW photos got
#: landmarks from another window (docs/results/face-path.md, "The largest face, coarse to fine").
LARGEST_FACE_MARGIN = 2.5
#: R-Net and O-Net run on chunks of this many crops in a thread of their own while the next
#: chunk is cut (MTCNNDetector._cut_and_run), when there are at least CUT_MIN_BOXES boxes: R-Net
#: on phone photos took 7.2 ms per photo with chunks of 32, 7.3 with 16 and 7.9 with 64, against
#: 10.0 in one batch; on LFW's photos (41 boxes at the median) the hand-offs cost more than they
#: save (docs/results/face-path.md).
CUT_CHUNK = 32
CUT_MIN_BOXES = 96


@dataclass
class DetectedFace:
    """One detected face.

    Attributes:
        box: ``(4,)`` float ``x1, y1, x2, y2`` in pixels of the (EXIF-rotated) photo.
        score: O-Net face probability in [0, 1].
        landmarks: ``(5, 2)`` float (x, y) pixel coordinates.
    """

    box: np.ndarray
    score: float
    landmarks: np.ndarray

    @property
    def area(self) -> float:
        return float((self.box[2] - self.box[0] + 1) * (self.box[3] - self.box[1] + 1))

    @property
    def center(self) -> np.ndarray:
        return np.array([(self.box[0] + self.box[2]) / 2, (self.box[1] + self.box[3]) / 2])


def select_faces(
    faces: Sequence[DetectedFace], policy: str, image_shape: Sequence[int]
) -> list[DetectedFace]:
    """Keep the faces a caller asked for.

    Args:
        faces: detections of one photo.
        policy: ``largest`` (biggest box), ``central`` (box centre nearest the photo centre) or
            ``all`` (every face, largest first).
        image_shape: the photo's ``(H, W, ...)``.
    """
    if policy not in FACE_POLICIES:
        raise ValueError(f"unknown face policy {policy!r}; choose one of {FACE_POLICIES}")
    if not faces:
        return []
    by_size = sorted(faces, key=lambda f: f.area, reverse=True)
    if policy == "all":
        return by_size
    if policy == "largest":
        return by_size[:1]
    centre = np.array([(image_shape[1] - 1) / 2, (image_shape[0] - 1) / 2])
    return [min(faces, key=lambda f: float(np.sum((f.center - centre) ** 2)))]


#: NMS over at most this many boxes compares every pair at once (an n x n matrix of 8 MB at
#: 1,000); more boxes go through the one-box-at-a-time loop.
NMS_MATRIX_MAX_BOXES = 1_000


def nms(boxes: np.ndarray, scores: np.ndarray, threshold: float, mode: str = "union") -> np.ndarray:
    """Greedy non-maximum suppression; returns kept indices, best score first.

    ``mode="union"`` uses intersection over union, ``"min"`` intersection over the smaller box.
    Boxes are inclusive pixel boxes ``(x1, y1, x2, y2)``. Up to :data:`NMS_MATRIX_MAX_BOXES`
    boxes, the overlaps of all pairs are computed at once and only the boxes that suppress
    another are visited (the same float operations, so the same boxes as :func:`_nms_loop`, in
    about a third of the time on phone photos); above it, :func:`_nms_loop`.
    """
    if len(boxes) == 0:
        return np.zeros(0, dtype=np.int64)
    if len(boxes) > NMS_MATRIX_MAX_BOXES:
        return _nms_loop(boxes, scores, threshold, mode)
    order = np.argsort(-scores, kind="stable")
    x1, y1, x2, y2 = (boxes[order, k] for k in range(4))
    areas = (x2 - x1 + 1) * (y2 - y1 + 1)
    w = np.maximum(0.0, np.minimum(x2[:, None], x2) - np.maximum(x1[:, None], x1) + 1)
    h = np.maximum(0.0, np.minimum(y2[:, None], y2) - np.maximum(y1[:, None], y1) + 1)
    inter = w * h
    if mode == "min":
        overlap = inter / np.minimum(areas[:, None], areas)
    else:
        overlap = inter / (areas[:, None] + areas - inter)
    # suppresses[i, j]: box i, if kept, removes the lower-ranked box j (written as the loop's
    # "not kept", so that a NaN overlap of a degenerate box suppresses in both).
    suppresses = np.triu(~(overlap <= threshold), k=1)
    kept = np.ones(len(order), dtype=bool)
    for i in np.flatnonzero(suppresses.any(axis=1)):
        if kept[i]:
            kept &= ~suppresses[i]
    return order[kept].astype(np.int64)


def _nms_loop(boxes: np.ndarray, scores: np.ndarray, threshold: float, mode: str = "union") -> np.ndarray:
    """:func:`nms` one kept box at a time (memory linear in the number of boxes)."""
    x1, y1, x2, y2 = boxes[:, 0], boxes[:, 1], boxes[:, 2], boxes[:, 3]
    areas = (x2 - x1 + 1) * (y2 - y1 + 1)
    order = np.argsort(-scores, kind="stable")
    keep = []
    while order.size:
        i = order[0]
        keep.append(i)
        rest = order[1:]
        w = np.maximum(0.0, np.minimum(x2[i], x2[rest]) - np.maximum(x1[i], x1[rest]) + 1)
        h = np.maximum(0.0, np.minimum(y2[i], y2[rest]) - np.maximum(y1[i], y1[rest]) + 1)
        inter = w * h
        if mode == "min":
            overlap = inter / np.minimum(areas[i], areas[rest])
        else:
            overlap = inter / (areas[i] + areas[rest] - inter)
        order = rest[overlap <= threshold]
    return np.asarray(keep, dtype=np.int64)


def _batched_nms(
    boxes: np.ndarray, scores: np.ndarray, groups: np.ndarray, threshold: float, mode: str = "union"
) -> np.ndarray:
    """NMS separately within each group (photo); boxes of different groups never suppress."""
    if len(boxes) == 0:
        return np.zeros(0, dtype=np.int64)
    # Shift each group far away from the others so one NMS pass keeps them apart.
    offset = (boxes[:, :4].max() + 2) * groups.astype(np.float64)
    return nms(boxes + offset[:, None], scores, threshold, mode)


def _regress(boxes: np.ndarray, reg: np.ndarray, inclusive: bool = True) -> np.ndarray:
    """Apply box regression offsets (fractions of width/height) to boxes.

    MATLAB's ``detect_face.m`` measures widths as ``x2 - x1 + 1`` after R-Net and O-Net
    (``bbreg``) but as ``x2 - x1`` after P-Net; ``inclusive=False`` is the latter.
    """
    extra = 1 if inclusive else 0
    w = boxes[:, 2] - boxes[:, 0] + extra
    h = boxes[:, 3] - boxes[:, 1] + extra
    return boxes + reg * np.stack([w, h, w, h], axis=1)


def _square(boxes: np.ndarray) -> np.ndarray:
    """Grow boxes into squares around their centres (MTCNN's ``rerec``)."""
    w = boxes[:, 2] - boxes[:, 0]
    h = boxes[:, 3] - boxes[:, 1]
    side = np.maximum(w, h)
    x1 = boxes[:, 0] + w * 0.5 - side * 0.5
    y1 = boxes[:, 1] + h * 0.5 - side * 0.5
    return np.stack([x1, y1, x1 + side, y1 + side], axis=1)


def _normalize(batch: np.ndarray) -> np.ndarray:
    """uint8 NHWC RGB -> float32 NCHW, ``(x - 127.5) / 128``."""
    x = batch.astype(np.float32)
    x -= 127.5
    x *= 0.0078125
    return np.ascontiguousarray(x.transpose(0, 3, 1, 2))


def run_mtcnn_net(session, pixels: np.ndarray) -> list[np.ndarray]:
    """Run one MTCNN network on uint8 ``(N, H, W, 3)`` RGB pixels.

    Networks converted by this version take the pixels as they are (:data:`PIXELS_INPUT`; the
    normalisation is folded into their first convolution); files converted before take
    ``"image"``, normalised float32 NCHW, which is made here.
    """
    name = session.get_inputs()[0].name
    if name == PIXELS_INPUT:
        return session.run(None, {name: np.ascontiguousarray(pixels)})
    return session.run(None, {name: _normalize(pixels)})


def _faces(boxes: np.ndarray, points: np.ndarray) -> list[DetectedFace]:
    """O-Net's rows ``x1, y1, x2, y2, score`` and landmarks as faces."""
    return [
        DetectedFace(box=box[:4].copy(), score=float(box[4]), landmarks=pts)
        for box, pts in zip(boxes, points, strict=True)
    ]


class PyramidImages:
    """One photo and the pyramid levels made from it, which crops may be cut from.

    ``plan`` is :meth:`MTCNNDetector._pyramid_plan`'s; a level not made yet is made on demand from
    the image the plan names (the pixels the eager pyramid makes). When ``cascades`` is false,
    crops are cut from the photo alone.
    """

    def __init__(self, photo: Image.Image, plan: list[tuple[float, tuple[int, int], int]], cascades: bool):
        self.photo = photo
        self.plan = plan
        self.cascades = cascades
        self._made: dict[int, Image.Image] = {0: photo}
        self._locks = [threading.Lock() for _ in range(len(plan) + 1)]

    def get(self, index: int) -> Image.Image:
        """The photo (0) or pyramid level ``index`` (1-based, largest first), made on first use.

        Thread-safe: a level wanted by two threads at once is made once (a level waits only for
        the larger image it is resized from, so the locks cannot deadlock)."""
        level = self._made.get(index)
        if level is None:
            with self._locks[index]:
                level = self._made.get(index)
                if level is None:
                    _, size, source = self.plan[index - 1]
                    level = self.get(source).resize(size, Image.Resampling.BOX)
                    self._made[index] = level
        return level

    def crop_source(self, side: int, needed: float) -> int:
        """The smallest image (its index) with ``needed`` pixels per crop pixel on each side for a
        box of ``side`` photo pixels; 0 (the photo) when none has or the photo does not cascade."""
        if not self.cascades:
            return 0
        width, height = self.photo.size
        for index in range(len(self.plan), 0, -1):
            level_width, level_height = self.plan[index - 1][1]
            if side * level_width / width >= needed and side * level_height / height >= needed:
                return index
        return 0


class MTCNNDetector:
    """Batched MTCNN on ONNX Runtime.

    Args:
        providers: execution providers in preference order (``"cpu"``, ``"cuda,cpu"``).
        weights_dir: folder with ``pnet.onnx``, ``rnet.onnx``, ``onet.onnx`` (default: the
            package's, made by ``sphereface import mtcnn``).
        min_face_size: smallest face to find, in pixels (sets the pyramid's first scale).
        thresholds: face-probability thresholds of P-Net, R-Net and O-Net, in [0, 1].
        scale_factor: ratio between pyramid levels.
        intra_op_threads: ONNX Runtime threads per operator (0: one per core).
        max_image_side: search a photo whose longer side is over this many pixels as if it were
            scaled down to it: the pyramid starts smaller, so the smallest face looked for grows to
            ``min_face_size * longer side / max_image_side``. R-Net, O-Net and the landmarks still
            work on the photo as given, at its resolution (the service gives a JPEG decoded at the
            smallest DCT scale that is at least this large: ``FacePipeline.photo_crops``). None: no
            limit.
        pyramid_oversampling: make each pyramid level from an image at least this many times its
            size (see :meth:`_pyramid_plan`); None: every level from the full photo (slower on large
            photos, the same faces and landmarks: tests/test_mtcnn.py).
        side_by_side: on the CPU with more than one thread, make and scan the pyramid levels of
            a large photo side by side, and run R-Net and O-Net on crops while more are cut, each
            network on one thread (:meth:`_pnet_levels`, :meth:`_cut_and_run`); False: one stage at
            a time, each on all ``intra_op_threads``. The same faces either way (tested); side by
            side is 1.2 to 1.3 times as fast on one phone photo (docs/results/face-path.md).
    """

    def __init__(
        self,
        providers: str | Sequence[str] = "cpu",
        *,
        weights_dir: str | Path | None = None,
        min_face_size: float = 20.0,
        thresholds: tuple[float, float, float] = DEFAULT_THRESHOLDS,
        scale_factor: float = 0.709,
        intra_op_threads: int = 0,
        allow_fallback: bool = False,
        max_image_side: int | None = None,
        pyramid_oversampling: float | None = PYRAMID_OVERSAMPLING,
        side_by_side: bool = True,
    ) -> None:
        if min_face_size < 12:
            raise ValueError("min_face_size must be at least 12 pixels (P-Net's window)")
        if not 0 < scale_factor < 1:
            raise ValueError("scale_factor must be in (0, 1)")
        weights = Path(weights_dir) if weights_dir else DEFAULT_MTCNN_DIR
        missing = [n for n in ("pnet", "rnet", "onet") if not (weights / f"{n}.onnx").is_file()]
        if missing:
            raise FileNotFoundError(
                f"MTCNN weights {missing} not found in {weights}; run "
                "`sphereface import mtcnn facenet_pytorch-2.6.0-py3-none-any.whl`"
            )
        if max_image_side is not None and max_image_side < 48:
            raise ValueError("max_image_side must be at least 48 pixels")
        self.min_face_size = float(min_face_size)
        self.max_image_side = max_image_side
        self.pyramid_oversampling = pyramid_oversampling
        self.thresholds = tuple(float(t) for t in thresholds)
        self.scale_factor = float(scale_factor)
        self.nms_thresholds = (0.5, 0.7, 0.7, 0.7)  # per scale, across scales, R-Net, O-Net
        opts = {"intra_op_threads": intra_op_threads, "allow_fallback": allow_fallback}
        self.pnet = create_session(weights / "pnet.onnx", providers, **opts)
        self.rnet = create_session(weights / "rnet.onnx", providers, **opts)
        self.onet = create_session(weights / "onet.onnx", providers, **opts)
        # Threads that make and scan pyramid levels side by side (_pnet_levels), and one that runs
        # R-Net and O-Net on crops while more are cut (_cut_and_run); started when first used.
        # They run one-thread copies of the networks, on the CPU only (what they share out is CPU
        # cores; a GPU runs one stage at a time as before).
        threads = intra_op_threads or os.cpu_count() or 1
        on_cpu = session_provider(self.pnet) == "CPUExecutionProvider"
        side_by_side = side_by_side and threads > 1 and on_cpu
        self._pool = ThreadPoolExecutor(threads, "mtcnn-level") if side_by_side else None
        self._net_thread = ThreadPoolExecutor(1, "mtcnn-net") if side_by_side else None
        self._one_thread = {"pnet": self.pnet, "rnet": self.rnet, "onet": self.onet}
        if self._pool is not None:
            one_thread = {**opts, "intra_op_threads": 1}
            self._one_thread = {
                n: create_session(weights / f"{n}.onnx", providers, **one_thread) for n in self._one_thread
            }

    @property
    def provider(self) -> str:
        return session_provider(self.pnet)

    def detect(self, image: np.ndarray) -> list[DetectedFace]:
        """Faces in one ``(H, W, 3)`` uint8 RGB photo, highest score first."""
        return self.detect_batch([image])[0]

    def detect_batch(self, images: Sequence[np.ndarray]) -> list[list[DetectedFace]]:
        """Faces in several photos (any sizes); R-Net and O-Net run once over all candidates."""
        pils = [self._as_pil(img) for img in images]
        boxes, groups, sources = self._stage_pnet(pils)
        boxes, groups = self._stage_rnet(sources, boxes, groups)
        boxes, groups, points = self._stage_onet(sources, boxes, groups)
        results: list[list[DetectedFace]] = [[] for _ in images]
        for group, face in zip(groups, _faces(boxes, points), strict=True):
            results[group].append(face)
        for faces in results:
            faces.sort(key=lambda f: f.score, reverse=True)
        return results

    def detect_largest(self, image: np.ndarray) -> list[DetectedFace]:
        """The largest face of one photo (``[]`` when there is none), searched coarse to fine.

        P-Net scans the pyramid from its smallest level (the largest faces) up. After each level
        that adds windows, R-Net and O-Net run on the windows found so far, exactly as
        :meth:`detect` runs them on all; the search stops as soon as the largest face found is
        :data:`LARGEST_FACE_MARGIN` times the next level's window on a side, since the faces left
        to find are smaller. R-Net's and O-Net's outputs are kept per box from one check to the
        next. Levels are made only when reached, so a photo with a large face skips the largest
        levels, the costly ones: 1.9 to 2.1 times as fast as a full scan on phone photos. The face
        and its landmarks are those :meth:`detect` ranks largest on all but 2 of the 7,721 photos
        measured (those 2 within 2.2 px). This is not a proof: a smaller false face inside the
        face's box that O-Net scores higher would suppress the face in a full scan (O-Net's NMS by
        intersection over the smaller box), not here.
        """
        images = self._pyramid_images(self._as_pil(image))
        plan = images.plan
        self._make_photo_levels_ahead(images)
        per_level: dict[int, np.ndarray] = {}
        memo: dict = {}  # R-Net's and O-Net's outputs per box, over the checks of this search
        faces: list[DetectedFace] = []
        for index in range(len(plan), 0, -1):
            scale = plan[index - 1][0]
            found = self._level_candidates(images.get(index), scale)
            if len(found):
                per_level[index] = found
                faces = self._refine_one(images, [per_level[k] for k in sorted(per_level)], memo)
            if faces and index > 1:
                largest = max(faces, key=lambda f: f.area)
                finer_window = 12.0 / plan[index - 2][0]
                if np.sqrt(largest.area) >= LARGEST_FACE_MARGIN * finer_window:
                    return [largest]
        return [max(faces, key=lambda f: f.area)] if faces else []

    def _make_photo_levels_ahead(self, images: PyramidImages) -> None:
        """Start making, in the detector's threads, the levels of a cascaded pyramid that are
        resized from the photo itself, smallest first.

        Those are the costly resizes (each reads the whole photo), and every level of a cascaded
        pyramid is resized from one of them or from a level that is, so the coarse-to-fine search
        needs them all even when it stops early (it did on every cascaded phone photo); made side
        by side while the search starts on the first of them. Photos that do not cascade make
        each level from the photo when it is reached, so nothing is made ahead for them."""
        if self._pool is None or not images.cascades:
            return
        for index in range(len(images.plan), 0, -1):
            if images.plan[index - 1][2] == 0:
                self._pool.submit(images.get, index)

    def _refine_one(
        self, images: PyramidImages, per_scale: list[np.ndarray], memo: dict
    ) -> list[DetectedFace]:
        """R-Net and O-Net over one photo's P-Net windows (largest level first); ``memo`` keeps
        their outputs per box from one call to the next."""
        boxes = self._across_scales(per_scale)
        groups = np.zeros(len(boxes), dtype=np.int64)
        boxes, groups = self._stage_rnet([images], boxes, groups, memo)
        boxes, groups, points = self._stage_onet([images], boxes, groups, memo)
        return _faces(boxes, points)

    def landmarks_in_box(self, image: np.ndarray, box: Sequence[float]) -> DetectedFace:
        """Run O-Net alone on a given box (e.g. a fallback region when detection found nothing).

        The box is squared first, as in the cascade; its score is O-Net's, whatever it is.
        """
        pil = self._as_pil(image)
        square = _square(np.asarray(box, dtype=np.float64)[None, :4])
        prob, reg, marks = self._run_net(self.onet, self._crops(PyramidImages(pil, [], False), square, 48))
        points = self._landmarks(square, marks)[0]
        return DetectedFace(box=_regress(square, reg)[0], score=float(prob[0]), landmarks=points)

    @staticmethod
    def _as_pil(image: np.ndarray) -> Image.Image:
        if image.ndim != 3 or image.shape[2] != 3 or image.dtype != np.uint8:
            raise ValueError(f"expected an (H, W, 3) uint8 RGB image, got {image.shape} {image.dtype}")
        return Image.fromarray(image)

    def _scales(self, height: int, width: int) -> list[float]:
        scale = 12.0 / self.min_face_size
        if self.max_image_side is not None and max(height, width) > self.max_image_side:
            scale *= self.max_image_side / max(height, width)
        side = min(height, width) * scale
        scales = []
        while side >= 12:
            scales.append(scale)
            scale *= self.scale_factor
            side *= self.scale_factor
        return scales

    def _pyramid_images(self, pil: Image.Image) -> PyramidImages:
        """The photo with its pyramid plan, no level made yet."""
        return PyramidImages(pil, self._pyramid_plan(pil), self._cascades(pil))

    def _pyramid_plan(self, pil: Image.Image) -> list[tuple[float, tuple[int, int], int]]:
        """P-Net's image pyramid, largest level first. Per level: its scale, its (width, height),
        and the index of the image it is resized from (0: the photo, k: level k, 1-based).

        Each level is a BOX (area-average) resize of the smallest image already planned, the photo
        or a level, that is at least :data:`PYRAMID_OVERSAMPLING` times as large on each side, not
        of the full photo every time: on a 12-megapixel photo that reads about 5 megapixels
        instead of 120. With ``pyramid_oversampling=None``, and for photos under
        :data:`PYRAMID_CASCADE_MIN_PIXELS`, every level comes from the photo.
        """
        width, height = pil.size
        sizes = [(width, height)]
        cascades = self._cascades(pil)
        plan = []
        for scale in self._scales(height, width):
            size = (int(np.ceil(width * scale)), int(np.ceil(height * scale)))
            source = 0
            if cascades:
                for index in range(len(sizes) - 1, -1, -1):
                    if sizes[index][0] >= self.pyramid_oversampling * size[0] and (
                        sizes[index][1] >= self.pyramid_oversampling * size[1]
                    ):
                        source = index
                        break
            sizes.append(size)
            plan.append((scale, size, source))
        return plan

    def _cascades(self, pil: Image.Image) -> bool:
        """Whether the pyramid levels of this photo are made from each other (and crops cut from them)."""
        return (
            self.pyramid_oversampling is not None and pil.size[0] * pil.size[1] >= PYRAMID_CASCADE_MIN_PIXELS
        )

    def _stage_pnet(self, pils: list[Image.Image]) -> tuple[np.ndarray, np.ndarray, list[PyramidImages]]:
        """P-Net's candidate boxes, their photo, and per photo the images its crops may be cut from
        (the photo, and its pyramid levels when it cascades)."""
        all_boxes, all_groups, sources = [], [], []
        for group, pil in enumerate(pils):
            images = self._pyramid_images(pil)
            sources.append(images)
            per_scale = [found for found in self._pnet_levels(images) if len(found)]
            if per_scale:
                boxes = self._across_scales(per_scale)
                all_boxes.append(boxes)
                all_groups.append(np.full(len(boxes), group))
        if not all_boxes:
            return np.zeros((0, 5)), np.zeros(0, dtype=np.int64), sources
        return np.concatenate(all_boxes), np.concatenate(all_groups), sources

    def _pnet_levels(self, images: PyramidImages) -> list[np.ndarray]:
        """P-Net's windows on every pyramid level of one photo (:meth:`_level_candidates`), largest
        level first.

        On a photo of :data:`PYRAMID_PARALLEL_MIN_PIXELS` or more, the levels are made and scanned
        side by side, one level per thread, each by a P-Net on one thread: the largest level on one
        core while the others run on the next one uses two cores better than every level split
        over both (P-Net alone: 20.9 -> 18.4 ms per phone photo; with the resizing, 46.7 -> 41.8 ms
        per detection, docs/results/face-path.md). The windows are the serial scan's (tested).
        """
        levels = range(1, len(images.plan) + 1)
        width, height = images.photo.size
        if self._pool is None or width * height < PYRAMID_PARALLEL_MIN_PIXELS:
            return [self._level_candidates(images.get(k), images.plan[k - 1][0]) for k in levels]

        def scan(index: int) -> np.ndarray:
            return self._level_candidates(
                images.get(index), images.plan[index - 1][0], self._one_thread["pnet"]
            )

        return list(self._pool.map(scan, levels))

    def _level_candidates(self, level: Image.Image, scale: float, pnet=None) -> np.ndarray:
        """P-Net's windows on one pyramid level after its NMS: rows ``x1, y1, x2, y2, score, reg(4)``.
        ``pnet``: the session to run (default: the detector's P-Net)."""
        prob, reg = run_mtcnn_net(pnet or self.pnet, np.asarray(level)[None])
        found = self._pnet_boxes(prob[0], reg[0], scale)
        if len(found) == 0:
            return found
        return found[nms(found[:, :4], found[:, 4], self.nms_thresholds[0])]

    def _across_scales(self, per_scale: list[np.ndarray]) -> np.ndarray:
        """One photo's windows of every level (largest level first) -> NMS across them, regressed and
        squared: rows ``x1, y1, x2, y2, score``."""
        boxes = np.concatenate(per_scale)
        boxes = boxes[nms(boxes[:, :4], boxes[:, 4], self.nms_thresholds[1])]
        refined = _square(_regress(boxes[:, :4], boxes[:, 5:9], inclusive=False))
        return np.concatenate([refined, boxes[:, 4:5]], axis=1)

    def _pnet_boxes(self, prob: np.ndarray, reg: np.ndarray, scale: float) -> np.ndarray:
        """Candidate windows of one pyramid level: rows ``x1, y1, x2, y2, score, reg(4)``."""
        stride, cell = 2, 12
        ys, xs = np.nonzero(prob >= self.thresholds[0])
        if len(ys) == 0:
            return np.zeros((0, 9))
        # MATLAB: fix((stride*(bb-1)+1)/scale) with 1-based bb and output, here made 0-based.
        x1 = np.floor((stride * xs + 1) / scale) - 1
        y1 = np.floor((stride * ys + 1) / scale) - 1
        x2 = np.floor((stride * xs + cell) / scale) - 1
        y2 = np.floor((stride * ys + cell) / scale) - 1
        return np.column_stack([x1, y1, x2, y2, prob[ys, xs], reg[:, ys, xs].T])

    def _crops(self, images: PyramidImages, boxes: np.ndarray, size: int) -> np.ndarray:
        """Cut integer boxes (zero-padded outside the photo) and resize them to ``size``.

        A box inside the photo is resampled from the smallest pyramid level that still has
        :data:`PYRAMID_OVERSAMPLING` pixels per output pixel on each side (a 400-pixel face cut
        for R-Net's 24 pixels reads 72x72 pixels, not 400x400; :meth:`PyramidImages.crop_source`);
        boxes that cross the border, and every box of a photo that does not cascade, are cut from
        the photo."""
        photo = images.photo
        width, height = photo.size
        needed = (self.pyramid_oversampling or 0.0) * size
        out = np.empty((len(boxes), size, size, 3), dtype=np.uint8)
        for i, (x1, y1, x2, y2) in enumerate(np.trunc(boxes[:, :4]).astype(np.int64)):
            index = 0
            if x1 >= 0 and y1 >= 0 and x2 < width and y2 < height:
                index = images.crop_source(min(x2 - x1, y2 - y1) + 1, needed)
            if index == 0:
                region = photo.crop((int(x1), int(y1), int(x2) + 1, int(y2) + 1))
                out[i] = np.asarray(region.resize((size, size), Image.Resampling.BOX))
            else:
                source = images.get(index)
                rx, ry = source.size[0] / width, source.size[1] / height
                area = (x1 * rx, y1 * ry, (x2 + 1) * rx, (y2 + 1) * ry)
                out[i] = np.asarray(source.resize((size, size), Image.Resampling.BOX, box=area))
        return out

    def _crops_all(self, sources: list[PyramidImages], boxes: np.ndarray, groups: np.ndarray, size: int):
        crops = np.empty((len(boxes), size, size, 3), dtype=np.uint8)
        for group in np.unique(groups):
            idx = np.nonzero(groups == group)[0]
            crops[idx] = self._crops(sources[group], boxes[idx], size)
        return crops

    @staticmethod
    def _run_net(session, crops: np.ndarray, chunk: int = 1024) -> list[np.ndarray]:
        outs = [run_mtcnn_net(session, crops[i : i + chunk]) for i in range(0, len(crops), chunk)]
        return [np.concatenate(parts) for parts in zip(*outs, strict=True)]

    def _cut_and_run(self, name: str, sources, boxes: np.ndarray, groups: np.ndarray, size: int):
        """Network ``name``'s (``"rnet"``, ``"onet"``) outputs on the ``size`` crops of ``boxes``.

        With the detector's threads and at least :data:`CUT_MIN_BOXES` boxes, the crops are cut
        here in chunks of :data:`CUT_CHUNK` while a one-thread copy of the network runs the chunks
        already cut in a thread of its own: cutting (Python and PIL, mostly holding the GIL) and
        the network (ONNX Runtime, which releases it) overlap instead of taking turns. One network
        thread, not two: two chunks at once slow the cutting more than they gain. The outputs are
        the same (tested); R-Net on phone photos took 10.0 -> 7.2 ms per photo.
        """
        if self._net_thread is None or len(boxes) < CUT_MIN_BOXES:
            return self._run_net(getattr(self, name), self._crops_all(sources, boxes, groups, size))
        net = self._one_thread[name]
        runs = [
            self._net_thread.submit(
                run_mtcnn_net,
                net,
                self._crops_all(sources, boxes[i : i + CUT_CHUNK], groups[i : i + CUT_CHUNK], size),
            )
            for i in range(0, len(boxes), CUT_CHUNK)
        ]
        return [np.concatenate(parts) for parts in zip(*(run.result() for run in runs), strict=True)]

    def _net_outputs(
        self, name: str, sources, boxes: np.ndarray, groups: np.ndarray, size: int, memo: dict | None
    ):
        """Network ``name``'s outputs on the ``size`` crops of integer ``boxes``. With ``memo`` (a
        dict kept over one photo's coarse-to-fine search), a box already run is not cut or run
        again."""
        if memo is None:
            return self._cut_and_run(name, sources, boxes, groups, size)
        keys = [
            (size, g, *b)
            for g, b in zip(groups.tolist(), boxes[:, :4].astype(np.int64).tolist(), strict=True)
        ]
        missing = np.array([i for i, key in enumerate(keys) if key not in memo], dtype=np.int64)
        if len(missing):
            outputs = self._cut_and_run(name, sources, boxes[missing], groups[missing], size)
            for row, i in enumerate(missing):
                memo[keys[i]] = [out[row] for out in outputs]
        return [np.stack([memo[key][n] for key in keys]) for n in range(len(memo[keys[0]]))]

    def _stage_rnet(self, sources, boxes: np.ndarray, groups: np.ndarray, memo: dict | None = None):
        if len(boxes) == 0:
            return boxes, groups
        boxes = np.trunc(boxes)
        prob, reg = self._net_outputs("rnet", sources, boxes, groups, 24, memo)
        keep = prob > self.thresholds[1]
        boxes, groups, reg = boxes[keep], groups[keep], reg[keep]
        boxes[:, 4] = prob[keep]
        pick = _batched_nms(boxes[:, :4], boxes[:, 4], groups, self.nms_thresholds[2])
        boxes, groups, reg = boxes[pick], groups[pick], reg[pick]
        refined = _square(_regress(boxes[:, :4], reg))
        return np.concatenate([refined, boxes[:, 4:5]], axis=1), groups

    def _stage_onet(self, sources, boxes: np.ndarray, groups: np.ndarray, memo: dict | None = None):
        if len(boxes) == 0:
            return boxes, groups, np.zeros((0, 5, 2))
        boxes = np.trunc(boxes)
        prob, reg, marks = self._net_outputs("onet", sources, boxes, groups, 48, memo)
        keep = prob > self.thresholds[2]
        boxes, groups, reg, marks = boxes[keep], groups[keep], reg[keep], marks[keep]
        points = self._landmarks(boxes, marks)
        boxes = np.concatenate([_regress(boxes[:, :4], reg), prob[keep][:, None]], axis=1)
        pick = _batched_nms(boxes[:, :4], boxes[:, 4], groups, self.nms_thresholds[3], mode="min")
        return boxes[pick], groups[pick], points[pick]

    @staticmethod
    def _landmarks(boxes: np.ndarray, marks: np.ndarray) -> np.ndarray:
        """O-Net's landmark fractions -> ``(N, 5, 2)`` pixel coordinates in the photo."""
        w = (boxes[:, 2] - boxes[:, 0] + 1)[:, None]
        h = (boxes[:, 3] - boxes[:, 1] + 1)[:, None]
        xs = boxes[:, 0:1] + w * marks[:, 0:5]
        ys = boxes[:, 1:2] + h * marks[:, 5:10]
        return np.stack([xs, ys], axis=2)
