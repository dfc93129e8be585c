"""The envelope of the control and broadcast sockets: every message is two frames, [deployment id, payload].

A deployment id is made once per deployment (by `dpserve serve`, or by the coordinator when started alone) and
handed to the engines and frontends it starts (`--deployment-id`). Each side drops a message whose id is not its
own and logs that once per foreign id, so a peer of another deployment that reaches a reused port (a lingering
engine re-registering, a stopping coordinator's broadcast) cannot act on this one.

A peer started by hand without `--deployment-id` is *unbound*: it registers with an empty id and adopts the id
of the coordinator that accepts it (and of a restarted one). The coordinator accepts an empty id only on the
messages such a peer sends before it knows the id: RegisterEngine, RegisterFrontend and ScaleRequest.

The data path (frontends <-> engines) has no envelope: a frontend only learns engine addresses from its own
deployment's topology, and an engine only answers the frontend that sent the request.
"""

from __future__ import annotations

import logging
import os
import uuid
from typing import Any

import msgspec

from dpserve_shared.codec import encode
from dpserve_shared.schema import RegisterAck

DEPLOYMENT_ID_ENV = "DPSERVE_DEPLOYMENT_ID"


def new_deployment_id() -> str:
    return f"dep-{uuid.uuid4().hex[:12]}"


def deployment_id_from_env() -> str:
    return os.environ.get(DEPLOYMENT_ID_ENV, "")


def frames(deployment_id: str, msg: Any) -> list[bytes]:
    return [deployment_id.encode(), encode(msg)]


def split(parts: list[bytes]) -> tuple[str, bytes] | None:
    """(deployment id, payload), or None for a message that is not enveloped (an older dpserve, a stray peer)."""
    if len(parts) != 2:
        return None
    return parts[0].decode(errors="replace"), parts[1]


class DeploymentGuard:
    """Which deployment a peer belongs to, and the once-per-id log of what it drops.

    `pinned`: the id was given (`--deployment-id`, or the coordinator's own) and never changes. Unpinned, the id
    is adopted from each accepted RegisterAck (`adopt`) and an empty id is sent on registration."""

    def __init__(self, deployment_id: str, log: logging.Logger, what: str):
        self.deployment_id = deployment_id
        self.pinned = bool(deployment_id)
        self._log = log
        self._what = what
        self._reported: set[str] = set()
        self._reported_unenveloped = False
        self.num_dropped = 0

    @property
    def registration_id(self) -> str:
        """The id a RegisterEngine/RegisterFrontend goes out with."""
        return self.deployment_id if self.pinned else ""

    def admits(self, sender_id: str, may_be_unbound: bool = False) -> bool:
        if sender_id == self.deployment_id or (may_be_unbound and not sender_id) or not self.deployment_id:
            return True
        self.num_dropped += 1
        if sender_id not in self._reported:
            self._reported.add(sender_id)
            self._log.warning(
                "dropped a message on the %s from deployment %r (this is %r): another deployment's peer reached "
                "this port; further messages from it are dropped silently",
                self._what, sender_id or "(unbound)", self.deployment_id,
            )
        return False

    def open(
        self, parts: list[bytes], decoder: Any, what: str = "message from the coordinator", unbound_ok: tuple = ()
    ) -> Any:
        """The message in `parts` if it is this deployment's, else None (undecodable: logged; not enveloped or
        another deployment's: logged once). An accepted RegisterAck first makes an unpinned peer adopt its
        sender's id; messages of the `unbound_ok` types may come with an empty id (a peer started by hand)."""
        envelope = split(parts)
        if envelope is None:
            if not self._reported_unenveloped:
                self._reported_unenveloped = True
                self._log.warning("dropped a %s of %d frames on the %s: not a dpserve peer of this release; "
                                  "further ones are dropped silently", what, len(parts), self._what)
            return None
        deployment_id, data = envelope
        try:
            message = decoder.decode(data)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            self._log.error("undecodable %s: %s", what, e)
            return None
        if isinstance(message, RegisterAck) and message.accepted:
            self.adopt(deployment_id)
        return message if self.admits(deployment_id, may_be_unbound=isinstance(message, unbound_ok)) else None

    def adopt(self, deployment_id: str) -> None:
        """An accepted RegisterAck: an unpinned peer follows the deployment that accepted it."""
        if not self.pinned and deployment_id and deployment_id != self.deployment_id:
            self._log.info("joined deployment %s", deployment_id)
            self.deployment_id = deployment_id
