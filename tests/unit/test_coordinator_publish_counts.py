"""The coordinator's count of what it publishes (server.py's PublishCounts, shown on its /status.json)."""

from __future__ import annotations

from dpserve_shared.envelope import frames
from dpserve_shared.schema import FrontendGone, LoadSnapshot

from dpserve_coordinator.server import PublishCounts


def test_counts_messages_and_bytes_by_type():
    counts = PublishCounts()
    for msg in (LoadSnapshot(loads=[]), LoadSnapshot(loads=[]), FrontendGone("f1")):
        counts.add(msg, frames("deployment", msg))
    snapshot_bytes = sum(len(p) for p in frames("deployment", LoadSnapshot(loads=[])))
    gone_bytes = sum(len(p) for p in frames("deployment", FrontendGone("f1")))
    assert counts.as_dict() == {
        "messages": 3, "bytes": 2 * snapshot_bytes + gone_bytes,
        "by_type": {"FrontendGone": {"messages": 1, "bytes": gone_bytes},
                    "LoadSnapshot": {"messages": 2, "bytes": 2 * snapshot_bytes}},
    }  # fmt: skip
