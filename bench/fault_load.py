"""Client load for fault scenarios of a running ``sphereface serve``: requests timed one kind at a
time, loops that enroll and identify while others are probed, a liveness probe sent as an
orchestrator sends it, and a client hammering verify from a process of its own.

Used by the fault suite (``bench/reliability_faults.py``), ``tests/test_redis_stall.py`` and
``tests/test_rate_limit_api.py``.
"""

from __future__ import annotations

import concurrent.futures as cf
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from service.serve_process import HEADERS


@dataclass
class Probe:
    """Latencies (seconds) and statuses of one kind of request, and the time they were sent over
    (a status 0: no answer within the client's timeout)."""

    seconds: list[float] = field(default_factory=list)
    statuses: list[int] = field(default_factory=list)
    started: float = field(default_factory=time.monotonic)
    ended: float = 0.0

    def quantile(self, q: float) -> float:
        ordered = sorted(self.seconds)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    def rate(self) -> float:
        """Requests answered per second over the time they were sent."""
        return len(self.seconds) / max(self.ended - self.started, 1e-9)

    def summary(self) -> str:
        s = self.seconds
        return (
            f"n={len(s)} {self.rate():.1f}/s min {min(s) * 1e3:.0f} median {self.quantile(0.5) * 1e3:.0f} "
            f"p90 {self.quantile(0.9) * 1e3:.0f} max {max(s) * 1e3:.0f} ms"
        )

    def timed(self, call: Callable[[], httpx.Response]) -> None:
        start = time.monotonic()
        try:
            status = call().status_code
        except httpx.TimeoutException:
            status = 0
        self.seconds.append(time.monotonic() - start)
        self.statuses.append(status)


def closed_loop(url: str, stop: threading.Event, probe: Probe, send) -> None:
    """Send ``send(client)`` again as soon as it is answered, until ``stop``."""
    with httpx.Client(base_url=url, headers=HEADERS, timeout=60) as client:
        while not stop.is_set():
            probe.timed(lambda: send(client))
    probe.ended = time.monotonic()


def liveness(url: str, stop: threading.Event, probe: Probe, every: float = 0.1) -> None:
    """A probe as an orchestrator sends it: every ``every`` seconds whatever the answers before
    (so a blocked event loop shows in the latencies of all the probes it holds, not just one)."""
    with httpx.Client(base_url=url, timeout=5) as client, cf.ThreadPoolExecutor(16) as pool:
        while not stop.wait(every):
            pool.submit(probe.timed, lambda: client.get("/healthz"))
    probe.ended = time.monotonic()


def under_load(url: str, photos: list[Path], verifies: int, at_least_s: float) -> dict[str, Probe]:
    """One client enrolling (into the subject ``load``, which must exist) and one identifying in a
    loop, /healthz probed in a loop and as a liveness probe, while at least ``verifies`` photo
    verifications (and ``at_least_s`` seconds of them) are timed one after the other.

    ``photos``: four photos; the first two are verified, the third enrolled, the fourth identified.
    """
    data = [p.read_bytes() for p in photos]
    probes = {name: Probe() for name in ("healthz", "liveness", "enroll", "identify", "verify")}
    senders = {
        "healthz": lambda c: c.get("/healthz"),
        "enroll": lambda c: c.post("/v1/subjects/load/faces", files=[("photos", data[2])]),
        "identify": lambda c: c.post("/v1/identify", files={"photo": data[3]}),
    }
    stop = threading.Event()
    threads = [threading.Thread(target=liveness, args=(url, stop, probes["liveness"]))]
    threads += [
        threading.Thread(target=closed_loop, args=(url, stop, probes[name], send))
        for name, send in senders.items()
    ]
    for thread in threads:
        thread.start()
    time.sleep(0.5)  # the load is running
    verify = probes["verify"]
    verify.started = time.monotonic()
    with httpx.Client(base_url=url, headers=HEADERS, timeout=60) as client:
        while len(verify.seconds) < verifies or time.monotonic() - verify.started < at_least_s:
            verify.timed(lambda: client.post("/v1/verify", files={"photo1": data[0], "photo2": data[1]}))
    verify.ended = time.monotonic()
    stop.set()
    for thread in threads:
        thread.join(60)
    return probes


# -- a noisy key and a quiet one ------------------------------------------------------------------

#: A client in a process of its own (so that it holds no lock of its parent's process) that sends
#: the same verify request from two threads as fast as it is answered, until its stdin closes;
#: it says "ready" after its first answer and prints its answers, as JSON, at the end: a count per
#: "status code retry-after".
HAMMER = """
import collections, json, sys, threading, httpx
url, key, body_file, content_type = sys.argv[1:5]
body = open(body_file, "rb").read()
answers, lock, stop = collections.Counter(), threading.Lock(), threading.Event()
def hammer():
    with httpx.Client(base_url=url, headers={"X-API-Key": key, "Content-Type": content_type}) as c:
        while not stop.is_set():
            r = c.post("/v1/verify", content=body)
            code = r.json().get("code") if r.status_code != 200 else None
            with lock:
                answers[f"{r.status_code} {code} {r.headers.get('retry-after')}"] += 1
                if sum(answers.values()) == 1:
                    print("ready", flush=True)
threads = [threading.Thread(target=hammer) for _ in range(2)]
for t in threads:
    t.start()
sys.stdin.read()
stop.set()
for t in threads:
    t.join()
print(json.dumps(answers), flush=True)
"""


def paced_verifies(client: httpx.Client, files: dict, count: int, pause: float) -> Probe:
    """``count`` verifies of ``files``, each ``pause`` seconds after the previous one's answer."""
    probe = Probe()
    for _ in range(count):
        time.sleep(pause)
        probe.timed(lambda: client.post("/v1/verify", files=files))
    probe.ended = time.monotonic()
    return probe


def start_hammer(url: str, key: str, files: dict, folder: Path) -> subprocess.Popen:
    """The :data:`HAMMER` client on ``url`` with ``key``, once it has had its first answer; close
    its stdin (``communicate("")``) to stop it and read its answers."""
    request = httpx.Request("POST", f"{url}/v1/verify", files=files)
    body = folder / "verify.body"
    body.write_bytes(request.read())
    command = [sys.executable, "-c", HAMMER, url, key, str(body), request.headers["content-type"]]
    process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    first = process.stdout.readline().strip()
    if first != "ready":
        process.kill()
        raise RuntimeError(f"the hammering client did not start: {first!r}")
    return process
