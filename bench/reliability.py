"""Fault and load suite of the service: real `sphereface serve` processes, real redis-servers, real
photos, real faults (SIGKILL, SIGSTOP), hostile images. Prints a table per scenario and can write
them as Markdown and JSON (``docs/results/reliability.md``).

Scenarios:

* ``load``: clients at several concurrency levels send `/v1/verify` of two phone photos for a fixed
  time: requests, throughput, answers by code, latency of the answered ones (p50/p95/p99). Shows
  what one worker sustains on this machine before it sheds load (503 ``overloaded``).
* ``durability``: writers enroll faces (bulk enrollment of embeddings) while Redis is killed with
  SIGKILL and restarted, and then the API process is killed with SIGKILL and restarted; afterwards
  every acknowledged face must be in Redis (append-only file, ``appendfsync always``).
* ``pause``: Redis paused with SIGSTOP for a few seconds under traffic, then resumed: the slowest
  answer, answers by code, and whether the service answers normally afterwards.
* ``workers``: ``--workers 2``; clients enroll, identify and delete faces concurrently: an enrolled
  face must be found by the next identification (whichever worker answers) and a deleted one never.
* ``supervision``, ``stall``, ``rate_limit`` (``bench/reliability_faults.py``): SIGKILL of the local
  redis-server and then of ``serve --workers 2`` (restarted, no process left, a new serve at once);
  Redis paused while clients enroll and identify (``/healthz`` and verify against the unpaused
  run); a noisy key against a quiet one (429 with ``Retry-After``).
* ``hostile`` (``bench/reliability_hostile.py``): decompression bombs of every accepted format, the
  6000x6000 JPEG of 2,189 bytes, truncated and CMYK JPEGs, 16-bit PNGs, an animated GIF, a 1x1
  image, the 8 EXIF orientations of a face photo, large photos that really decode; requests the
  strict inputs refuse (``bench/hostile_requests.py``): answers by code, no 500, the bomb's CPU,
  the worker's memory at the start, after the hostile set and after normal photos.

Usage::

    .venv/bin/python bench/reliability.py                      # every scenario (about 5 minutes)
    .venv/bin/python bench/reliability.py --short              # the short version (make test runs it)
    .venv/bin/python bench/reliability.py --markdown docs/results/reliability.md \
        --json docs/results/reliability.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import signal
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.decode_cost import environment  # noqa: E402
from bench.paths import SHARED_DATA, short_temp_dir  # noqa: E402
from bench.reliability_faults import (  # noqa: E402
    scenario_rate_limit,
    scenario_stall,
    scenario_supervision,
    stall_table,
    supervision_table,
)
from bench.reliability_hostile import hostile_tables, scenario_hostile  # noqa: E402
from models.registry import resolve_model  # noqa: E402
from service.redis_server import LocalRedis, find_redis_server  # noqa: E402
from service.serve_process import HEADERS, Service  # noqa: E402

PHOTOS = SHARED_DATA / "photos"


# -- tallies --------------------------------------------------------------------------------------


@dataclass
class Tally:
    """Answers of one scenario: counts by status and code, latencies of the 2xx."""

    codes: Counter = field(default_factory=Counter)
    latencies: list[float] = field(default_factory=list)
    slowest: float = 0.0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, status: int, code: str | None, seconds: float) -> None:
        with self.lock:
            self.codes[f"{status} {code}" if code else str(status)] += 1
            self.slowest = max(self.slowest, seconds)
            if 200 <= status < 300:
                self.latencies.append(seconds)

    @property
    def requests(self) -> int:
        return sum(self.codes.values())

    @property
    def server_errors(self) -> int:
        return sum(
            n
            for key, n in self.codes.items()
            if key.startswith("5") and "overloaded" not in key and "redis_unavailable" not in key
        )

    def percentiles(self) -> dict[str, float | None]:
        if not self.latencies:
            return {"p50": None, "p95": None, "p99": None}
        values = np.percentile(np.asarray(self.latencies) * 1000, [50, 95, 99])
        return {"p50": float(values[0]), "p95": float(values[1]), "p99": float(values[2])}


def call(tally: Tally, send: Callable[[], httpx.Response]) -> httpx.Response | None:
    start = time.monotonic()
    try:
        response = send()
    except httpx.HTTPError as exc:  # the process is down: no answer at all
        tally.add(0, type(exc).__name__, time.monotonic() - start)
        return None
    code = None
    if response.status_code >= 300:
        try:
            code = response.json().get("code")
        except ValueError:
            code = "not_json"
    tally.add(response.status_code, code, time.monotonic() - start)
    return response


def run_clients(count: int, seconds: float, work: Callable[[int], None]) -> None:
    deadline = time.monotonic() + seconds

    def loop(index: int) -> None:
        while time.monotonic() < deadline:
            work(index)

    threads = [threading.Thread(target=loop, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def unit_vectors(rng: np.random.Generator, n: int, dim: int) -> list[list[float]]:
    v = rng.normal(size=(n, dim))
    return (v / np.linalg.norm(v, axis=1, keepdims=True)).tolist()


# -- scenarios ------------------------------------------------------------------------------------


def scenario_load(model: Path, workdir: Path, levels: list[tuple[int, bool]], seconds: float) -> list[dict]:
    """``levels``: (clients, honour Retry-After). Clients that honour it wait the seconds it says
    after a 503; the others retry at once (a retry storm)."""
    service = Service(model, workdir / "load")
    pair = sorted((PHOTOS / "people" / "obama").glob("*.jpg"))[:2]
    files = {"photo1": pair[0].read_bytes(), "photo2": pair[1].read_bytes()}
    rows = []
    try:
        client = httpx.Client(base_url=service.url, headers=HEADERS, timeout=60)
        for clients, backoff in levels:
            tally = Tally()

            def verify(_: int, tally: Tally = tally, backoff: bool = backoff) -> None:
                response = call(tally, lambda: client.post("/v1/verify", files=files))
                if backoff and response is not None and response.status_code == 503:
                    time.sleep(float(response.headers.get("retry-after", 1)))

            run_clients(clients, seconds, verify)
            answered = len(tally.latencies)
            rows.append(
                {
                    "clients": clients,
                    "honour Retry-After": backoff,
                    "requests": tally.requests,
                    "answered per s": round(answered / seconds, 2),
                    **{k: round(v) if v is not None else None for k, v in tally.percentiles().items()},
                    "codes": dict(tally.codes),
                    "server errors": tally.server_errors,
                }
            )
            print(f"load {clients:>3} clients: {rows[-1]}", flush=True)
        client.close()
    finally:
        service.stop()
    return rows


def scenario_durability(model: Path, workdir: Path, seconds: float, writers: int = 4) -> dict:
    redis = LocalRedis(workdir / "dur-redis", binary=find_redis_server()).start()
    service = Service(model, workdir / "dur-api", redis.url)
    state = {"url": service.url}
    acknowledged: list[str] = []
    tally = Tally()
    ack_lock = threading.Lock()
    counter = iter(range(10**9))

    def write(index: int) -> None:
        batch = [next(counter) for _ in range(5)]
        body = {
            "subjects": [f"w{index}-s{n % 50}" for n in batch],
            "embeddings": [unit_vectors(np.random.default_rng(n), 1, 128)[0] for n in batch],  # no duplicates
            "create_subjects": True,
        }
        with httpx.Client(base_url=state["url"], headers=HEADERS, timeout=10) as client:
            response = call(tally, lambda: client.post("/v1/enroll", json=body))
        if response is not None and response.status_code == 200:
            with ack_lock:
                acknowledged.extend(i["face"]["id"] for i in response.json()["items"] if i["status"] == "ok")
        elif response is None or response.status_code >= 500:
            time.sleep(0.05)

    faults = []

    def inject() -> None:
        nonlocal service
        time.sleep(seconds / 3)
        redis.kill()
        faults.append(("SIGKILL redis", len(acknowledged)))
        time.sleep(1.0)
        redis.start()
        time.sleep(seconds / 3 - 1.0)
        service.process.kill()  # SIGKILL of the API: no graceful shutdown
        service.process.wait()
        faults.append(("SIGKILL api", len(acknowledged)))
        service = Service(model, workdir / "dur-api2", redis.url)
        state["url"] = service.url

    injector = threading.Thread(target=inject)
    injector.start()
    run_clients(writers, seconds + 10, write)  # the restart of the API takes a few seconds
    injector.join()
    service.stop()
    client = redis.client()
    present = sum(bool(client.exists(f"sf:face:{face_id}")) for face_id in acknowledged)
    redis.stop()
    result = {
        "writes acknowledged": len(acknowledged),
        "present afterwards": present,
        "lost": len(acknowledged) - present,
        "faults": [f"{what} after {n} acknowledged" for what, n in faults],
        "codes": dict(tally.codes),
        "server errors": tally.server_errors,
    }
    print(f"durability: {result}", flush=True)
    return result


def scenario_pause(model: Path, workdir: Path, pause: float) -> dict:
    redis = LocalRedis(workdir / "pause-redis", binary=find_redis_server()).start()
    service = Service(model, workdir / "pause-api", redis.url)
    client = httpx.Client(base_url=service.url, headers=HEADERS, timeout=30)
    client.post("/v1/subjects", json={"id": "ada"})
    during, after = Tally(), Tally()
    try:
        os.kill(redis.pid, signal.SIGSTOP)
        run_clients(4, pause, lambda _: call(during, lambda: client.get("/v1/subjects/ada")))
        ready_start = time.monotonic()
        ready_during = client.get("/readyz")  # not tallied: its 503 is the answer a probe wants
        ready_seconds = time.monotonic() - ready_start
        os.kill(redis.pid, signal.SIGCONT)
        time.sleep(0.2)
        run_clients(2, 1.0, lambda _: call(after, lambda: client.get("/v1/subjects/ada")))
        result = {
            "paused s": pause,
            "answers while paused": dict(during.codes),
            "slowest answer while paused s": round(during.slowest, 2),
            "readyz while paused": f"{ready_during.status_code} {ready_during.json()['status']} "
            f"in {ready_seconds:.2f} s",
            "answers after resume": dict(after.codes),
            "server errors": during.server_errors + after.server_errors,
        }
    finally:
        client.close()
        service.stop()
        redis.stop()
    print(f"pause: {result}", flush=True)
    return result


def scenario_workers(model: Path, workdir: Path, seconds: float) -> dict:
    redis = LocalRedis(workdir / "workers-redis", binary=find_redis_server()).start()
    service = Service(model, workdir / "workers-api", redis.url, extra_env={"SPHEREFACE_WORKERS": "2"})
    tally = Tally()
    misses = Counter()
    rng = np.random.default_rng(1)
    lock = threading.Lock()
    ids = iter(range(10**9))

    def cycle(index: int) -> None:
        with lock:
            n = next(ids)
            vector = unit_vectors(rng, 1, 128)[0]
        subject = f"c{index}-{n}"
        with httpx.Client(base_url=service.url, headers=HEADERS, timeout=30) as client:
            r = call(
                tally,
                lambda: client.post(
                    "/v1/enroll",
                    json={"subjects": [subject], "embeddings": [vector], "create_subjects": True},
                ),
            )
            if r is None or r.status_code != 200:
                return
            for _ in range(2):  # two identifications: likely one on each worker
                found = call(
                    tally, lambda: client.post("/v1/identify", json={"embeddings": [vector]}, params={"k": 1})
                )
                if found is not None and found.status_code == 200:
                    best = found.json()["faces"][0]["candidates"]
                    misses["enrolled but not found"] += not best or best[0]["subject_id"] != subject
                    misses["checks"] += 1
            call(tally, lambda: client.delete(f"/v1/subjects/{subject}"))
            gone = call(
                tally, lambda: client.post("/v1/identify", json={"embeddings": [vector]}, params={"k": 1})
            )
            if gone is not None and gone.status_code == 200:
                best = gone.json()["faces"][0]["candidates"]
                misses["deleted but found"] += bool(best) and best[0]["subject_id"] == subject
                misses["checks"] += 1

    try:
        run_clients(8, seconds, cycle)
    finally:
        service.stop()
        redis.stop()
    result = {
        "requests": tally.requests,
        "consistency checks": misses["checks"],
        "enrolled but not found": misses["enrolled but not found"],
        "deleted but found": misses["deleted but found"],
        "codes": dict(tally.codes),
        "server errors": tally.server_errors,
    }
    print(f"workers: {result}", flush=True)
    return result


# -- report ---------------------------------------------------------------------------------------


def markdown(results: dict) -> str:
    """The tables of the scenarios ``results`` holds (a run with ``--only`` and no earlier JSON has
    only some)."""
    lines = [f"# Reliability suite ({results['when']}, {results['machine']})"]
    if results.get("seconds"):
        load = results.get("load average", {})
        spent = ", ".join(f"{name} {seconds} s" for name, seconds in results["seconds"].items())
        lines += [
            "",
            f"Wall time per scenario: {spent}. Load average (1 min) at the start {load.get('start')}, "
            f"at the end {load.get('end')}.",
        ]
    if "load" in results:
        lines += _load_table(results["load"])
    for name in ("durability", "pause", "workers", "rate_limit"):
        if name in results:
            title = name.replace("_", " ").capitalize()
            lines += ["", f"## {title}", "", "| measure | value |", "|---|---|"]
            lines += [f"| {key} | {value} |" for key, value in results[name].items()]
    if "supervision" in results:
        lines += supervision_table(results["supervision"])
    if "stall" in results:
        lines += stall_table(results["stall"])
    if "hostile" in results:
        lines += hostile_tables(results["hostile"])
    return "\n".join(lines) + "\n"


def _load_table(rows: list[dict]) -> list[str]:
    lines = [
        "",
        "## Load: `/v1/verify` of two phone photos, one worker",
        "",
        "| clients | honour Retry-After | requests | answered / s | p50 ms | p95 ms | p99 ms | answers "
        "| server errors |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        codes = ", ".join(f"{k}: {v}" for k, v in sorted(row["codes"].items()))
        backoff = "yes" if row["honour Retry-After"] else "no: retry at once"
        lines.append(
            f"| {row['clients']} | {backoff} | {row['requests']} | {row['answered per s']} | {row['p50']} | "
            f"{row['p95']} | {row['p99']} | {codes} | {row['server errors']} |"
        )
    return lines


SCENARIOS = ("load", "durability", "pause", "workers", "supervision", "stall", "rate_limit", "hostile")


def run(short: bool, only: tuple[str, ...] = SCENARIOS) -> dict:
    model = resolve_model("default")
    workdir = short_temp_dir()
    levels = [(1, True), (4, True)] if short else [(n, True) for n in (1, 2, 4, 8, 16, 32)] + [(16, False)]
    scenarios = {
        "load": lambda: scenario_load(model, workdir, levels, 3 if short else 15),
        "durability": lambda: scenario_durability(model, workdir, 6 if short else 30),
        "pause": lambda: scenario_pause(model, workdir, 2 if short else 5),
        "workers": lambda: scenario_workers(model, workdir, 4 if short else 20),
        "supervision": lambda: scenario_supervision(model, workdir, 1 if short else 3),
        "stall": lambda: scenario_stall(model, workdir, 1.5 if short else 5, 3 if short else 6),
        "rate_limit": lambda: scenario_rate_limit(model, workdir, 3 if short else 6),
        "hostile": lambda: scenario_hostile(model, workdir, 0 if short else 100),
    }
    cpu = environment()["cpu_model"]
    results = {
        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": f"{cpu}, {os.cpu_count()} cores, {platform.machine()}, Python {platform.python_version()}",
        "short": short,
        "load average": {"start": round(os.getloadavg()[0], 2)},
        "seconds": {},
    }
    try:
        for name in only:
            started = time.monotonic()
            results[name] = scenarios[name]()
            results["seconds"][name] = round(time.monotonic() - started, 1)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    results["load average"]["end"] = round(os.getloadavg()[0], 2)
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--short", action="store_true", help="short durations (the version make test runs)")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--markdown", type=Path, help="write the tables here")
    parser.add_argument(
        "--only", nargs="+", choices=SCENARIOS, help="run these scenarios; the others are kept from --json"
    )
    args = parser.parse_args()
    random.seed(0)
    results = run(args.short, tuple(args.only or SCENARIOS))
    if args.only and args.json and args.json.exists():
        earlier = json.loads(args.json.read_text())
        seconds = {**earlier.get("seconds", {}), **results["seconds"]}
        results = {**earlier, **results, "seconds": seconds}
    text = markdown(results)
    print(text)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    if args.markdown:
        args.markdown.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
