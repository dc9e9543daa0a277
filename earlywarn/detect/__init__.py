"""Streaming anomaly detection (pure numpy; never imports torch).

``Detector`` is a pure ``init`` / ``update`` pair; ``StreamingDetector`` wraps it with state for
the live hook and for replays of logged runs (one code path for both). ``peers`` holds the rules
other systems use, for side-by-side comparison.
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
