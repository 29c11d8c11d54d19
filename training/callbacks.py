"""Periodic work of the training loops, as callbacks.

A loop ends every ``log_every`` steps a log interval with a row of interval means and passes it
to its :class:`Callbacks` in order (``on_interval``): a check may add values to the row (the LFW
check's accuracy, the CIFAR test accuracy) or stop the run by raising :class:`RunStopped` or
``FloatingPointError``, a log writes the row. After every step each callback gets ``on_step``
(the progress bar, the checkpoint), and ``close`` when the loop ends, finished or not.

Both loops use :class:`History` and :class:`ProgressBar`; the face trainer adds its health check
(:class:`training.health.HealthCheck`), LFW check (:class:`training.lfw_check.LFWEvaluation`),
CSV log (:class:`training.run_log.CsvLog`) and :class:`Checkpointer`; the CIFAR loop its periodic
test accuracy (:class:`training.cifar.PeriodicTest`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any


class RunStopped(RuntimeError):
    """A check stopped the run (the run cannot recover); the callbacks record why (``on_stop``)."""


@dataclass
class Interval:
    """One log interval's end, as the callbacks see it."""

    #: Steps done so far (the interval's last step, 1-based).
    done: int
    #: Whether ``done`` is the run's last step.
    is_last: bool
    #: The interval's log row; callbacks may add values to it.
    row: dict[str, Any] = field(default_factory=dict)


class Callback:
    """A piece of periodic work; every method does nothing unless a callback overrides it."""

    def on_interval(self, interval: Interval) -> None:
        """At the end of a log interval (after the interval's row is made)."""

    def on_stop(self, interval: Interval, error: BaseException) -> None:
        """When an ``on_interval`` of this interval stopped the run with ``error``."""

    def on_step(self, done: int) -> None:
        """After every step (and after ``on_interval`` when the step ends an interval)."""

    def close(self) -> None:
        """When the loop ends, finished or not."""


class Callbacks:
    """The callbacks of one loop, called in order."""

    #: Errors with which an ``on_interval`` stops the run.
    STOPS = (RunStopped, FloatingPointError)

    def __init__(self, callbacks: Iterable[Callback | None] = ()) -> None:
        self.callbacks = [callback for callback in callbacks if callback is not None]

    def on_interval(self, interval: Interval) -> None:
        """Every ``on_interval``; a stop error first goes to every ``on_stop``, then up."""
        try:
            for callback in self.callbacks:
                callback.on_interval(interval)
        except self.STOPS as error:
            for callback in self.callbacks:
                callback.on_stop(interval, error)
            raise

    def on_step(self, done: int) -> None:
        for callback in self.callbacks:
            callback.on_step(done)

    def close(self) -> None:
        for callback in self.callbacks:
            callback.close()


class History(Callback):
    """Every interval's row, in order (``rows[-1]`` is the latest)."""

    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []

    def on_interval(self, interval: Interval) -> None:
        self.rows.append(interval.row)

    @property
    def latest(self) -> dict[str, Any]:
        """The last row ({} before the first interval)."""
        return self.rows[-1] if self.rows else {}


class ProgressBar(Callback):
    """A tqdm bar over the run's steps, its postfix made from each interval's row."""

    def __init__(
        self,
        total: int,
        desc: str,
        postfix: Callable[[dict[str, Any]], dict[str, str]],
        *,
        initial: int = 0,
        enabled: bool = True,
        **tqdm_options: Any,
    ) -> None:
        from tqdm import tqdm

        self.postfix = postfix
        self.bar = tqdm(total=total, initial=initial, desc=desc, disable=not enabled, **tqdm_options)

    def on_interval(self, interval: Interval) -> None:
        self.bar.set_postfix(self.postfix(interval.row))

    def on_step(self, done: int) -> None:
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()


class Checkpointer(Callback):
    """``save(done, latest row)`` after every ``every`` steps (0: never) and after step ``until``, the
    session's last."""

    def __init__(self, save: Callable[[int, dict[str, Any]], None], every: int, until: int) -> None:
        self.save, self.every, self.until = save, every, until
        self.latest: dict[str, Any] = {}

    def on_interval(self, interval: Interval) -> None:
        self.latest = interval.row

    def on_step(self, done: int) -> None:
        if (self.every > 0 and done % self.every == 0) or done == self.until:
            self.save(done, self.latest)
