"""The one error of payload decoding, and its refusal helper."""

from __future__ import annotations

from typing import NoReturn


class TransportError(ValueError):
    """A ``serialized_named_tensors`` entry could not be decoded; the message says why."""


def refuse(message: str) -> NoReturn:
    raise TransportError(message)


class PayloadModulesMismatch(TransportError):
    """The entry decoded, but its modules do not match ``target_modules`` (the reference's
    ``Missing tensor payload ...`` / ``Ambiguous tensor payload ...``)."""
