"""The OpenAPI document names its operations for people and groups them by one tag each, so a
generated client reads ``verify(...)``, ``add_faces(...)`` and not ``verify_v1_verify_post``."""

from __future__ import annotations

import re
from typing import Any

import pytest
from fastapi import APIRouter

from service.app import create_app
from service.routes import events, faces, gallery, health, identify, page, unknowns

#: (method, path) -> operationId, for every operation of the API.
OPERATIONS = {
    ("get", "/healthz"): "health",
    ("get", "/readyz"): "readiness",
    ("get", "/metrics"): "metrics",
    ("post", "/v1/embed"): "embed",
    ("post", "/v1/verify"): "verify",
    ("post", "/v1/identify"): "identify",
    ("post", "/v1/identify/video"): "identify_video",
    ("post", "/v1/subjects"): "create_subject",
    ("get", "/v1/subjects"): "list_subjects",
    ("get", "/v1/subjects/{subject_id}"): "get_subject",
    ("patch", "/v1/subjects/{subject_id}"): "update_subject",
    ("delete", "/v1/subjects/{subject_id}"): "delete_subject",
    ("post", "/v1/subjects/{subject_id}/faces"): "add_faces",
    ("get", "/v1/subjects/{subject_id}/faces"): "list_faces",
    ("delete", "/v1/faces/{face_id}"): "delete_face",
    ("get", "/v1/faces/{face_id}/image"): "get_face_image",
    ("post", "/v1/enroll"): "enroll",
    ("get", "/v1/key"): "get_key",
    ("get", "/v1/events/dead-letters"): "list_dead_letters",
    ("post", "/v1/events/dead-letters/{webhook}/{letter_id}/redeliver"): "redeliver_dead_letter",
    ("delete", "/v1/events/dead-letters/{webhook}/{letter_id}"): "delete_dead_letter",
    ("get", "/v1/unknowns/clusters"): "list_unknown_clusters",
    ("get", "/v1/unknowns/clusters/{cluster_id}"): "get_unknown_cluster",
    ("post", "/v1/unknowns/clusters/{cluster_id}/enroll"): "enroll_unknown_cluster",
    ("delete", "/v1/unknowns/clusters/{cluster_id}"): "delete_unknown_cluster",
    ("delete", "/v1/unknowns/faces/{face_id}"): "delete_unknown_face",
    ("get", "/v1/unknowns/faces/{face_id}/image"): "get_unknown_face_image",
}
METHOD_SUFFIX = re.compile(r"_(get|post|put|patch|delete|head|options)$")


@pytest.fixture(scope="module")
def operations() -> dict[tuple[str, str], dict[str, Any]]:
    doc = create_app().openapi()
    return {(method, path): op for path, item in doc["paths"].items() for method, op in item.items()}


def test_every_operation_has_its_readable_id(operations):
    assert {key: op.get("operationId") for key, op in operations.items()} == OPERATIONS


def test_operation_ids_are_unique_names_without_method_or_path(operations):
    ids = [op["operationId"] for op in operations.values()]
    assert len(ids) == len(set(ids))
    for name in ids:
        assert re.fullmatch(r"[a-z][a-z_]*[a-z]", name), name
        assert not METHOD_SUFFIX.search(name), f"{name} ends in its HTTP method"
        assert "v1" not in name and "__" not in name, f"{name} spells its path"


def test_every_operation_has_exactly_one_tag(operations):
    for key, op in operations.items():
        assert len(op.get("tags", [])) == 1, (key, op.get("tags"))


@pytest.mark.parametrize(
    "module", [events, faces, gallery, health, identify, page, unknowns], ids=lambda m: m.__name__
)
def test_each_router_declares_one_tag_for_all_its_routes(module):
    router: APIRouter = module.router
    assert len(router.tags) == 1
    for route in router.routes:
        assert route.tags == router.tags, (route.path, route.tags)
