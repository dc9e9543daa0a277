"""Where earlywarn's metrics and events go: console, JSONL, trackers, webhooks."""

from earlywarn.sinks.background import BackgroundSink
from earlywarn.sinks.base import (
    METRIC_PREFIX, PermanentSinkError, Sink, SinkStarting, make_sink, redact_url, register_sink, registered_sinks,
)
from earlywarn.sinks.console import ConsoleSink
from earlywarn.sinks.defaults import build_sinks, default_sink_specs
from earlywarn.sinks.jsonl import JsonlSink

__all__ = [
    "METRIC_PREFIX", "BackgroundSink", "ConsoleSink", "JsonlSink", "PermanentSinkError", "Sink", "SinkStarting",
    "redact_url",
    "build_sinks", "default_sink_specs", "make_sink", "register_sink", "registered_sinks",
]
