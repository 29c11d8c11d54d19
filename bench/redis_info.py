"""What a Redis server says about itself: version and modules, persistence, the Query Engine's
index and settings (RESP2 and RESP3 replies alike)."""

from __future__ import annotations

import time
from typing import Any


def redis_server_info(client) -> dict[str, Any]:
    info = client.info("server")
    out = {"redis_version": info.get("redis_version"), "executable": info.get("executable")}
    try:
        out["modules"] = {
            m[b"name"].decode() if isinstance(m[b"name"], bytes) else m[b"name"]: m[b"ver"]
            for m in client.module_list()
        }
    except Exception:  # a server without MODULE LIST rights or support
        out["modules"] = {}
    return out


def redis_wait_idle(client, timeout: float = 1800.0) -> float:
    """Wait until no AOF rewrite is running or scheduled; returns the seconds waited."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout:
        p = client.info("persistence")
        if not p.get("aof_rewrite_in_progress") and not p.get("aof_rewrite_scheduled"):
            break
        time.sleep(0.2)
    return time.perf_counter() - t0


def _text(value: Any) -> Any:
    return value.decode(errors="replace") if isinstance(value, bytes) else value


def _pairs(reply: Any) -> dict[str, Any]:
    """A Redis reply that is a map (RESP3 dict) or a flat key, value list (RESP2) as a dict."""
    if isinstance(reply, dict):
        items = reply.items()
    else:
        items = zip(reply[::2], reply[1::2], strict=False)
    return {str(_text(k)): _text(v) for k, v in items}


def ft_info(client, name: str) -> dict[str, Any]:
    """FT.INFO's scalar fields."""
    info = _pairs(client.execute_command("FT.INFO", name))
    return {k: v for k, v in info.items() if isinstance(v, (str, int, float))}


def redis_search_config(client) -> dict[str, Any]:
    """A few Query Engine settings that bear on KNN latency (as FT.CONFIG GET answers them)."""
    out = {}
    for name in ("TIMEOUT", "ON_TIMEOUT", "WORKERS", "MIN_OPERATION_WORKERS"):
        try:
            reply = client.execute_command("FT.CONFIG", "GET", name)
        except Exception:  # an option this version does not know
            continue
        if isinstance(reply, dict):
            values = _pairs(reply)
        else:
            values = {str(_text(r[0])): _text(r[1]) for r in reply or [] if len(r) == 2}
        if name in values:
            out[name] = values[name]
    return out
