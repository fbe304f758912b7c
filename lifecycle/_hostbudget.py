"""How many host bytes this process may hold: explicit budgets, or derived from the machine.

A derived budget starts from what the process may still use: the tightest cgroup limit on
its path (v2 ``memory.max``, v1 ``memory.limit_in_bytes``; v1's "unlimited" is a huge
sentinel, read as no cap), less what the cgroup uses that cannot be reclaimed (page cache,
``memory.stat``'s ``file`` / ``total_cache``, is reclaimable), and ``/proc/meminfo``'s
``MemAvailable`` (which already counts reclaimable cache). The smaller of the two, less a
reserve, is split evenly between the ranks of one node (``LOCAL_WORLD_SIZE``, or ``serve
--nproc``), so that the ranks' budgets together still fit the node.

Every reader takes the paths it reads (``cgroup_root``, ``proc_cgroup``, ``meminfo``), so
tests run against fake trees and files, never the machine's.
"""

from __future__ import annotations

import os
import resource
from dataclasses import dataclass
from pathlib import Path

from ._planner import parse_budget
from ._units import format_bytes

__all__ = ["HostBudgets", "HostLimits", "derive_budgets", "local_world_size",
           "read_cgroup", "read_limits", "read_meminfo"]

# cgroup v1 writes "no limit" as the largest page-aligned signed 64-bit value (or near it,
# depending on the page size); anything from 2**62 up is read as no cap.
V1_UNLIMITED = 2**62
# What a derived budget leaves to the rest of the process and the machine: 10% of the
# headroom, at least 256 MiB and at most 4 GiB.
RESERVE_SHARE, RESERVE_MIN, RESERVE_MAX = 0.10, 256 * 2**20, 4 * 2**30


@dataclass(frozen=True)
class CgroupMemory:
    """The tightest memory limit on a cgroup path, and that cgroup's use of it."""

    limit: int
    usage: int
    reclaimable: int  # page cache charged to it (memory.stat file / total_cache)
    path: str  # the cgroup directory whose limit it is

    @property
    def headroom(self) -> int:
        return max(0, self.limit - self.usage + min(self.reclaimable, self.usage))


@dataclass(frozen=True)
class HostLimits:
    """What the machine and the process's cgroups leave it: ``available`` (MemAvailable),
    ``total`` (MemTotal), the tightest cgroup (None: no cgroup caps memory)."""

    total: int
    available: int
    cgroup: CgroupMemory | None = None
    memlock: int | None = None  # RLIMIT_MEMLOCK (None: unlimited)

    @property
    def headroom(self) -> int:
        """Bytes the process may still take: the smaller of the machine's and the cgroup's."""
        return self.available if self.cgroup is None else min(self.available,
                                                              self.cgroup.headroom)

    def describe(self) -> str:
        where = f"MemAvailable {format_bytes(self.available)}"
        if self.cgroup is not None:
            where += (f", cgroup {self.cgroup.path} limit {format_bytes(self.cgroup.limit)} "
                      f"using {format_bytes(self.cgroup.usage)} "
                      f"({format_bytes(self.cgroup.reclaimable)} page cache)")
        return where


def read_meminfo(path: str | os.PathLike[str] = "/proc/meminfo") -> tuple[int, int]:
    """``(MemTotal, MemAvailable)`` in bytes from a meminfo file (``MemFree + Cached`` where
    an old kernel has no MemAvailable)."""
    fields: dict[str, int] = {}
    for line in Path(path).read_text().splitlines():
        name, _, rest = line.partition(":")
        parts = rest.split()
        if parts and parts[0].isdigit():
            fields[name.strip()] = int(parts[0]) * (1024 if parts[1:2] == ["kB"] else 1)
    if "MemTotal" not in fields:
        raise ValueError(f"{path}: no MemTotal line")
    available = fields.get("MemAvailable",
                           fields.get("MemFree", 0) + fields.get("Cached", 0))
    return fields["MemTotal"], available


def _read_int(path: Path) -> int | None:
    """An integer file's value; None for ``max``, a missing or unreadable file."""
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _stat(path: Path, *keys: str) -> int:
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return 0
    values = dict(line.split(None, 1) for line in lines if " " in line)
    for key in keys:
        if key in values and values[key].strip().isdigit():
            return int(values[key])
    return 0


def read_cgroup(cgroup_root: str | os.PathLike[str] = "/sys/fs/cgroup",
                proc_cgroup: str | os.PathLike[str] = "/proc/self/cgroup"
                ) -> CgroupMemory | None:
    """The tightest memory limit on the process's cgroup path, v2 or v1 (v2 wins where both
    are mounted); None where no cgroup on the path caps memory."""
    root = Path(cgroup_root)
    try:
        lines = Path(proc_cgroup).read_text().splitlines()
    except OSError:
        return None
    found: list[CgroupMemory] = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, rel = parts
        if controllers == "":  # v2: the unified hierarchy
            got = _tightest(root, rel, "memory.max", "memory.current", ("file",), v1=False)
        elif "memory" in controllers.split(","):
            got = _tightest(root / "memory", rel, "memory.limit_in_bytes",
                            "memory.usage_in_bytes", ("total_cache", "cache"), v1=True)
        else:
            continue
        if got is not None:
            found.append(got)
    return min(found, key=lambda c: c.headroom) if found else None


