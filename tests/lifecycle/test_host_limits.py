"""Host budgets read from fake cgroup trees and meminfo files (never the test machine's)."""

from __future__ import annotations

from pathlib import Path

import pytest

from lifecycle._hostbudget import (
    HostLimits,
    derive_budgets,
    local_world_size,
    read_cgroup,
    read_limits,
    read_meminfo,
)

GiB = 2**30
MEMINFO = "MemTotal:       67108864 kB\nMemFree:         1048576 kB\n" \
          "MemAvailable:   33554432 kB\nCached:          8388608 kB\n"


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def v2_tree(tmp_path: Path, levels: dict[str, tuple[str, int, int]]) -> tuple[Path, Path]:
    """A cgroup v2 mount with ``{relative dir: (memory.max, memory.current, file)}`` and a
    /proc/self/cgroup naming the deepest one."""
    root = tmp_path / "cg"
    for rel, (limit, current, file) in levels.items():
        d = root / rel
        write(d / "memory.max", limit + "\n")
        write(d / "memory.current", f"{current}\n")
        write(d / "memory.stat", f"anon 100\nfile {file}\nkernel 5\n")
    deepest = max(levels, key=len)
    proc = write(tmp_path / "cgroup", f"0::/{deepest}\n")
    return root, proc


def test_meminfo_gives_total_and_available_in_bytes(tmp_path: Path) -> None:
    """MemTotal and MemAvailable are read in bytes (kB lines times 1024)."""
    assert read_meminfo(write(tmp_path / "meminfo", MEMINFO)) == (64 * GiB, 32 * GiB)


