"""The one codec: msgpack through msgspec. No pickle anywhere on the wire."""

from __future__ import annotations

from typing import Any

import msgspec

from dpserve_shared.schema import PROTOCOL_VERSION, FromCoordinator, ToCoordinator, ToEngine, ToFrontend

_encoder = msgspec.msgpack.Encoder()


def encode(msg: Any) -> bytes:
    return _encoder.encode(msg)


class Decoder:
    """Decodes one direction's union; a message of another type is a `msgspec.ValidationError`."""

    def __init__(self, union: Any):
        self._decoder = msgspec.msgpack.Decoder(union)

    def decode(self, data: bytes | memoryview) -> Any:
        return self._decoder.decode(data)


def engine_decoder() -> Decoder:
    return Decoder(ToEngine)


def frontend_decoder() -> Decoder:
    return Decoder(ToFrontend)


def coordinator_decoder() -> Decoder:
    return Decoder(ToCoordinator)


def from_coordinator_decoder() -> Decoder:
    return Decoder(FromCoordinator)


class ProtocolMismatch(Exception):
    pass


def check_protocol(version: int) -> None:
    if version != PROTOCOL_VERSION:
        raise ProtocolMismatch(
            f"protocol version mismatch: peer speaks {version}, this side speaks {PROTOCOL_VERSION}; "
            "deploy services from the same dpserve release"
        )
