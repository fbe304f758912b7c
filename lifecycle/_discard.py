"""Discard sleep, the controller's side: which components a sleep discards, the moves a sleep
and a wake prepare for them, and what a stale component refuses to serve.

A discarding sleep (``ctl.sleep(discard=...)``, or every release with the controller's
``discard_on_release``) drops a component's parameters and persistent buffers without a host
copy (see :mod:`strategies._discard`); the wake after gives them their places again with
undefined contents and the component is *stale* until updates have written every one of them.
A stale component serves nothing: its forwards, its ``use()``, a request naming it and its
checksum raise :class:`WeightsDiscarded`. A sleep of a stale component drops its stale tensors
again whatever ``discard`` says (garbage is never copied to the host).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from types import MappingProxyType
from typing import TYPE_CHECKING

from strategies.protocol import (
    DiscardMove,
    FileSleepMove,
    FileWakeMove,
    Move,
    UndiscardMove,
    Unit,
    prepare_discard,
    prepare_file_sleep,
    prepare_file_wake,
    prepare_undiscard,
)

from ._errors import InvalidRequest, WeightsDiscarded
from ._results import UpdateResult

if TYPE_CHECKING:
    from ._uses import AttachedComponent

Progress = Callable[[int], None]

__all__ = ["Discard", "prepare_sleep", "prepare_wake", "refuse_stale", "resolve_discard",
           "stale_counts", "stale_note", "stale_tensors", "with_stale"]

#: What ``discard`` may be: nothing (``None``, ``False``), every component (``True``,
#: ``"all"``), or the names of some (a sequence, or one string of comma-separated names).
Discard = bool | str | Sequence[str] | None


def resolve_discard(discard: Discard, components: Collection[str], field: str = "discard"
                    ) -> frozenset[str]:
    """The components ``discard`` names (InvalidRequest, naming the valid ones, for a name
    the pipeline lacks or a value of another kind); ``field``: the argument it came from."""
    if discard is None or discard is False:
        return frozenset()
    if discard is True or discard == "all":
        return frozenset(components)
    if isinstance(discard, str):
        names = [n.strip() for n in discard.split(",") if n.strip()]
    elif isinstance(discard, Sequence) and all(isinstance(n, str) for n in discard):
        names = list(discard)
    else:
        raise InvalidRequest(field, f"{field} must be true/false, 'all' or a list of "
                                    f"component names, got {discard!r}")
    unknown = sorted(set(names) - set(components))
    if unknown:
        raise InvalidRequest(field, f"{field} names unknown components {unknown}; "
                                    f"components: {sorted(components)} (or true / 'all')")
    return frozenset(names)


async def prepare_sleep(c: AttachedComponent, units: list[Unit], progress: Progress | None,
                        discard: frozenset[str]) -> Move | DiscardMove | FileSleepMove:
    """The sleep of ``c``: discarding when named in ``discard`` or stale, file-backed when
    its weights are still its recorded checkpoint files' (strategies._filebacked), else the
    usual one of ``units`` (its device units)."""
    store = c.strategy.store
    move = await prepare_discard(store, c.name in discard, progress)
    if move is not None:
        return move
    backed = await prepare_file_sleep(store, progress)
    return backed if backed is not None else await store.prepare_to_host(units,
                                                                          progress=progress)


async def prepare_wake(c: AttachedComponent, units: list[Unit], progress: Progress | None
                       ) -> Move | UndiscardMove | FileWakeMove:
    """The wake of ``c``: every unit placed again after a discarding sleep (its tensors read
    back from its files after a file-backed one), else the usual one of ``units`` (its awake
    units on the host)."""
    store = c.strategy.store
    if store.file_backing is not None and store.file_backing.asleep:
        return await prepare_file_wake(store, c.strategy.awake_units(), progress)
    if store.discarded is not None:
        return await prepare_undiscard(store, c.strategy.awake_units(), progress)
    return await store.prepare_to_device(units, progress)


def stale_counts(components: Iterable[AttachedComponent]) -> dict[str, int]:
    """``{name: stale tensors}`` of the stale ones among ``components`` (not one asleep
    file-backed: its tensors come back from its files at wake)."""
    return {c.name: c.strategy.store.stale_count for c in components
            if c.strategy.store.stale_count and not _backed(c)}


def _backed(c: AttachedComponent) -> bool:
    backing = c.strategy.store.file_backing
    return backing is not None and backing.asleep


def stale_tensors(components: Iterable[AttachedComponent]) -> dict[str, tuple[int, tuple[str, ...]]]:
    """``{name: (stale tensors, the first three of their names)}`` of the stale ones among
    ``components`` (what an update's answer names)."""
    return {c.name: (c.strategy.store.stale_count, tuple(c.strategy.store.stale_names()[:3]))
            for c in components if c.strategy.store.stale_count}


def stale_note(few: Mapping[str, tuple[int, Sequence[str]]]) -> str:
    """What an update's message adds while some components are stale (:func:`stale_tensors`):
    each one's stale tensors, how many and a few names ("" when none is)."""
    return "" if not few else "; still stale (not served until updated): " + ", ".join(
        f"{n} ({k} tensor(s): {', '.join(names)}...)" for n, (k, names) in few.items())


def refuse_stale(components: Iterable[AttachedComponent]) -> None:
    """Raise :class:`WeightsDiscarded` naming every stale one among ``components``."""
    stale = {c.name: c.strategy.store.stale_names() for c in components
             if c.strategy.store.stale_count}
    if stale:
        raise WeightsDiscarded(stale)


def with_stale(result: UpdateResult, components: Collection[AttachedComponent]) -> UpdateResult:
    """An update's ``result`` naming the components still stale: ``stale`` (how many tensors
    each) and ``stale_tensors`` (a few names), and, for a success, those in the message
    (:func:`stale_note`)."""
    stale = stale_counts(components)
    few = stale_tensors(components)
    if stale and result.success:
        result = dataclasses.replace(result, message=result.message + stale_note(few))
    return dataclasses.replace(result, stale=MappingProxyType(stale),
                               stale_tensors=MappingProxyType(few))
