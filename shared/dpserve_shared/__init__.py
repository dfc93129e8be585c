"""dpserve's wire schema and codec: the only code the services share."""

from dpserve_shared.codec import Decoder, ProtocolMismatch, check_protocol, encode
from dpserve_shared.schema import PROTOCOL_VERSION

__all__ = ["PROTOCOL_VERSION", "Decoder", "ProtocolMismatch", "check_protocol", "encode"]
