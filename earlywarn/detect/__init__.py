"""Streaming anomaly detection (pure numpy; never imports torch).

``Detector`` is a pure ``init`` / ``update`` pair; ``StreamingDetector`` wraps it with state for
the live hook and for replays of logged runs (one code path for both). Inside: ``state`` (what
the detector remembers, one field table), ``work`` (the working vectors a step updates in place),
``rules`` (one function per rule, and the thresholds), ``calm`` and ``general`` (the two per-step
paths, computing the same numbers), ``columns`` (logged runs), ``messages`` (alerts in words).
``peers`` holds the rules other systems use, for side-by-side comparison.
"""

from earlywarn.detect.config import DetectorConfig
from earlywarn.detect.detector import Detector, DetectorState, StreamingDetector
from earlywarn.detect.observation import Observation, StepColumns
from earlywarn.detect.replay import ReplayResult, replay

__all__ = [
    "Detector",
    "DetectorConfig",
    "DetectorState",
    "Observation",
    "ReplayResult",
    "StepColumns",
    "StreamingDetector",
    "replay",
]