def test_meminfo_without_memavailable_falls_back_to_free_plus_cached(tmp_path: Path) -> None:
    """An old kernel's meminfo (no MemAvailable) counts MemFree plus Cached."""
    old = "MemTotal: 4194304 kB\nMemFree: 1048576 kB\nCached: 524288 kB\n"
    assert read_meminfo(write(tmp_path / "meminfo", old)) == (4 * GiB, GiB + GiB // 2)


def test_the_tightest_v2_limit_on_the_path_wins_and_page_cache_is_reclaimable(
        tmp_path: Path) -> None:
    """A parent's smaller memory.max caps the child (``max`` is no cap), and page cache
    charged to it counts as reclaimable."""
    root, proc = v2_tree(tmp_path, {
        "kubepods": (str(8 * GiB), 6 * GiB, 2 * GiB),
        "kubepods/pod1": ("max", 5 * GiB, GiB),
        "kubepods/pod1/ctr": (str(16 * GiB), 5 * GiB, GiB),
    })
    cg = read_cgroup(root, proc)
    assert cg is not None
    assert (cg.path, cg.limit, cg.usage, cg.reclaimable) == ("/kubepods", 8 * GiB, 6 * GiB,
                                                             2 * GiB)
    assert cg.headroom == 4 * GiB


def test_v2_without_any_limit_is_no_cap(tmp_path: Path) -> None:
    """memory.max of ``max`` everywhere on the path: no cgroup cap."""
    root, proc = v2_tree(tmp_path, {"a": ("max", GiB, 0), "a/b": ("max", GiB, 0)})
    assert read_cgroup(root, proc) is None


def test_v1_limit_is_read_and_its_unlimited_sentinel_is_no_cap(tmp_path: Path) -> None:
    """cgroup v1's memory.limit_in_bytes caps; its huge "unlimited" value does not."""
    root = tmp_path / "cg"
    mem = root / "memory" / "docker" / "abc"
    write(mem / "memory.limit_in_bytes", f"{3 * GiB}\n")
    write(mem / "memory.usage_in_bytes", f"{GiB}\n")
    write(mem / "memory.stat", f"cache 100\ntotal_cache {GiB // 2}\n")
    write(root / "memory" / "docker" / "memory.limit_in_bytes", "9223372036854771712\n")
    proc = write(tmp_path / "cgroup", "4:cpu,cpuacct:/docker/abc\n3:memory:/docker/abc\n")
    cg = read_cgroup(root, proc)
    assert cg is not None
    assert (cg.limit, cg.usage, cg.reclaimable, cg.headroom) == (3 * GiB, GiB, GiB // 2,
                                                                  2 * GiB + GiB // 2)
    write(mem / "memory.limit_in_bytes", "9223372036854771712\n")
    assert read_cgroup(root, proc) is None


def test_a_namespaced_path_not_under_the_mount_reads_the_mount_itself(tmp_path: Path) -> None:
    """Inside a container /proc/self/cgroup may name a path the mount lacks: the mount's
    own files are the container's."""
    root = tmp_path / "cg"
    write(root / "memory.max", f"{2 * GiB}\n")
    write(root / "memory.current", f"{GiB}\n")
    proc = write(tmp_path / "cgroup", "0::/../../host/slice\n")
    cg = read_cgroup(root, proc)
    assert cg is not None and (cg.limit, cg.headroom) == (2 * GiB, GiB)


def test_no_proc_cgroup_file_is_no_cap(tmp_path: Path) -> None:
    """A process whose /proc/self/cgroup cannot be read has no cgroup cap."""
    assert read_cgroup(tmp_path, tmp_path / "absent") is None


def test_derived_budget_is_the_smaller_headroom_less_a_reserve_split_per_rank(
        tmp_path: Path) -> None:
    """auto: min(MemAvailable, cgroup headroom) less the reserve, split between the ranks of
    the node, so that the ranks' sum fits the headroom."""
    root, proc = v2_tree(tmp_path, {"job": (str(20 * GiB), 4 * GiB, 0)})
    limits = read_limits(root, proc, write(tmp_path / "meminfo", MEMINFO), memlock=None)
    assert limits.headroom == 16 * GiB
    one = derive_budgets("auto", ranks=1, limits=limits, reserve=GiB)
    two = derive_budgets("auto", ranks=2, limits=limits, reserve=GiB)
    assert (one.host, one.pin) == (15 * GiB, 15 * GiB)
    assert (two.host, two.pin) == (15 * GiB // 2, 15 * GiB // 2)
    assert two.host is not None and 2 * two.host <= limits.headroom
    assert two.source.startswith("derived: host budget auto of MemAvailable 32.00 GiB, "
                                 "cgroup /job limit 20.00 GiB")


def test_a_percentage_is_of_the_headroom_and_the_pin_budget_is_capped_by_memlock() -> None:
    """'50%' is half the headroom per node; a derived pin budget never passes
    RLIMIT_MEMLOCK (a limit per process, not split)."""
    limits = HostLimits(total=64 * GiB, available=40 * GiB, memlock=4 * GiB)
    got = derive_budgets("50%", ranks=4, limits=limits)
    assert (got.host, got.pin) == (5 * GiB, 4 * GiB)


def test_explicit_budgets_are_this_ranks_own_unless_split() -> None:
    """A size is the controller's own; serve passes the node's with split_explicit."""
    own = derive_budgets("8GiB", "2GiB", ranks=4)
    node = derive_budgets("8GiB", "2GiB", ranks=4, split_explicit=True)
    assert (own.host, own.pin, own.source) == (8 * GiB, 2 * GiB, "explicit")
    assert (node.host, node.pin) == (2 * GiB, GiB // 2)


def test_the_pin_budget_never_exceeds_the_host_budget() -> None:
    """Pinned bytes are host bytes: a pin budget above the host budget is cut to it."""
    assert derive_budgets(1000, 5000).pin == 1000


def test_no_budget_is_no_cap() -> None:
    """Neither given: no cap, said as 'none'."""
    assert derive_budgets(None) == derive_budgets(None, None)
    assert (derive_budgets(None).host, derive_budgets(None).source) == (None, "none")


@pytest.mark.parametrize(("spec", "message"), [
    ("lots", "invalid size 'lots'"),
    ("0%", "the percentage must be in (0, 100]"),
    (-1, "must be a non-negative number of bytes"),
])
def test_bad_budgets_are_refused_naming_what_is_valid(spec: str | int, message: str) -> None:
    """A malformed budget is a ValueError saying what a valid one looks like."""
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")
                       .replace("]", r"\]")):
        derive_budgets(spec)


def test_local_world_size_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """LOCAL_WORLD_SIZE counts the node's ranks; an explicit count wins; junk is refused."""
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert (local_world_size(), local_world_size(2)) == (8, 2)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "eight")
    with pytest.raises(ValueError, match="LOCAL_WORLD_SIZE must be a whole number"):
        local_world_size()
