"""``sphereface`` subcommands of the service package: run the REST service, manage its API keys and
its gallery. Registered through the ``sphereface.commands`` entry points (see :mod:`models.cli`);
``serve`` never imports torch or the training package."""

from __future__ import annotations

import argparse
import sys


def register(sub: argparse._SubParsersAction) -> None:
    """Add ``serve``, ``keys``, ``gallery`` and ``watch`` to the ``sphereface`` parser."""
    _add_serve(sub)
    _add_keys(sub)
    _add_gallery(sub)
    _add_watch(sub)


def _add_serve(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve",
        help="run the REST service",
        description="Run the API (default 127.0.0.1:8000, the default model). With neither REDIS_URL "
        "nor --redis-cluster, a local redis-server keeps the gallery in DATA_DIR/redis (append-only, "
        "fsync always). Every flag also reads from SPHEREFACE_<NAME> (see service/settings.py).",
    )
    p.add_argument("--host", default=None, help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=None, help="port (default 8000)")
    p.add_argument(
        "--model",
        default=None,
        help="model name (`sphereface models`) or folder (default: default = dlib_resnet_v1)",
    )
    p.add_argument("--data-dir", default=None, help="local Redis data and admin key (default .sphereface)")
    p.add_argument("--workers", type=int, default=None, help="worker processes (default 1)")
    p.add_argument(
        "--redis-url",
        default=None,
        help="the gallery's Redis (default: REDIS_URL, else a local redis-server)",
    )
    p.add_argument(
        "--redis-cluster",
        default=None,
        metavar="HOST:PORT[,HOST:PORT...]",
        help="keep the gallery in this Redis Cluster (some of its nodes), in 64 hash-tagged partitions; "
        "not together with --redis-url",
    )
    p.set_defaults(func=_run_serve)


def _run_serve(args: argparse.Namespace) -> int:
    from service.main import serve

    return serve(
        host=args.host,
        port=args.port,
        model=args.model,
        data_dir=args.data_dir,
        workers=args.workers,
        redis_url=args.redis_url,
        redis_cluster=args.redis_cluster,
    )


def _add_keys(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "keys",
        help="API keys of the service (stored hashed in Redis)",
        description="Uses SPHEREFACE_REDIS_CLUSTER or REDIS_URL, else the local Redis of --data-dir "
        "(started for the command when the service is not running).",
    )
    p.add_argument("--data-dir", default=None, help="the service's data folder (default .sphereface)")
    which = p.add_subparsers(dest="action", required=True)
    create = which.add_parser("create", help="create a key and print it (shown once)")
    create.add_argument("--scope", choices=("read", "admin"), required=True)
    create.add_argument("--name", default="", help="a label for the key")
    revoke = which.add_parser("revoke", help="revoke a key by its id or the whole key")
    revoke.add_argument("key", help="key id (12 hex digits) or the key")
    which.add_parser("list", help="list keys (id, scope, name, created)")
    p.set_defaults(func=_run_keys)


def _run_keys(args: argparse.Namespace) -> int:
    from service.auth import create_key, list_keys, revoke_key
    from service.main import gallery_client_of
    from service.settings import Settings

    settings = Settings(**({"data_dir": args.data_dir} if args.data_dir else {}))
    prefix = settings.redis_prefix
    with gallery_client_of(settings) as client:
        if args.action == "create":
            key, info = create_key(client, args.scope, args.name, prefix=prefix)
            print(key)
            print(f"created {info.scope} key {info.key_id}; it is shown only now", file=sys.stderr)
        elif args.action == "revoke":
            if not revoke_key(client, args.key, prefix=prefix):
                print(f"error [key_not_found]: no key {args.key[:16]!r}", file=sys.stderr)
                return 2
            print("revoked")
        else:
            for info in list_keys(client, prefix=prefix):
                print(f"{info.key_id}  {info.scope:5}  {info.created_at}  {info.name}")
    return 0


def _add_gallery(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "gallery",
        help="gallery tools: faces per model, re-embed for another model, copy into a Redis Cluster",
        description="Uses SPHEREFACE_REDIS_CLUSTER or REDIS_URL, else the local Redis of --data-dir "
        "(started for the command when the service is not running).",
    )
    p.add_argument("--data-dir", default=None, help="the service's data folder (default .sphereface)")
    which = p.add_subparsers(dest="action", required=True)
    which.add_parser("models", help="how many faces each model has in the gallery")
    reembed = which.add_parser(
        "reembed",
        help="embed every enrolled photo again with a model (from the face regions stored at enrollment)",
    )
    reembed.add_argument("--model", default="default", help="the model to embed for (name or folder)")
    reembed.add_argument("--dry-run", action="store_true", help="count what would be done")
    reembed.add_argument("--no-progress", action="store_true")
    _add_migrate(which)
    p.set_defaults(func=_run_gallery)


def _add_migrate(which: argparse._SubParsersAction) -> None:
    migrate = which.add_parser(
        "migrate",
        help="copy this gallery (one Redis) into a Redis Cluster, then check the copy face by face",
        description="Copies subjects, faces of every model (vectors, regions, stored face images), the "
        "face sets and the API keys from the gallery's Redis (--redis-url, REDIS_URL, else the local Redis "
        "of --data-dir) into the partitions of a Redis Cluster. Resumable and idempotent: run it again "
        "after a stop. Face ids that do not fit their subject's partition get new ids (see --id-map).",
    )
    migrate.add_argument(
        "--to-cluster",
        required=True,
        metavar="HOST:PORT[,HOST:PORT...]",
        help="the target cluster (some nodes)",
    )
    migrate.add_argument(
        "--redis-url", default=None, help="the source Redis (default: REDIS_URL, else local)"
    )
    migrate.add_argument(
        "--id-map",
        default=None,
        help="CSV of face ids: old_id,new_id,subject_id,model_id (default DATA_DIR/migrated-face-ids.csv)",
    )
    migrate.add_argument("--dry-run", action="store_true", help="count what would be copied, write nothing")
    migrate.add_argument(
        "--into-nonempty",
        action="store_true",
        help="copy into a cluster that holds another gallery's subjects",
    )
    migrate.add_argument(
        "--max-subjects",
        type=int,
        default=None,
        help="stop after copying this many subjects (run again to go on)",
    )
    migrate.add_argument("--no-progress", action="store_true")


