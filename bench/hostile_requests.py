"""Requests that the service's strict inputs must refuse with a typed answer, or keep exactly: values
of the wrong JSON type, repeated JSON keys, ids of dots, invisible characters in names, forms over
the photo limit at every count, a bulk enrollment whose only photo fails, a forged TIFF.

The cases of ``tests/test_api_hostile_input.py`` as a client sends them to a running service (the
fault suite, ``bench/reliability_hostile.py``): each with the answer it must get, checked in order
on an empty gallery. The last case lists the subjects stored by all of them: only ``meta``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx

VECTOR = [0.1] * 128
#: Metadata is opaque JSON, returned exactly as sent (line breaks, NUL, U+202E included).
METADATA = {"note": "line one\r\nline two", "raw": "a\x00b", "rtl": "\u202eabc"}


def status_and_code(response: httpx.Response) -> str:
    """``200``, or ``422 invalid_request``: the status and, for an error, its code."""
    if response.status_code < 300:
        return str(response.status_code)
    try:
        return f"{response.status_code} {response.json().get('code')}"
    except ValueError:
        return f"{response.status_code} not_json"


@dataclass(frozen=True)
class Case:
    """One request (``send`` on a client with an admin key), the answer it must get, and how the
    answer is read (``read``: by default its status and error code)."""

    name: str
    send: Callable[[httpx.Client], httpx.Response]
    expected: str
    read: Callable[[httpx.Response], str] = status_and_code


def _raw_json(path: str, body: str, method: str = "POST") -> Callable[[httpx.Client], httpx.Response]:
    return lambda c: c.request(
        method, path, content=body.encode(), headers={"content-type": "application/json"}
    )


def _parts(field: str, count: int) -> list[tuple[str, tuple[str, bytes, str]]]:
    return [(field, (f"{i}.jpg", b"x", "image/jpeg")) for i in range(count)]


def _metadata_kept(response: httpx.Response) -> str:
    kept = response.status_code == 201 and response.json()["metadata"] == METADATA
    return f"{response.status_code} {'returned as sent' if kept else 'changed'}"


def _names_the_entries(response: httpx.Response) -> str:
    named = "65,535 entries" in response.json().get("message", "")
    return f"{status_and_code(response)} {'naming its 65,535 entries' if named else '(vague)'}"


def _typed_cases() -> list[Case]:
    """Numbers are JSON numbers, flags true or false, one value per key."""
    vector = ", ".join(["0.1"] * 128)
    refused = "422 invalid_request"
    return [
        Case(
            "embeddings of strings to verify",
            lambda c: c.post("/v1/verify", json={"embedding1": ["0.1"] * 128, "embedding2": VECTOR}),
            refused,
        ),
        Case(
            "embeddings of booleans to verify",
            lambda c: c.post("/v1/verify", json={"embedding1": [True] * 128, "embedding2": VECTOR}),
            refused,
        ),
        Case(
            "one string in an identify embedding",
            lambda c: c.post("/v1/identify", json={"embeddings": [[0.1] * 127 + ["0.1"]]}),
            refused,
        ),
        Case(
            'create_subjects: "true"',
            lambda c: c.post(
                "/v1/enroll", json={"subjects": ["ada"], "embeddings": [VECTOR], "create_subjects": "true"}
            ),
            refused,
        ),
        Case(
            '{"id": "dupa", "id": "dupb"}', _raw_json("/v1/subjects", '{"id": "dupa", "id": "dupb"}'), refused
        ),
        Case(
            "a NaN embedding1, then a valid embedding1",
            _raw_json(
                "/v1/verify",
                f'{{"embedding1": [NaN{", 0.1" * 127}], "embedding1": [{vector}], "embedding2": [{vector}]}}',
            ),
            refused,
        ),
        Case(
            "a key repeated inside metadata",
            _raw_json("/v1/subjects", '{"id": "ada", "metadata": {"team": "a", "team": "b"}}'),
            refused,
        ),
    ]


def _text_cases() -> list[Case]:
    """Ids that are not path segments, names of one line of visible text, opaque metadata."""
    refused = "422 invalid_request"
    cases = [
        Case(f'subject id "{dots}"', lambda c, d=dots: c.post("/v1/subjects", json={"id": d}), refused)
        for dots in (".", "..")
    ]
    cases.append(
        Case(
            'bulk enrollment of subject ".."',
            lambda c: c.post(
                "/v1/enroll", json={"subjects": [".."], "embeddings": [VECTOR], "create_subjects": True}
            ),
            refused,
        )
    )
    cases += [
        Case(
            f"a name holding U+{ord(char):04X}",
            lambda c, ch=char: c.post("/v1/subjects", json={"id": "ada", "name": f"Ada{ch}Lovelace"}),
            refused,
        )
        for char in ("\u2028", "\u2029", "\u200b", "\u00ad", "\ufeff")
    ]
    cases.append(
        Case(
            "metadata holding CR LF, NUL, U+202E",
            lambda c: c.post("/v1/subjects", json={"id": "meta", "metadata": METADATA}),
            "201 returned as sent",
            _metadata_kept,
        )
    )
    return cases


def _form_cases(bomb: bytes, tiff: bytes) -> list[Case]:
    """Forms over the photo limit at every count, a bulk enrollment whose only photo fails, a
    decoder error that names the problem."""
    over = "413 too_many_photos"
    cases = [
        Case(
            f"{count:,} photos to /v1/embed",
            lambda c, n=count: c.post("/v1/embed", files=_parts("photos", n)),
            over,
        )
        for count in (17, 1000, 1001, 1500)
    ]
    cases += [
        Case(
            "1,001 photos to /v1/enroll",
            lambda c: c.post(
                "/v1/enroll",
                files=_parts("photos", 1001),
                data={"subjects": ["ada"] * 1001},
                params={"create_subjects": True},
            ),
            over,
        ),
        Case(
            "1,001 photos to /v1/verify", lambda c: c.post("/v1/verify", files=_parts("photo1", 1001)), over
        ),
        Case(
            "bulk enrollment of one 6000x6000 JPEG bomb, create_subjects",
            lambda c: c.post(
                "/v1/enroll",
                files=[("photos", ("bomb.jpg", bomb, "image/jpeg"))],
                data={"subjects": ["ghost3"]},
                params={"create_subjects": True},
            ),
            "200 subjects_created=[]",
            lambda r: f"{r.status_code} subjects_created={r.json().get('subjects_created')}",
        ),
        Case(
            "a TIFF of 65,535 directory entries to identify",
            lambda c: c.post("/v1/identify", files={"photo": ("ifd.tif", tiff, "image/tiff")}),
            "422 unreadable_image naming its 65,535 entries",
            _names_the_entries,
        ),
    ]
    return cases


def hostile_requests(bomb: bytes, tiff: bytes) -> list[Case]:
    """Every case, in the order to send them to an empty gallery (``bomb``: the 6000x6000 JPEG of
    2,189 bytes; ``tiff``: one whose first directory has 65,535 entries)."""
    stored = Case(
        "subjects stored by all of the above",
        lambda c: c.get("/v1/subjects"),
        "200 meta",
        lambda r: f"{r.status_code} {' '.join(s['id'] for s in r.json()['subjects'])}",
    )
    return [*_typed_cases(), *_text_cases(), *_form_cases(bomb, tiff), stored]


def run_cases(client: httpx.Client, cases: list[Case]) -> list[dict]:
    """Send each case once, in order: a row per case (request, expected, answer, ms)."""
    rows = []
    for case in cases:
        start = time.monotonic()
        response = case.send(client)
        seconds = time.monotonic() - start
        answer = case.read(response)
        rows.append(
            {
                "request": case.name,
                "expected": case.expected,
                "answer": answer,
                "as expected": answer == case.expected,
                "ms": round(seconds * 1000),
            }
        )
    return rows
