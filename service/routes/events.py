"""Events out: the dead letters of the webhooks (admin scope). The events themselves go out by
webhook and on the Redis stream (docs/guides/events.md)."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Path, Query, Request
from pydantic import BaseModel, Field

from service.auth import require_admin
from service.errors import DeadLetterNotFoundError, WebhookNotFoundError
from service.events.dead_letters import delete_dead_letter, list_dead_letters, redeliver_dead_letter
from service.events.webhooks import WebhookEndpoint
from service.routes.common import StrictRoute
from service.schemas import ErrorResponse

ERRORS = {code: {"model": ErrorResponse} for code in (401, 403, 404, 422, 503)}
router = APIRouter(
    tags=["events"], responses=ERRORS, dependencies=[Depends(require_admin)], route_class=StrictRoute
)
WebhookName = Annotated[str, Path(description="the webhook's name", pattern=r"^[A-Za-z0-9_.-]{1,64}$")]
LetterId = Annotated[str, Path(description="the dead letter's id", pattern=r"^\d{1,20}-\d{1,20}$")]


class DeadLetterOut(BaseModel):
    id: str = Field(
        description="the dead letter's id (for redeliver and delete)", examples=["1764202451123-0"]
    )
    webhook: str = Field(description="the webhook's name")
    event: dict[str, Any] = Field(description="the event as the webhook got it: id, type, created_at, data")
    attempts: int = Field(description="deliveries tried")
    last_error: str = Field(description="the last attempt's failure, e.g. `HTTP 500` or a timeout")
    failed_at: str = Field(description="RFC 3339 UTC")


class DeadLetterPage(BaseModel):
    dead_letters: list[DeadLetterOut]


class DeadLetterDone(BaseModel):
    id: str
    webhook: str
    event_id: str | None = Field(None, description="redeliver: the event sent again (same id)")


def _webhooks(request: Request, name: str | None) -> list[WebhookEndpoint]:
    """The configured webhooks, or the one named (404 webhook_not_found when none is)."""
    webhooks: list[WebhookEndpoint] = request.app.state.webhooks
    if name is None:
        return webhooks
    found = [w for w in webhooks if w.name == name]
    if not found:
        raise WebhookNotFoundError(f"no webhook is named {name!r} (SPHEREFACE_WEBHOOKS)")
    return found


@router.get(
    "/events/dead-letters",
    operation_id="list_dead_letters",
    response_model=DeadLetterPage,
    summary="Events a webhook did not take after every attempt, newest first",
)
def dead_letters(
    request: Request,
    webhook: Annotated[str | None, Query(description="only this webhook's", max_length=64)] = None,
    limit: Annotated[int, Query(ge=1, le=1000, description="at most this many per webhook")] = 100,
) -> DeadLetterPage:
    """Errors: `webhook_not_found` (404)."""
    state = request.app.state
    letters = [
        DeadLetterOut(**letter.__dict__)
        for endpoint in _webhooks(request, webhook)
        for letter in list_dead_letters(state.redis, state.settings.redis_prefix, endpoint.name, limit)
    ]
    return DeadLetterPage(dead_letters=letters)


@router.post(
    "/events/dead-letters/{webhook}/{letter_id}/redeliver",
    operation_id="redeliver_dead_letter",
    response_model=DeadLetterDone,
    status_code=202,
    summary="Send a dead letter's event to its webhook again (same event id)",
)
def redeliver(request: Request, webhook: WebhookName, letter_id: LetterId) -> DeadLetterDone:
    """The event goes back on the stream for this webhook only, with its attempts counted
    afresh; the dead letter is deleted. Errors: `webhook_not_found`, `dead_letter_not_found` (404)."""
    _webhooks(request, webhook)
    settings = request.app.state.settings
    event = redeliver_dead_letter(
        request.app.state.redis, settings.redis_prefix, webhook, letter_id, settings.events_stream_maxlen
    )
    if event is None:
        raise DeadLetterNotFoundError(f"webhook {webhook!r} has no dead letter {letter_id}")
    return DeadLetterDone(id=letter_id, webhook=webhook, event_id=event.id)


@router.delete(
    "/events/dead-letters/{webhook}/{letter_id}",
    operation_id="delete_dead_letter",
    response_model=DeadLetterDone,
    summary="Delete a dead letter",
)
def delete(request: Request, webhook: WebhookName, letter_id: LetterId) -> DeadLetterDone:
    """Errors: `webhook_not_found`, `dead_letter_not_found` (404)."""
    _webhooks(request, webhook)
    state = request.app.state
    if not delete_dead_letter(state.redis, state.settings.redis_prefix, webhook, letter_id):
        raise DeadLetterNotFoundError(f"webhook {webhook!r} has no dead letter {letter_id}")
    return DeadLetterDone(id=letter_id, webhook=webhook)