def _tightest(mount: Path, rel: str, limit_file: str, usage_file: str,
              cache_keys: tuple[str, ...], *, v1: bool) -> CgroupMemory | None:
    """The smallest limit from the cgroup ``rel`` up to ``mount`` (a namespaced path that is
    not under the mount is read from the mount itself, as a container sees its own root)."""
    leaf = mount / rel.lstrip("/")
    if not leaf.is_dir():
        leaf = mount
    best: CgroupMemory | None = None
    here = leaf
    while True:
        limit = _read_int(here / limit_file)
        if limit is not None and not (v1 and limit >= V1_UNLIMITED):
            usage = _read_int(here / usage_file) or 0
            cache = _stat(here / "memory.stat", *cache_keys)
            cg = CgroupMemory(limit, usage, cache, "/" + str(here.relative_to(mount)).strip("."))
            if best is None or cg.headroom < best.headroom:
                best = cg
        if here == mount or mount not in here.parents:
            break
        here = here.parent
    return best


def _memlock() -> int | None:
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    return None if soft == resource.RLIM_INFINITY else int(soft)


def read_limits(cgroup_root: str | os.PathLike[str] = "/sys/fs/cgroup",
                proc_cgroup: str | os.PathLike[str] = "/proc/self/cgroup",
                meminfo: str | os.PathLike[str] = "/proc/meminfo",
                memlock: int | bool | None = True) -> HostLimits:
    """The machine's and the cgroups' limits as this process sees them (``memlock=True``:
    read RLIMIT_MEMLOCK; an int or None: that value)."""
    total, available = read_meminfo(meminfo)
    lock = _memlock() if memlock is True else (None if memlock is False else memlock)
    return HostLimits(total, available, read_cgroup(cgroup_root, proc_cgroup), lock)


def local_world_size(explicit: int | None = None) -> int:
    """Ranks of this node: ``explicit``, else ``LOCAL_WORLD_SIZE`` (torchrun, serve
    --nproc), else 1."""
    if explicit is not None:
        n = explicit
    else:
        text = os.environ.get("LOCAL_WORLD_SIZE", "1")
        try:
            n = int(text)
        except ValueError:
            raise ValueError(f"LOCAL_WORLD_SIZE must be a whole number of ranks, got "
                             f"{text!r}") from None
    if n < 1:
        raise ValueError(f"ranks per node must be 1 or more, got {n}")
    return n


@dataclass(frozen=True)
class HostBudgets:
    """This rank's host and pin budgets in bytes (None: no cap) and how they were found."""

    host: int | None
    pin: int | None
    source: str  # "explicit", "derived: ...", or "none"
    ranks: int = 1


Spec = int | float | str | None


def _explicit(spec: Spec, what: str) -> int | str | None:
    """Bytes of an explicit budget, None for none, or the text left to derive (``"auto"``,
    a percentage: checked now)."""
    if spec is None:
        return None
    if isinstance(spec, str) and (spec.strip().lower() == "auto" or spec.strip().endswith("%")):
        text = spec.strip().lower()
        if text != "auto":
            parse_budget(text, free_bytes=1, pipeline_bytes=1, what=what)
        return text
    return parse_budget(spec, free_bytes=None, pipeline_bytes=0, what=what)


def derive_budgets(host: Spec, pin: Spec = None, *, ranks: int = 1,
                   limits: HostLimits | None = None, reserve: int | None = None,
                   split_explicit: bool = False) -> HostBudgets:
    """This rank's budgets from what the caller gave: bytes or a size string (``"64GiB"``,
    this rank's own, or the node's split over ``ranks`` with ``split_explicit``), a
    percentage of the headroom (``"80%"``, split over ``ranks``), ``"auto"`` (the headroom
    less ``reserve``, split over ``ranks``), or None (no cap). The pin budget defaults to
    the host budget, capped by RLIMIT_MEMLOCK where one is set; ``limits`` is read from the
    machine when a derived budget needs it."""
    got_host, got_pin = _explicit(host, "host budget"), _explicit(pin, "pin budget")
    derived: list[str] = []

    def read() -> HostLimits:
        nonlocal limits
        if limits is None:
            limits = read_limits()
        return limits

    def resolve(value: int | str | None, what: str) -> int | None:
        if value is None or isinstance(value, int):
            if value is not None and split_explicit:
                return value // ranks
            return value
        lim = read()
        if value != "auto":
            whole = parse_budget(value, free_bytes=lim.headroom, pipeline_bytes=0, what=what)
        else:
            keep = reserve if reserve is not None else int(min(
                RESERVE_MAX, max(RESERVE_MIN, lim.headroom * RESERVE_SHARE)))
            whole = max(0, lim.headroom - keep)
        derived.append(f"{what} {value} of {lim.describe()}"
                       + (f" / {ranks} ranks" if ranks > 1 else ""))
        return whole // ranks

    host_bytes = resolve(got_host, "host budget")
    pin_bytes = resolve(got_pin, "pin budget")
    if got_pin is None and host_bytes is not None:
        pin_bytes = host_bytes
    if isinstance(got_pin, str) or (got_pin is None and isinstance(got_host, str)):
        lock = read().memlock
        if lock is not None and pin_bytes is not None:
            pin_bytes = min(pin_bytes, lock)  # a limit per process: no split
    if host_bytes is not None and pin_bytes is not None:
        pin_bytes = min(pin_bytes, host_bytes)  # pinned bytes are host bytes
    source = "none" if host_bytes is None and pin_bytes is None else \
        ("derived: " + "; ".join(derived) if derived else "explicit")
    return HostBudgets(host_bytes, pin_bytes, source, ranks)
