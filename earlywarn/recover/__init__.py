"""Recovery: repair poisoned state, clean snapshots and atomic checkpoints, PaLM-style rewind and
batch skip with an exact data position, quarantine and blame (torch)."""

from .batches import BatchFingerprints, BatchRef, DataPosition
from .checkpoint import CheckpointInfo, CheckpointManager, load_checkpoint
from .data import DataPositionAdapter, ResumableAdapter, StatefulAdapter, data_position_adapter
from .errors import CheckpointError, DataPositionError, FingerprintMismatch, Halt
from .loader import ResumableLoader, dataset_fingerprint
from .loopstate import LoopState
from .recovery import Blame, QuarantineRecord, Recovery, RecoveryConfig, RewindReport
from .repair import FiniteBaseline, Flag, RepairAction, RepairReport, StateScan, repair_optimizer_state, scan_state
from .snapshot import Snapshot, SnapshotRing, capture_state, restore_state

__all__ = [
    "BatchFingerprints",
    "BatchRef",
    "Blame",
    "CheckpointError",
    "CheckpointInfo",
    "CheckpointManager",
    "DataPosition",
    "DataPositionAdapter",
    "DataPositionError",
    "FingerprintMismatch",
    "FiniteBaseline",
    "Flag",
    "Halt",
    "LoopState",
    "QuarantineRecord",
    "Recovery",
    "RecoveryConfig",
    "RepairAction",
    "RepairReport",
    "ResumableAdapter",
    "ResumableLoader",
    "RewindReport",
    "Snapshot",
    "SnapshotRing",
    "StateScan",
    "StatefulAdapter",
    "capture_state",
    "data_position_adapter",
    "dataset_fingerprint",
    "load_checkpoint",
    "repair_optimizer_state",
    "restore_state",
    "scan_state",
]
