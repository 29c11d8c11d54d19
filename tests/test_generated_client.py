"""A Python client generated from the service's ``/openapi.json`` by openapi-python-client (offline,
from the file) works against a real `sphereface serve` process: its functions are named for the
operations (``verify.sync``, ``add_faces.sync``), it sends photos and keys as the document says,
and it parses the answers, errors included, into its typed models."""

from __future__ import annotations

import importlib
import io
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import httpx
import pytest

from service.serve_process import KEY

pytestmark = [pytest.mark.shared_data, pytest.mark.slow]

PACKAGE = "sphereface_api_client"
#: No formatter hooks (the client is imported, not read); a JPEG answer is a file to the client.
CONFIG = "post_hooks: []\ncontent_type_overrides:\n  image/jpeg: application/octet-stream\n"


@pytest.fixture(scope="module")
def service(default_service):
    return default_service


def generate(document: Path, out: Path) -> subprocess.CompletedProcess:
    cli = Path(sys.executable).with_name("openapi-python-client")
    assert cli.exists(), f"{cli} is missing: install the dev extra (pip install -e '.[dev]')"
    config = out.parent / "client-config.yaml"
    config.write_text(CONFIG)
    command = [str(cli), "generate", "--path", str(document), "--output-path", str(out)]
    command += ["--meta", "none", "--config", str(config), "--fail-on-warning"]
    return subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=out.parent)


@pytest.fixture(scope="module")
def api(service, tmp_path_factory) -> ModuleType:
    """The generated package, imported (its ``api``, ``models`` and ``types`` modules loaded)."""
    folder = tmp_path_factory.mktemp("client")
    document = folder / "openapi.json"
    document.write_bytes(httpx.get(f"{service.url}/openapi.json").content)
    run = generate(document, folder / PACKAGE)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    sys.path.insert(0, str(folder))
    try:
        package = importlib.import_module(PACKAGE)
        for name in ("api", "models", "types", "client"):
            importlib.import_module(f"{PACKAGE}.{name}")
        yield package
    finally:
        sys.path.remove(str(folder))
        for name in [m for m in sys.modules if m == PACKAGE or m.startswith(PACKAGE + ".")]:
            del sys.modules[name]


def operation(tag: str, name: str) -> ModuleType:
    return importlib.import_module(f"{PACKAGE}.api.{tag}.{name}")


def photo(api: ModuleType, path: Path):
    return api.types.File(payload=io.BytesIO(path.read_bytes()), file_name=path.name, mime_type="image/jpeg")


def test_the_client_has_a_readable_function_for_every_operation(api, service):
    doc = httpx.get(f"{service.url}/openapi.json").json()
    expected = {(op["tags"][0], op["operationId"]) for item in doc["paths"].values() for op in item.values()}
    generated = {
        (tag.name, module.stem)
        for tag in Path(api.__file__).parent.joinpath("api").iterdir()
        if tag.is_dir() and not tag.name.startswith("__")
        for module in tag.glob("*.py")
        if module.stem != "__init__"
    }
    assert generated == expected
    for tag, name in [("faces", "verify"), ("gallery", "add_faces"), ("identify", "identify")]:
        assert callable(operation(tag, name).sync) and callable(operation(tag, name).sync_detailed)


def test_a_gallery_flow_through_the_generated_client(api, service, photos_dir):
    models = api.models
    create_subject, add_faces = operation("gallery", "create_subject"), operation("gallery", "add_faces")
    get_subject, get_face_image = operation("gallery", "get_subject"), operation("gallery", "get_face_image")
    identify, verify = operation("identify", "identify"), operation("faces", "verify")
    obama, biden = (sorted((photos_dir / "people" / name).glob("*.jpg")) for name in ("obama", "biden"))
    client = api.client.AuthenticatedClient(
        base_url=service.url, token=KEY, prefix="", auth_header_name="X-API-Key"
    )
    with client:
        for sid, name in [("obama", "Barack Obama"), ("biden", "Joe Biden")]:
            created = create_subject.sync(client=client, body=models.SubjectCreate(id=sid, name=name))
            assert isinstance(created, models.SubjectOut) and created.id == sid
        enrolled = add_faces.sync(
            "obama", client=client, body=models.AddFacesFilesBody(photos=[photo(api, p) for p in obama[:2]])
        )
        assert isinstance(enrolled, models.EnrollResponse) and enrolled.enrolled == 2, enrolled
        enrolled = add_faces.sync(
            "biden", client=client, body=models.AddFacesFilesBody(photos=[photo(api, biden[0])])
        )
        assert enrolled.enrolled == 1 and enrolled.items[0].status == "ok"
        face_id = enrolled.items[0].face.id

        found = identify.sync(client=client, body=models.IdentifyFilesBody(photo=photo(api, obama[2])))
        assert isinstance(found, models.IdentifyResponse)
        (face,) = found.faces
        assert face.status == models.IdentifiedFaceStatus.KNOWN and face.subject_id == "obama"

        same = verify.sync(
            client=client,
            body=models.VerifyFilesBody(photo1=photo(api, obama[3]), photo2=photo(api, obama[0])),
        )
        other = verify.sync(
            client=client,
            body=models.VerifyFilesBody(photo1=photo(api, obama[3]), photo2=photo(api, biden[1])),
        )
        assert isinstance(same, models.VerifyResponse) and same.same_person is True
        assert other.same_person is False and other.score < same.score

        image = get_face_image.sync(face_id, client=client)
        assert image.payload.read(3) == b"\xff\xd8\xff"  # the stored JPEG region

        missing = get_subject.sync_detailed("nobody", client=client)
        assert missing.status_code == 404
        assert isinstance(missing.parsed, models.ErrorResponse) and missing.parsed.code == "subject_not_found"
        again = create_subject.sync(client=client, body=models.SubjectCreate(id="biden"))
        assert isinstance(again, models.ErrorResponse) and again.code == "subject_exists"
