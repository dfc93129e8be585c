"""The engine's expert-parallel group membership across re-formations (group_membership.py), every transition:
agreeing at the sync, a broken group, leave_now, a removed rank, stale and early messages."""

from __future__ import annotations

import pytest

from dpserve_engine.group_membership import GroupMembership, Phase
from dpserve_shared.schema import ExpertGroup

pytestmark = pytest.mark.timeout(10)


def group(generation: int, rank: int = 1, leave_now: bool = False) -> ExpertGroup:
    return ExpertGroup("10.0.0.1", 4000 + generation, 3, rank, generation=generation, leave_now=leave_now)


def joined(generation: int = 1) -> GroupMembership:
    m = GroupMembership(rank=1)
    m.on_joined(group(generation))
    return m


def test_a_healthy_group_is_left_at_the_sync_that_sees_the_newer_generation():
    m = joined(1)
    assert m.sync_generation == 1 and m.can_step
    assert m.on_group(group(2)) is True  # step to the sync
    assert m.sync_generation == 2 and m.to_join() is None and m.can_step  # not before the agreed step
    assert m.on_sync(2) is True
    assert m.phase is Phase.STOPPED and not m.can_step
    assert m.to_join() == group(2)
    m.on_joined(group(2))
    assert (m.phase, m.generation, m.pending, m.sync_generation) == (Phase.MEMBER, 2, None, 2)


def test_a_rank_told_by_the_sync_before_its_own_message_arrives_waits_for_it():
    m = joined(1)
    assert m.on_sync(2) is True  # a peer had generation 2
    assert m.to_join() is None and not m.can_step
    assert m.on_group(group(2)) is False  # nothing to step for: it stopped already
    assert m.to_join() == group(2)


def test_a_broken_group_rejoins_as_soon_as_a_newer_group_comes():
    m = joined(1)
    m.on_failure()
    assert m.phase is Phase.BROKEN and not m.can_step and m.to_join() is None
    assert m.on_sync(5) is False  # a broken rank takes part in no sync
    assert m.on_group(group(2)) is False
    assert m.to_join() == group(2)


def test_leave_now_rejoins_at_once_from_a_working_group():
    m = joined(1)
    assert m.on_group(group(2, leave_now=True)) is False
    assert m.to_join() == group(2, leave_now=True)


def test_stale_and_repeated_groups_are_ignored():
    m = joined(3)
    assert m.on_group(group(3)) is False and m.on_group(group(2)) is False and m.pending is None
    assert m.on_group(group(5)) is True
    assert m.on_group(group(4)) is False and m.pending == group(5)  # an older one after a newer one


def test_a_removed_rank_joins_no_group_and_steps_no_more():
    m = joined(1)
    m.on_group(group(2, rank=-1))
    m.on_sync(2)
    m.on_joined(m.to_join())
    assert m.phase is Phase.OUTSIDE and not m.can_step and m.to_join() is None
    m.on_failure()
    assert m.phase is Phase.OUTSIDE
