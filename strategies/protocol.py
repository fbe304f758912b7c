"""The plumbing the lifecycle drives: one component's tensors (:class:`TensorStore`, its
units), the moves that place them (prepared, then committed or undone: placement, writes,
regrouping, restoring, discarding), the strategy factory, the forward guard, and
:func:`forget_locals` (what a failed move's traceback must not keep alive), and
:func:`to_thread` (work in a worker thread that lets go of its tensors before the caller
goes on).

``lifecycle`` imports only :mod:`strategies` and this module. Someone writing a strategy
of their own needs these types too; a user placing a pipeline does not (see
:mod:`strategies`).
"""

from ._base import ResidencyStrategy
from ._discard import DiscardMove, UndiscardMove, prepare_discard, prepare_undiscard
from ._errors import forget_locals
from ._factory import Shape, build_strategy
from ._filebacked import (
    FileSleepMove,
    FileWakeMove,
    covered,
    forget_files,
    prepare_file_sleep,
    prepare_file_wake,
    record_files,
)
from ._fileread import FileRegion, safetensors_regions
from ._guard import ComputeGuard
from ._inventory import Unit
from ._layerwise import check_block_lists
from ._offload import ComponentOffloadStrategy, SnapshotOffloadStrategy
from ._regroup import (
    RegroupMove,
    RestoreMove,
    needs_restore,
    prepare_regroup,
    prepare_restore,
    regroup_device_bytes,
    regroup_host_plan,
)
from ._resident import ResidentStrategy
from ._store import KeptMirrors, Move, PreparedMove, StoreReport, TensorStore
from ._threads import to_thread
from ._write import WriteMove, WriteSource, host_backup_bytes

__all__ = [
    "ComponentOffloadStrategy",
    "ComputeGuard",
    "DiscardMove",
    "FileRegion",
    "FileSleepMove",
    "FileWakeMove",
    "KeptMirrors",
    "Move",
    "PreparedMove",
    "RegroupMove",
    "ResidencyStrategy",
    "ResidentStrategy",
    "RestoreMove",
    "Shape",
    "SnapshotOffloadStrategy",
    "StoreReport",
    "TensorStore",
    "UndiscardMove",
    "Unit",
    "WriteMove",
    "WriteSource",
    "build_strategy",
    "check_block_lists",
    "covered",
    "forget_files",
    "forget_locals",
    "host_backup_bytes",
    "needs_restore",
    "prepare_discard",
    "prepare_file_sleep",
    "prepare_file_wake",
    "prepare_regroup",
    "prepare_restore",
    "prepare_undiscard",
    "record_files",
    "regroup_device_bytes",
    "regroup_host_plan",
    "safetensors_regions",
    "to_thread",
]
