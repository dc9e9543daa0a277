"""Where earlywarn's metrics and events go: console, JSONL, trackers, webhooks."""

from earlywarn.sinks.base import METRIC_PREFIX, Sink, make_sink, register_sink, registered_sinks

__all__ = ["METRIC_PREFIX", "Sink", "make_sink", "register_sink", "registered_sinks"]
