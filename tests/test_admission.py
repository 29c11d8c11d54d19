"""Face-path turns (service.admission): a request holds a turn for its detection and embedding
only, and neither a turn nor a place in the queue while it waits on Redis; a request that gets no
turn in time is 503 `overloaded` with `Retry-After`."""

from __future__ import annotations

import asyncio
import threading

import pytest

from service.admission import FaceSlots, OverloadedError, Ticket


def test_a_request_waiting_on_redis_holds_no_place_at_the_door():
    slots = FaceSlots(limit=1, queue=0, wait=1.0)

    async def scenario():
        ticket = Ticket(slots)
        assert slots.full()  # one turn, no queue: the next request is refused at the door
        async with ticket.aside():  # e.g. reading the subject before the photos are detected
            assert not slots.full() and slots.admitted == 0
        assert slots.full()  # back in the queue for its turn
        async with ticket.turn():
            assert slots.active == 1
        assert (slots.active, slots.admitted) == (0, 0)  # the turn's end is the queue's end
        async with ticket.aside():  # storing the faces afterwards takes no place either
            assert slots.admitted == 0
        assert slots.admitted == 0

    asyncio.run(scenario())


def test_the_turn_is_for_the_work_only_and_is_given_back_on_errors():
    slots = FaceSlots(limit=1, queue=4, wait=5.0)
    threads: list[str] = []

    def work(value: int) -> int:
        threads.append(threading.current_thread().name)
        if value < 0:
            raise ValueError("bad photo")
        return value * 2

    async def scenario():
        assert await Ticket(slots).run(work, 21) == 42
        with pytest.raises(ValueError):
            await Ticket(slots).run(work, -1)
        assert (slots.active, slots.admitted) == (0, 0)
        assert await Ticket(slots).run(work, 1) == 2  # the turn came back after the error

    asyncio.run(scenario())
    assert threading.current_thread().name not in threads  # the work ran on a thread, not the loop


def test_no_turn_in_time_is_overloaded_with_retry_after():
    slots = FaceSlots(limit=1, queue=4, wait=0.2, retry_after=3)

    async def scenario():
        holder, late = Ticket(slots), Ticket(slots)
        async with holder.turn():
            with pytest.raises(OverloadedError) as refused:
                async with late.turn():
                    pass
        assert (
            refused.value.headers == {"Retry-After": "3"} and "no turn within 0.2 s" in refused.value.message
        )
        assert (slots.admitted, slots.shed) == (0, 1)

    asyncio.run(scenario())


def test_without_the_door_nothing_is_counted():
    """A request that came in without the Admission middleware (an app built without it)."""

    async def scenario():
        ticket = Ticket(None)
        async with ticket.aside(), ticket.turn() as threads:
            assert threads is None
        return await ticket.run(lambda: "ran")

    assert asyncio.run(scenario()) == "ran"