def _run_gallery(args: argparse.Namespace) -> int:
    from service.gallery.store import GalleryStore
    from service.gallery.writes import WritePolicy
    from service.main import gallery_client_of
    from service.settings import Settings

    if args.action == "migrate":
        return _run_migrate(args)
    settings = Settings(**({"data_dir": args.data_dir} if args.data_dir else {}))
    with gallery_client_of(settings) as client:
        store = GalleryStore(
            client,
            settings.redis_prefix,
            max_faces_per_subject=settings.max_faces_per_subject,
            policy=WritePolicy.from_settings(settings),
        )
        store.ensure_schema()
        if args.action == "models":
            counts = store.faces_per_model()
            for model_id, count in sorted(counts.items()):
                print(f"{count:>9}  {model_id}")
            if not counts:
                print("the gallery has no faces")
            return 0
        from models.embedder import Embedder
        from models.registry import resolve_model
        from service.gallery.reembed import reembed_gallery

        embedder = Embedder(resolve_model(args.model), "cpu", batch_size=32)
        report = reembed_gallery(store, embedder, dry_run=args.dry_run, progress=not args.no_progress)
        print(report.summary())
    return 0


def _run_migrate(args: argparse.Namespace) -> int:
    from pathlib import Path

    from service.gallery.migrate import GalleryMigration
    from service.main import gallery_client_of
    from service.redis_clients import cluster_client
    from service.settings import Settings

    overrides = {"data_dir": args.data_dir} if args.data_dir else {}
    if args.redis_url:
        overrides["redis_url"] = args.redis_url
    settings = Settings(**overrides, redis_cluster=None)
    target_settings = Settings(redis_cluster=args.to_cluster, redis_url=None)
    target_settings.check_redis()
    id_map = (
        Path(args.id_map) if args.id_map else Path(settings.data_dir).expanduser() / "migrated-face-ids.csv"
    )
    target = cluster_client(target_settings.cluster_nodes(), max(settings.redis_timeout, 30.0))
    try:
        with gallery_client_of(settings) as source:
            migration = GalleryMigration(
                source,
                target,
                settings.redis_prefix,
                into_nonempty=args.into_nonempty,
                max_subjects=args.max_subjects,
            )
            report = migration.run(dry_run=args.dry_run, progress=not args.no_progress, id_map=id_map)
    finally:
        target.close()
    print(report.summary())
    if report.complete and report.faces_renamed:
        print(f"face ids: {id_map}")
    return 0


def _add_watch(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "watch",
        help="identify the people in a video file, stream or camera, one decision per track",
        description="Samples frames of SOURCE (a file, an rtsp:// or http(s):// stream, or a device such "
        "as /dev/video0), follows faces across frames and decides each track against the gallery "
        "(the Redis of SPHEREFACE_REDIS_URL / --redis-url, or the local one of --data-dir). Each "
        "decided track is printed as a line of JSON when it ends, and track.started / track.ended "
        "events go to the event stream (docs/guides/video.md). A stream is opened again after a "
        "break, waiting 1 s, then twice as long each time; a file is read once.",
    )
    p.add_argument("source", help="video file, stream URL or device")
    p.add_argument("--model", default=None, help="model name or folder (default: the service's)")
    p.add_argument("--data-dir", default=None, help="the service's data folder (default .sphereface)")
    p.add_argument("--redis-url", default=None, help="the gallery's Redis (default: REDIS_URL)")
    p.add_argument("--sample-fps", type=float, default=None, help="frames per second (default 5)")
    p.add_argument(
        "--min-faces", type=int, default=None, help="faces a track needs for a decision (default 3)"
    )
    p.add_argument("--threshold", type=float, default=None, help="cosine threshold (default: the model's)")
    p.add_argument("--reconnect-max", type=float, default=60.0, help="longest wait between reconnects, s")
    p.add_argument(
        "--max-reconnects", type=int, default=10, help="failed reconnects in a row before giving up"
    )
    p.add_argument("--no-events", action="store_true", help="send no events")
    p.add_argument("--quiet", action="store_true", help="no progress line")
    p.set_defaults(func=_run_watch)


def _run_watch(args: argparse.Namespace) -> int:
    from service.app import load_pipeline
    from service.settings import Settings
    from service.watch import Watcher, WatchOptions, gallery_search

    overrides = {"data_dir": args.data_dir, "model": args.model, "redis_url": args.redis_url}
    settings = Settings(**{k: v for k, v in overrides.items() if v is not None})
    options = WatchOptions(
        args.source, sample_fps=args.sample_fps, min_faces=args.min_faces, threshold=args.threshold,
        reconnect_max_s=args.reconnect_max, max_reconnects=args.max_reconnects, progress=not args.quiet,
    )  # fmt: skip
    pipeline = load_pipeline(settings)
    with gallery_search(settings, pipeline.manifest) as (search, names, events, unknowns):
        watcher = Watcher(pipeline, search, names, None if args.no_events else events, settings, options,
                          sys.stdout, unknowns)  # fmt: skip
        try:
            watcher.run()
        except KeyboardInterrupt:
            pass
    print(f"{watcher.decided} tracks decided, {watcher.known} known", file=sys.stderr)
    return 0
