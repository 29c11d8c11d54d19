"""Errors below the service say what went wrong (a stable ``code``), never how HTTP answers it;
the service turns every code into a status through one table, and no code is left out of it."""

from __future__ import annotations

import importlib
import inspect
import logging
import pkgutil

import pytest

from models.errors import FacePathError, SphereFaceError
from service.errors import HTTP_STATUS_BY_CODE, ServiceError, error_response, http_status_of

PACKAGES = ("models", "training", "service")


def import_all(package: str) -> list:
    """Every module of ``package`` (so every error class it defines exists)."""
    root = importlib.import_module(package)
    modules = [root]
    for info in pkgutil.walk_packages(root.__path__, package + "."):
        modules.append(importlib.import_module(info.name))
    return modules


def subclasses(cls: type) -> list[type]:
    found = []
    for sub in cls.__subclasses__():
        found += [sub, *subclasses(sub)]
    return found


@pytest.fixture(scope="module")
def modules() -> dict[str, list]:
    return {package: import_all(package) for package in PACKAGES}


@pytest.fixture(scope="module")
def errors(modules) -> list[type]:
    """SphereFaceError and every subclass defined in the project's packages."""
    ours = [SphereFaceError, *subclasses(SphereFaceError)]
    return [cls for cls in ours if cls.__module__.split(".")[0] in PACKAGES]


def test_the_walk_finds_the_errors_of_every_package(errors):
    packages = {cls.__module__.split(".")[0] for cls in errors}
    assert packages == set(PACKAGES)
    names = {cls.__name__ for cls in errors}
    assert {"NoFaceError", "ConfigError", "DatasetError", "SubjectNotFoundError", "OverloadedError"} <= names


def test_every_error_code_has_an_http_status(errors):
    missing = sorted(
        f"{cls.__module__}.{cls.__name__}: {cls.code!r}"
        for cls in errors
        if cls.code not in HTTP_STATUS_BY_CODE
    )
    assert not missing, "codes without an HTTP status in service.errors.HTTP_STATUS_BY_CODE: " + ", ".join(
        missing
    )


def test_every_class_has_its_own_code_and_the_table_no_stale_one(errors):
    by_code: dict[str, list[str]] = {}
    for cls in errors:
        assert "code" in vars(cls), f"{cls.__name__} inherits {cls.code!r}: give it a code of its own"
        by_code.setdefault(cls.code, []).append(cls.__name__)
    shared = {code: names for code, names in by_code.items() if len(names) > 1}
    assert not shared, f"codes shared by several classes: {shared}"
    assert set(HTTP_STATUS_BY_CODE) == set(by_code), set(HTTP_STATUS_BY_CODE) ^ set(by_code)


def test_the_statuses_are_http_error_statuses():
    assert all(400 <= status <= 599 for status in HTTP_STATUS_BY_CODE.values())
    unavailable = {c for c, s in HTTP_STATUS_BY_CODE.items() if s == 503}
    assert unavailable == {"redis_unavailable", "not_replicated", "overloaded"}


def test_no_error_below_the_service_knows_http(modules, errors):
    for package in ("models", "training"):
        for module in modules[package]:
            for name, cls in inspect.getmembers(module, inspect.isclass):
                if cls.__module__ == module.__name__:
                    assert not hasattr(cls, "http_status"), f"{module.__name__}.{name} has http_status"
    assert not [cls.__name__ for cls in errors if hasattr(cls, "http_status")]


def test_face_path_and_service_errors_are_domain_errors():
    assert issubclass(FacePathError, SphereFaceError) and issubclass(ServiceError, SphereFaceError)
    assert not issubclass(ServiceError, FacePathError)


def test_an_error_is_answered_with_its_status_and_code(errors):
    for cls in errors:
        response = error_response(cls("what went wrong"))
        assert response.status_code == HTTP_STATUS_BY_CODE[cls.code]
        assert response.body == f'{{"code":"{cls.code}","message":"what went wrong"}}'.encode()


def test_a_code_missing_from_the_table_is_a_logged_500(caplog):
    class Unlisted(SphereFaceError):
        code = "not_in_the_table"

    with caplog.at_level(logging.ERROR, logger="service.errors"):
        assert http_status_of(Unlisted("?")) == 500
    assert "not_in_the_table" in caplog.text
