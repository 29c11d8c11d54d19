"""The OpenAPI document is a contract the server keeps: schemathesis (every check, configured in
tests/schemathesis.toml) against a real `sphereface serve` process and a real Redis, with a key.
Before: 5 schema-valid requests were rejected, statuses were undocumented, 405 answers named one
method in `Allow`, and clients generated from /openapi.json would not have worked."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from service.serve_process import KEY, Service
from tests.conftest import REPO_ROOT, short_temp_dir

pytestmark = [pytest.mark.shared_data, pytest.mark.slow]

CONFIG = REPO_ROOT / "tests" / "schemathesis.toml"


@pytest.fixture(scope="module")
def service(default_service):
    return default_service


def schemathesis(service: Service, *args: str) -> subprocess.CompletedProcess:
    cli = Path(sys.executable).with_name("schemathesis")
    command = [str(cli), "--config-file", str(CONFIG), "run", f"{service.url}/openapi.json", "--no-color"]
    return subprocess.run(
        command + list(args), capture_output=True, text=True, timeout=600, cwd=short_temp_dir()
    )


@pytest.mark.parametrize("seed", ["1", "2"])
def test_the_server_keeps_its_openapi_contract(service, seed):
    run = schemathesis(service, "-H", f"X-API-Key: {KEY}", "--max-examples", "25", "--seed", seed)
    summary = run.stdout[-6000:]
    assert run.returncode == 0, summary
    assert (
        "Tested: 27" in summary
        and " passed" in summary
        and "failures" not in summary.lower().split("summary")[-1]
    )


def test_the_document_describes_what_the_handlers_do(service):
    doc = httpx.get(f"{service.url}/openapi.json").json()
    for path, item in doc["paths"].items():
        for method, operation in item.items():
            if path.startswith("/v1/"):
                assert {"401", "422", "503"} <= set(operation["responses"]), (method, path)
    body = doc["paths"]["/v1/verify"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    pair = body["properties"]["embedding1"]
    assert pair["minItems"] == pair["maxItems"] == 128  # the served model's size
    assert body["additionalProperties"] is False
    photos = doc["components"]["schemas"]["Body_embed"]["properties"]["photos"]
    assert (photos["minItems"], photos["maxItems"]) == (1, 16)
    # a 405 names every method of the path
    r = httpx.put(f"{service.url}/v1/subjects", headers={"X-API-Key": KEY})
    assert r.status_code == 405 and r.headers["allow"] == "GET, HEAD, POST"
