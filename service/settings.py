"""Service settings from flags or environment variables (prefix ``SPHEREFACE_``)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

from pydantic import AliasChoices, Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from models.image import MAX_IMAGE_BYTES, MAX_IMAGE_PIXELS
from service.errors import RedisSetupError
from service.events.delivery import RetryPolicy
from service.events.webhooks import WebhookEndpoint, parse_webhooks


class Settings(BaseSettings):
    """Every setting can be given as ``SPHEREFACE_<NAME>`` in the environment."""

    model_config = SettingsConfigDict(env_prefix="SPHEREFACE_", protected_namespaces=())

    host: str = "127.0.0.1"
    port: int = 8000
    model: str = Field(
        "default",
        validation_alias=AliasChoices("SPHEREFACE_MODEL", "SPHEREFACE_MODEL_DIR", "model", "model_dir"),
        description="a model name (`sphereface models` lists them; `default`: dlib_resnet_v1) or folder",
    )
    providers: str = Field("cpu", description="ONNX Runtime providers, e.g. 'cuda,cpu'")
    intra_op_threads: int = 0
    min_face_size: float = Field(20.0, ge=12)
    detect_max_side: int | None = Field(
        1024,
        ge=48,
        description="detect in photos with a longer side over this as if scaled down to it (faster; "
        "faces under min_face_size * side / detect_max_side are not looked for; a JPEG is decoded at "
        "the smallest DCT scale, 1/2 to 1/8, still this large); null: full size",
    )
    largest_face_search: Literal["coarse-to-fine", "full"] = Field(
        "coarse-to-fine",
        description="how a request for the largest face (verify's default) finds it: coarse-to-fine "
        "stops scanning once the faces left are smaller (about 2x faster on phone photos; the same "
        "face and landmarks on all but 2 of 7,721 photos measured); full: detect every face, keep "
        "the largest",
    )
    min_quality: float = Field(
        0.8,
        ge=0,
        le=1,
        description="enrollment refuses a face whose quality (in [0, 1]: the estimated probability "
        "that it is recognised at a false match rate of 1e-3) is under this, with low_quality "
        "(422) and the reason (too_small, blurred, turned_away, unclear_face); 0: enroll every face",
    )
    max_upload_bytes: int = Field(MAX_IMAGE_BYTES, gt=0, description="per photo")
    max_image_pixels: int = Field(MAX_IMAGE_PIXELS, gt=0)
    max_photos_per_request: int = Field(16, gt=0)

    # -- gallery and Redis ------------------------------------------------------------------
    redis_url: str | None = Field(
        None,
        validation_alias=AliasChoices("SPHEREFACE_REDIS_URL", "REDIS_URL", "redis_url"),
        description="Redis to keep the gallery in; unset: `sphereface serve` starts a local redis-server",
    )
    redis_cluster: str | None = Field(
        None,
        validation_alias=AliasChoices("SPHEREFACE_REDIS_CLUSTER", "redis_cluster"),
        description="a Redis Cluster to keep the gallery in, as HOST:PORT[,HOST:PORT...] (some of its "
        "nodes; the client learns the rest): the gallery is split into 64 hash-tagged partitions "
        "spread over the primaries. Not together with redis_url",
    )
    data_dir: Path = Field(Path(".sphereface"), description="local redis-server data (AOF) and admin key")
    redis_prefix: str = Field("sf:", description="prefix of every key the service writes")
    redis_timeout: float = Field(
        1.0,
        gt=0,
        le=60,
        description="seconds to wait for Redis to connect or answer one command; a stalled Redis then "
        "makes keyed requests answer 503 redis_unavailable (and /readyz within half of it, at most 0.5 s)",
    )
    redis_wait_replicas: int | None = Field(
        None,
        ge=0,
        le=16,
        description="replicas that must confirm a gallery write (Redis WAIT on the node that took it) "
        "before it is acknowledged; fewer within redis_wait_ms answer 503 not_replicated. Unset: 1 "
        "when the Redis (on a cluster: any primary) has a replica, else 0; 0: off",
    )
    redis_wait_ms: int = Field(
        500,
        gt=0,
        le=60_000,
        description="milliseconds a write waits for redis_wait_replicas replicas, at most half of "
        "redis_timeout (a longer WAIT would be taken for a stalled Redis)",
    )
    redis_retry_seconds: float = Field(
        2.0,
        ge=0,
        le=60,
        description="on a Redis Cluster, how long the gallery's reads and writes are retried (with "
        "back-off) while a slot migrates (MOVED, ASK, TRYAGAIN) or a failover runs (CLUSTERDOWN, a "
        "lost primary) before they answer 503 redis_unavailable; 0: not retried",
    )
    search: Literal["numpy", "redis"] = Field(
        "numpy", description="identification search: in-process numpy (exact) or Redis Query Engine KNN"
    )
    gallery_snapshots: str | None = Field(
        None,
        description="folder (best in /dev/shm) where the workers of one machine share the gallery's "
        "vectors as memory-mapped snapshots: one copy per machine instead of one per worker "
        "(numpy search only). Unset: `sphereface serve --workers N` (N > 1) picks one by itself; "
        "`off`: every worker keeps its own copy",
    )
    identify_top_k: int = Field(5, ge=1, le=100)
    identify_aggregation: Literal["max", "mean", "quality-mean", "quality-max"] = Field(
        "max",
        description="a subject's score in identification: max (its best face), mean (of the cosines "
        "of all its faces), quality-mean (weighted by each face's quality), quality-max (each cosine "
        "pulled towards the mean as its face's quality falls); ?aggregation= overrides it",
    )
    store_face_images: bool = Field(
        True,
        description="keep a JPEG of the region around each enrolled face (about 20 KB): thumbnails, "
        "and `sphereface gallery reembed` for another model. The photo itself is never stored",
    )
    max_faces_per_subject: int = Field(1000, gt=0)
    max_request_bytes: int = Field(64 * 1024 * 1024, gt=0, description="whole request body")
    max_bulk_items: int = Field(256, gt=0, description="photos per bulk enrollment request")

    # -- back-pressure ----------------------------------------------------------------------
    max_face_requests: int | None = Field(
        None,
        ge=1,
        description="face-path requests (verify, embed, identify, enroll) detecting and embedding at "
        "once per worker (a request waiting on Redis holds no turn); null: one per CPU core, at least 2",
    )
    max_queued_requests: int | None = Field(
        None,
        ge=0,
        description="face-path requests waiting for a turn per worker, their body read meanwhile "
        "(null: 4 per slot); beyond them the answer is 503 overloaded with Retry-After",
    )
    queue_wait: float = Field(10.0, gt=0, description="seconds a queued request waits before 503 overloaded")
    decode_pixel_budget: int | None = Field(
        None,
        gt=0,
        description="pixels of photos decoded and held at once per worker, a JPEG counted at the "
        "scale it is decoded at for detection (null: twice max_image_pixels); photos beyond it "
        "wait for their turn",
    )

    # -- access -----------------------------------------------------------------------------
    api_key: SecretStr | None = Field(
        None, description="an admin API key accepted besides the keys stored (hashed) in Redis"
    )
    auth: Literal["on", "off"] = Field("on", description="off: no API key needed (development only)")

    # -- per-key rate limits (a token bucket per API key in Redis, shared by every worker and pod;
    # every /v1 request takes one token; beyond it 429 rate_limited with Retry-After; none with
    # auth off; requests go through while Redis fails) --------------------------------------
    rate_limit_read: float | None = Field(
        50.0,
        gt=0,
        description="requests per second each key of scope read may make, sustained; `off`: no limit",
    )
    rate_limit_read_burst: int | None = Field(
        None,
        ge=1,
        description="requests a read key may make at once (the bucket's size; null: twice the rate)",
    )
    rate_limit_admin: float | None = Field(
        None,
        gt=0,
        description="requests per second each admin key (and SPHEREFACE_API_KEY) may make, sustained; "
        "`off` (the default): no limit",
    )
    rate_limit_admin_burst: int | None = Field(
        None, ge=1, description="requests an admin key may make at once (null: twice the rate)"
    )

    # -- events out (docs/guides/events.md) ---------------------------------------------------
    events_stream_maxlen: int = Field(
        100_000,
        ge=1000,
        description="events kept in the Redis stream P{events}:stream (approximately: older ones are "
        "trimmed as new ones come)",
    )
    events_identification: bool = Field(
        False,
        description="also an `identification` event for every /v1/identify answer (subject ids, "
        "status and scores per face; no embeddings, no images)",
    )
    webhooks: str | None = Field(
        None,
        description="webhooks to deliver events to: a JSON list of {url, secret, events?, name?}, or "
        "the path of a file holding one; a bad entry refuses the start (invalid_webhooks)",
    )
    webhook_timeout: float = Field(
        10.0, gt=0, le=300, description="seconds a delivery waits to connect and per read"
    )
    webhook_retry_initial: float = Field(
        1.0, gt=0, description="seconds before the first retry of a failed delivery; then doubling"
    )
    webhook_retry_max: float = Field(
        300.0, gt=0, description="the longest wait between two delivery attempts"
    )
    webhook_max_attempts: int = Field(
        8, ge=1, le=100, description="delivery attempts before an event goes to the webhook's dead letters"
    )
    webhook_claim_idle: float = Field(
        60.0,
        gt=0,
        description="seconds an event a process was delivering waits, that process gone, before "
        "another process takes it over",
    )

    # -- video (docs/guides/video.md) ----------------------------------------------------------
    max_video_bytes: int = Field(64 * 1024 * 1024, gt=0, description="per clip of /v1/identify/video")
    max_video_seconds: float = Field(120.0, gt=0, le=3600, description="longest clip accepted")
    max_video_frames: int = Field(
        600, gt=0, description="most frames sampled from one clip (duration x sample rate)"
    )
    max_video_frame_pixels: int = Field(1920 * 1088, gt=0, description="most pixels in one frame")
    video_sample_fps: float = Field(5.0, gt=0, le=30, description="frames sampled per second of video")
    video_keyframe_every: int = Field(
        5,
        ge=1,
        le=100,
        description="detect in the whole frame every this many sampled frames; in between only around "
        "the faces being tracked (a new face is found at the next such frame); 1: every frame whole",
    )
    track_min_faces: int = Field(
        3, ge=1, description="a track of fewer faces gets no decision (a face seen for an instant)"
    )
    track_best_faces: int = Field(
        5, ge=1, description="a track is decided on the mean embedding of this many of its best faces"
    )

    # -- unknown faces ----------------------------------------------------------------------
    keep_unknown: bool = Field(
        False,
        description="keep every face /v1/identify answers `unknown` for (embedding, the region around "
        "the face, time, source) and cluster them: /v1/unknowns (off: nothing is kept)",
    )
    unknown_max_faces: int = Field(
        10_000, ge=1, description="unknown faces kept per model; the oldest go first"
    )
    unknown_max_age_days: float = Field(30.0, gt=0, description="days an unknown face is kept at most")
    unknown_cluster_threshold: str = Field(
        "far_1e-05",
        description="the model's calibrated threshold (manifest key) that joins a face to a cluster; "
        "a model without it uses its identification, else verification threshold",
    )

    # -- process ----------------------------------------------------------------------------
    workers: int = Field(1, ge=1)

    @field_validator("model", mode="before")
    @classmethod
    def _model_as_text(cls, value: object) -> object:
        return os.fspath(value) if isinstance(value, os.PathLike) else value

    @field_validator(
        "rate_limit_read",
        "rate_limit_read_burst",
        "rate_limit_admin",
        "rate_limit_admin_burst",
        mode="before",
    )
    @classmethod
    def _off_is_none(cls, value: object) -> object:
        """``off``, ``none``, ``null`` or an empty value: no limit (or the default burst)."""
        if isinstance(value, str) and value.strip().lower() in ("", "off", "none", "null"):
            return None
        return value

    @field_validator("api_key", mode="before")
    @classmethod
    def _empty_key_is_none(cls, value: object) -> object:
        """``SPHEREFACE_API_KEY=`` (empty, as compose passes an unset variable) means no key, so the
        first start creates one instead of accepting an empty key."""
        return None if isinstance(value, str) and not value.strip() else value

    def check_redis(self) -> None:
        """Refuse a contradictory or malformed choice of Redis (RedisSetupError)."""
        if self.redis_url and self.redis_cluster:
            raise RedisSetupError(
                "give the gallery's Redis either as a URL (--redis-url, SPHEREFACE_REDIS_URL or REDIS_URL) "
                "or as a cluster (--redis-cluster, SPHEREFACE_REDIS_CLUSTER), not both"
            )
        if self.redis_cluster is not None:
            self.cluster_nodes()

    def cluster_nodes(self) -> list[tuple[str, int]]:
        """The nodes of :attr:`redis_cluster` as (host, port); RedisSetupError when malformed."""
        nodes = []
        for item in (self.redis_cluster or "").split(","):
            host, _, port = item.strip().rpartition(":")
            host = host.strip("[]")  # [::1]:7000
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise RedisSetupError(
                    f"--redis-cluster takes HOST:PORT[,HOST:PORT...], and {item.strip()!r} is not HOST:PORT"
                )
            nodes.append((host, int(port)))
        return nodes

    def webhook_endpoints(self) -> list[WebhookEndpoint]:
        """The endpoints of :attr:`webhooks` (WebhookConfigError naming a bad entry)."""
        return parse_webhooks(self.webhooks)

    def retry_policy(self) -> RetryPolicy:
        """How webhook deliveries are timed and retried."""
        return RetryPolicy(
            timeout=self.webhook_timeout,
            initial=self.webhook_retry_initial,
            maximum=self.webhook_retry_max,
            max_attempts=self.webhook_max_attempts,
        )

    @property
    def gallery_snapshot_dir(self) -> Path | None:
        """The snapshot folder of the numpy search, or None (each worker its own copy)."""
        value = (self.gallery_snapshots or "").strip()
        return None if value in ("", "off") else Path(value).expanduser()

    @property
    def model_dir(self) -> Path:
        """The model folder of :attr:`model` (raises ModelFolderError with what to do when missing)."""
        from models.registry import resolve_model

        return resolve_model(self.model)
