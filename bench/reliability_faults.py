"""Process and Redis faults of the fault suite, and a noisy client, on real ``sphereface serve``
processes:

* ``supervision``: ``serve --workers 2`` with its own redis-server. The redis-server is killed with
  SIGKILL (``kills`` times, back to back): how soon ``/readyz`` answers 200 again, what a client
  reading a subject got meanwhile, whether the dead server was reaped. Then the serve process is
  killed with SIGKILL: how soon none of its processes runs and its port is free, and a new serve on
  the same data folder and port at once.
* ``stall``: Redis paused (SIGSTOP) while one client enrolls and one identifies in loops:
  ``/healthz`` (as a liveness probe every 0.1 s, and in a loop) and photo verification against the
  same load with Redis running.
* ``rate_limit``: two read keys on ``serve --workers 2`` with a rate limit of 2 requests a second
  (2 at once): one hammers verify from two threads, the other verifies every 0.6 s. The keys are
  made with ``sphereface keys create --data-dir D`` (an option after the subcommand).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import httpx
import numpy as np

from bench.fault_load import Probe, closed_loop, paced_verifies, start_hammer, under_load
from bench.paths import SHARED_DATA
from bench.processes import (
    descendants,
    kill_all,
    listening,
    process_state,
    running,
    wait_for,
    workers_started,
)
from service.redis_server import LocalRedis, find_redis_server
from service.serve_process import PACKAGES_ROOT, ServeProcessError, Service, serve_env

PEOPLE = SHARED_DATA / "photos" / "people"
#: The rate limit of read keys in ``rate_limit``: requests a second, and at once.
RATE, BURST = 2, 2
#: Seconds the quiet key waits between its verifies (under its rate).
QUIET_PAUSE = 0.6


def _ms(seconds: float) -> int:
    return round(seconds * 1000)


# -- supervision ----------------------------------------------------------------------------------


def _kill_local_redis(service: Service, data: Path) -> dict:
    """SIGKILL the serve's redis-server while a client reads a subject in a loop; until /readyz is
    200 again."""
    old = int((data / "redis" / "redis.pid").read_text())
    reads, stop = Probe(), threading.Event()
    reader = threading.Thread(
        target=closed_loop, args=(service.url, stop, reads, lambda c: c.get("/v1/subjects/kept"))
    )
    reader.start()
    time.sleep(0.2)
    start = time.monotonic()
    os.kill(old, signal.SIGKILL)
    back = wait_for(lambda: service.client.get("/readyz").status_code == 200, 30, 0.02)
    seconds = time.monotonic() - start
    stop.set()
    reader.join(60)
    new = int((data / "redis" / "redis.pid").read_text())
    return {
        "back in s": round(seconds, 2) if back else None,
        "reaped": wait_for(lambda: process_state(old) is None, 2),
        "new pid": new != old,
        "reads meanwhile": dict(Counter(map(str, reads.statuses))),
        "kept subject": service.client.get("/v1/subjects/kept").status_code,
    }


def _kill_serve(service: Service, family: set[int]) -> dict:
    """SIGKILL the serve process; until none of ``family`` (its processes) runs and its port is
    free (5 s at most: what is left then stays, for the restart to meet)."""
    start = time.monotonic()
    service.process.kill()
    service.process.wait()
    gone = wait_for(lambda: not listening(service.port) and not any(map(running, family)), 5, 0.01)
    seconds = time.monotonic() - start
    return {
        "processes": len(family),
        "gone in s": round(seconds, 2) if gone else None,
        "left after 5 s": sum(map(running, family)),
        "port free": not listening(service.port),
    }


def _restart(model: Path, data: Path, port: int) -> dict:
    """A new ``serve --workers 2`` on the same data folder and port, at once."""
    start = time.monotonic()
    try:
        again = Service(model, data, options=["--workers", "2"], port=port, ready_s=120)
    except ServeProcessError as exc:
        return {"ready in s": None, "error": " ".join(str(exc).split())[-300:].replace("|", "/")}
    try:
        ready = time.monotonic() - start
        created = again.client.post("/v1/subjects", json={"id": "after-crash"}).status_code
        kept = again.client.get("/v1/subjects/kept").status_code
    finally:
        again.stop()
    return {"ready in s": round(ready, 2), "create after restart": created, "kept subject": kept}


def scenario_supervision(model: Path, workdir: Path, kills: int) -> dict:
    data = workdir / "supervision"
    service = Service(model, data, options=["--workers", "2"])
    family: set[int] = set()
    try:
        wait_for(lambda: workers_started(service) >= 2, 90, 0.2)
        service.client.post("/v1/subjects", json={"id": "kept"})
        redis_kills = [_kill_local_redis(service, data) for _ in range(kills)]
        restarts_logged = service.log.read_text(errors="replace").count("restarting it in")
        family = descendants(service.process.pid)
        serve_kill = _kill_serve(service, family)
        restart = _restart(model, data, service.port)  # at once, whatever the kill left
    finally:
        service.stop()
        kill_all(family)
    result = {
        "redis kills": redis_kills,
        "redis restarts logged": restarts_logged,
        "serve kill": serve_kill,
        "restart": restart,
    }
    print(f"supervision: {result}", flush=True)
    return result


# -- a paused Redis under enroll and identify load --------------------------------------------------


def _probe_stats(probe: Probe) -> dict:
    return {
        "n": len(probe.seconds),
        "per s": round(probe.rate(), 1),
        "min ms": _ms(min(probe.seconds)),
        "p50 ms": _ms(probe.quantile(0.5)),
        "p90 ms": _ms(probe.quantile(0.9)),
        "max ms": _ms(max(probe.seconds)),
        "answers": dict(Counter(map(str, probe.statuses))),
    }


def scenario_stall(model: Path, workdir: Path, seconds: float, verifies: int) -> dict:
    server = LocalRedis(workdir / "stall-redis", binary=find_redis_server()).start()
    service = None
    photos = [PEOPLE / "obama" / "1.jpg", PEOPLE / "obama" / "2.jpg"]
    photos += [PEOPLE / "biden" / "1.jpg", PEOPLE / "clapton" / "1.jpg"]
    try:
        service = Service(model, workdir / "stall-api", server.url)
        service.client.post("/v1/subjects", json={"id": "load"})
        pair = {"photo1": photos[0].read_bytes(), "photo2": photos[1].read_bytes()}
        service.client.post("/v1/verify", files=pair)  # warm
        running_redis = under_load(service.url, photos, verifies, seconds)
        os.kill(server.pid, signal.SIGSTOP)
        try:
            paused = under_load(service.url, photos, verifies, seconds)
        finally:
            os.kill(server.pid, signal.SIGCONT)
    finally:
        if service is not None:
            service.stop()
        server.stop()
    result = {
        "seconds per run": seconds,
        "running": {name: _probe_stats(p) for name, p in running_redis.items()},
        "paused": {name: _probe_stats(p) for name, p in paused.items()},
        "verify p50 paused / running": round(
            paused["verify"].quantile(0.5) / running_redis["verify"].quantile(0.5), 2
        ),
    }
    print(f"stall: {result}", flush=True)
    return result


# -- a noisy key and a quiet one -------------------------------------------------------------------


def _create_read_key(data: Path, name: str) -> str:
    """A read key made by ``sphereface keys create --data-dir D ...`` (options after the subcommand)
    on the running serve's Redis."""
    command = [sys.executable, "-m", "models.cli", "keys", "create", "--data-dir", str(data)]
    command += ["--scope", "read", "--name", name]
    out = subprocess.run(
        command, cwd=PACKAGES_ROOT, env=serve_env(), capture_output=True, text=True, timeout=60, check=True
    )
    return out.stdout.strip()


