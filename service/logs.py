"""Logging of the service: uvicorn's configuration with secrets taken out of the access log.

A client may put its API key in the address (``?api_key=sfk_...``) although the service only
reads the header: the key is refused, and must not be written to the log either.
"""

from __future__ import annotations

import copy
import logging
import re
from typing import Any

#: ``name=value`` query parameters whose name suggests a secret.
_SECRET_PARAM = re.compile(r"(?i)([?&;][^=&;#\s]*(?:key|token|secret|password|auth)[^=&;#\s]*=)[^&;#\s]*")
#: An API key of this service anywhere in a line: its public id is kept, the secret is not.
_API_KEY = re.compile(r"(sfk_[0-9a-f]{12}_)[A-Za-z0-9_-]+")
REDACTED = "***"


def redact(text: str) -> str:
    """``text`` with secret-looking query values and API key secrets replaced by ``***``."""
    return _API_KEY.sub(rf"\g<1>{REDACTED}", _SECRET_PARAM.sub(rf"\g<1>{REDACTED}", text))


class RedactSecrets(logging.Filter):
    """Redact the request line of uvicorn's access records (and any other message argument)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple):
            record.args = tuple(redact(a) if isinstance(a, str) else a for a in record.args)
        elif isinstance(record.msg, str):
            record.msg = redact(record.msg)
        return True


def uvicorn_log_config() -> dict[str, Any]:
    """uvicorn's default logging configuration with :class:`RedactSecrets` on the access log."""
    from uvicorn.config import LOGGING_CONFIG

    config = copy.deepcopy(LOGGING_CONFIG)
    config.setdefault("filters", {})["redact_secrets"] = {"()": RedactSecrets}
    config["handlers"]["access"]["filters"] = ["redact_secrets"]
    return config
