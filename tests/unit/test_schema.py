"""The wire schema's unions: each socket accepts only the messages of its own direction."""

import pytest


def test_each_socket_decodes_only_its_own_direction():
    """The engine's frontend socket takes requests and aborts only: a coordinator message sent there (or a
    frontend's message sent to the coordinator's broadcast followers) fails validation instead of being acted on."""
    import msgspec
    from dpserve_shared.codec import encode, engine_decoder, from_coordinator_decoder
    from dpserve_shared.schema import AbortRequests, FrontendGone, Shutdown, StartWave

    engine = engine_decoder()
    assert engine.decode(encode(AbortRequests(["r1"]))) == AbortRequests(["r1"])
    for stray in (StartWave(3, exclude_rank=None), Shutdown(), FrontendGone("fe-1")):
        with pytest.raises(msgspec.ValidationError):
            engine.decode(encode(stray))
    with pytest.raises(msgspec.ValidationError):
        from_coordinator_decoder().decode(encode(AbortRequests(["r1"])))