def scenario_rate_limit(model: Path, workdir: Path, quiet_count: int) -> dict:
    data = workdir / "rate-limit"
    env = {"SPHEREFACE_RATE_LIMIT_READ": str(RATE), "SPHEREFACE_RATE_LIMIT_READ_BURST": str(BURST)}
    service = Service(model, data, extra_env=env, options=["--workers", "2"])
    obama = PEOPLE / "obama"
    files = {"photo1": (obama / "2.jpg").read_bytes(), "photo2": (obama / "4.jpg").read_bytes()}
    try:
        noisy, quiet = _create_read_key(data, "noisy"), _create_read_key(data, "quiet")
        with httpx.Client(base_url=service.url, headers={"X-API-Key": quiet}, timeout=60) as client:
            paced_verifies(client, files, 1, QUIET_PAUSE)  # warm up
            alone = paced_verifies(client, files, quiet_count, QUIET_PAUSE)
            began = time.monotonic()
            hammer = start_hammer(service.url, noisy, files, workdir)
            during = paced_verifies(client, files, quiet_count, QUIET_PAUSE)
            out, _ = hammer.communicate("", timeout=60)
            seconds = time.monotonic() - began
    finally:
        service.stop()
    noisy_answers = json.loads(out)
    served = noisy_answers.get("200 None None", 0)
    result = {
        "rate, burst": f"{RATE}/s, {BURST}",
        "noisy answers (status code Retry-After)": noisy_answers,
        "noisy seconds": round(seconds, 1),
        "noisy served at most": BURST + RATE * round(seconds, 1),
        "noisy served": served,
        "quiet answers": dict(Counter(map(str, alone.statuses + during.statuses))),
        "quiet p50 ms alone": _ms(float(np.median(alone.seconds))),
        "quiet p50 ms beside the noisy key": _ms(float(np.median(during.seconds))),
    }
    print(f"rate_limit: {result}", flush=True)
    return result


