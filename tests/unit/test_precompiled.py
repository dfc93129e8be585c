"""The saved decode step's manifest (precompiled.py): what it stores round-trips exactly."""

import pytest
import torch

from dpserve_engine import precompiled


def test_saved_step_constants_round_trip_exactly():
    """The output code's own constants (precompiled.py) survive the manifest's JSON bit for bit; big or odd ones
    make the step unsaveable instead of bloating the manifest."""
    constants = {"c0": torch.tensor(7, dtype=torch.int64), "c1": torch.tensor([0.1, -3.5], dtype=torch.bfloat16),
                 "c2": torch.arange(6, dtype=torch.float32).reshape(2, 3) / 7}  # fmt: skip
    back = precompiled.constants_from_json(precompiled.constants_to_json(constants))
    assert back.keys() == constants.keys()
    for name, t in constants.items():
        assert back[name].dtype == t.dtype and back[name].shape == t.shape and torch.equal(back[name], t)
    with pytest.raises(precompiled.Unusable, match="elements"):
        precompiled.constants_to_json({"big": torch.zeros(1 << 17)})
    with pytest.raises(precompiled.Unusable, match="dtype"):
        precompiled.constants_from_json({"x": {"dtype": "no_such_type", "shape": [], "values": 1}})
