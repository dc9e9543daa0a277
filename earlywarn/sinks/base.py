"""The sink contract (accelerate's ``GeneralTracker`` plus ``alert``) and the sink registry.

A sink receives flat scalar metrics, events and checkpoint records. Tracker SDKs are imported
lazily inside ``start()``, so importing earlywarn never imports wandb or mlflow.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

from earlywarn.events import Event

METRIC_PREFIX = "earlywarn/"


class PermanentSinkError(Exception):
    """Raised by a sink when retrying the same record cannot succeed (a rejected value, a 4xx).

    The background wrapper drops that record (and counts it) instead of retrying it; any other
    exception is treated as transient (tracker down or slow) and retried with backoff.
    """


class Sink:
    """Base class for everything that receives earlywarn's output.

    Subclasses override what they support. ``start`` and ``finish`` must be idempotent: calling
    either twice is harmless. ``main_process_only`` sinks are started on rank 0 alone under
    ``torch.distributed``.
    """

    name: str = "sink"
    main_process_only: bool = True
    io_bound: bool = False
    """True for sinks that talk to a tracker or the network: ``build_sinks`` runs them on a
    background thread (:class:`earlywarn.sinks.background.BackgroundSink`) so the training thread
    never waits on them."""

    def start(self) -> None:
        """Open files / runs / connections. Safe to call twice."""

    def log_metrics(self, step: int, metrics: Mapping[str, float]) -> None:
        """Record flat scalar metrics (keys already carry the ``earlywarn/`` prefix)."""

    def log_metrics_batch(self, records: Sequence[tuple[int, Mapping[str, float], float]]) -> None:
        """Record several steps at once: ``(step, metrics, unix_time)`` tuples, oldest first.

        The background wrapper calls this with what piled up while the tracker was busy; backends
        with a batch API (MLflow ``log_batch``) override it, and keep the recorded time.
        """
        for step, metrics, _ in records:
            self.log_metrics(step, metrics)

    def alert(self, event: Event) -> None:
        """Record (and, where the backend can, notify about) one event."""

    def checkpoint(self, step: int, path: str, reason: str) -> None:
        """Record that a checkpoint was written (``reason``: "periodic", "warning", ...)."""

    def flush(self, timeout: float | None = None) -> bool:
        """Push out anything buffered; True when nothing is left."""
        return True

    def finish(self) -> None:
        """Flush and close. Safe to call twice."""


SinkFactory = Callable[..., Sink]
_REGISTRY: dict[str, str | SinkFactory] = {
    # name -> "module:attribute" (imported on first use) or a factory
    "console": "earlywarn.sinks.console:ConsoleSink",
    "jsonl": "earlywarn.sinks.jsonl:JsonlSink",
    "webhook": "earlywarn.sinks.webhook:WebhookSink",
    "mlflow": "earlywarn.integrations.mlflow_sink:MlflowSink",
    "wandb": "earlywarn.integrations.wandb_sink:WandbSink",
}


def register_sink(name: str, factory: str | SinkFactory, *, overwrite: bool = False) -> None:
    """Make ``sinks=[name]`` build ``factory(**options)``.

    ``factory`` is a callable or a lazy ``"package.module:Class"`` path.
    """
    if not name or not isinstance(name, str):
        raise ValueError(f"sink name must be a non-empty string, got {name!r}")
    if name in _REGISTRY and not overwrite:
        raise ValueError(f"a sink named {name!r} is already registered: pass overwrite=True to replace it")
    _REGISTRY[name] = factory


def registered_sinks() -> list[str]:
    return sorted(_REGISTRY)


def make_sink(spec: "str | Sink", options: Mapping[str, Any] | None = None) -> Sink:
    """Build a sink from a registered name (with ``options``) or pass a Sink instance through."""
    if isinstance(spec, Sink):
        return spec
    if not isinstance(spec, str):
        raise TypeError(
            f"a sink is a registered name or an earlywarn.sinks.Sink instance, got {type(spec).__name__}"
        )
    try:
        factory = _REGISTRY[spec]
    except KeyError:
        raise ValueError(
            f"unknown sink {spec!r}: registered sinks are {', '.join(registered_sinks())}; "
            "add your own with earlywarn.sinks.register_sink(name, factory)"
        ) from None
    if isinstance(factory, str):
        import importlib

        module, _, attr = factory.partition(":")
        factory = getattr(importlib.import_module(module), attr)
    return factory(**dict(options or {}))