# -- report ---------------------------------------------------------------------------------------


def supervision_table(result: dict) -> list[str]:
    lines = ["", "## Supervision: `serve --workers 2`, SIGKILL of its redis-server, then of itself", ""]
    lines += ["| fault | measure | value |", "|---|---|---|"]
    for i, kill in enumerate(result["redis kills"], 1):
        lines += [f"| redis-server SIGKILL {i} | {key} | {value} |" for key, value in kill.items()]
    lines.append(f"| redis-server | restarts logged | {result['redis restarts logged']} |")
    lines += [f"| serve SIGKILL | {key} | {value} |" for key, value in result["serve kill"].items()]
    lines += [
        f"| new serve, same folder and port | {key} | {value} |" for key, value in result["restart"].items()
    ]
    return lines


#: What each probe of the stall scenario is, for the table.
STALL_LABELS = {
    "healthz": "`/healthz` in a loop",
    "liveness": "`/healthz` every 0.1 s (a liveness probe)",
    "enroll": "enroll a photo in a loop",
    "identify": "identify a photo in a loop",
    "verify": "verify two photos, one after the other",
}


def stall_table(result: dict) -> list[str]:
    lines = [
        "",
        f"## Stall: Redis paused while one client enrolls and one identifies ({result['seconds per run']} s "
        "or more per run)",
        "",
        f"Verify p50, paused / running: {result['verify p50 paused / running']}.",
        "",
        "| requests | Redis | n | per s | p50 ms | p90 ms | max ms | answers |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name in result["running"]:
        for state in ("running", "paused"):
            s = result[state][name]
            cells = [STALL_LABELS.get(name, name), state, s["n"], s["per s"], s["p50 ms"], s["p90 ms"]]
            cells += [s["max ms"], ", ".join(f"{k}: {v}" for k, v in sorted(s["answers"].items()))]
            lines.append("| " + " | ".join(map(str, cells)) + " |")
    return lines
