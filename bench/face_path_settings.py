"""Settings and goals of the face-path benchmark (``bench/face_path.py``): the MTCNN settings both
detectors run with, how their faces are matched, batches and warm-up, and the goals it reads."""

from __future__ import annotations

from bench.paths import REPO

DEFAULT_MODEL = REPO / ".cache" / "models" / "mobilefacenet_casia"

# Detector settings shared by both implementations.
MIN_FACE = 20
THRESHOLDS = (0.6, 0.7, 0.9)
FACTOR = 0.709

# Goals stated for this benchmark.
GOAL_DETECT_SPEEDUP = 2.0
GOAL_LANDMARK_PX = 1.0
GOAL_EMBED_SPEEDUP = 1.5

MATCH_IOU = 0.5
EMBED_BATCHES = (1, 32)
DETECT_WARMUP = 5
EMBED_WARMUP = 5
EMBED_BATCH1_CROPS = 64
