"""The fast GGUF metadata reader (dpserve_engine.gguf_metadata) gives what gguf-py's GGUFReader gives."""

import gguf
import numpy as np
import pytest

from dpserve_engine.gguf_metadata import read_gguf, read_gguf_metadata
from dpserve_engine.model_files import bundled_gguf_path

pytestmark = pytest.mark.timeout(120)


def test_the_bundled_files_metadata_equals_gguf_pys():
    path = bundled_gguf_path()
    want = {key: field.contents() for key, field in gguf.GGUFReader(path).fields.items() if not key.startswith("GGUF.")}
    got = read_gguf_metadata(path)
    assert got == want and got.tensor_count == 272


def test_the_bundled_files_tensors_equal_gguf_pys():
    path = bundled_gguf_path()
    theirs = gguf.GGUFReader(path).tensors
    _, ours = read_gguf(path)
    assert [t.name for t in ours] == [t.name for t in theirs]
    for mine, want in zip(ours, theirs):
        assert (mine.tensor_type, mine.shape) == (want.tensor_type, tuple(want.shape.tolist())), mine.name
        assert (mine.data.dtype, mine.data.shape) == (want.data.dtype, want.data.shape), mine.name
    for i in (0, 1, len(ours) // 2, len(ours) - 1):  # the bytes of a few, first and last included
        assert np.array_equal(ours[i].data, theirs[i].data), ours[i].name


def test_every_value_type_reads_back(tmp_path):
    path = str(tmp_path / "types.gguf")
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_uint8("t.u8", 200)
    writer.add_int16("t.i16", -3)
    writer.add_uint64("t.u64", 2**40)
    writer.add_float64("t.f64", 0.25)
    writer.add_bool("t.bool", True)
    writer.add_string("t.str", "héllo ▁world")
    writer.add_array("t.ints", [1, -2, 3])
    writer.add_array("t.floats", [0.5, 1.5])
    writer.add_array("t.strs", ["a", "", "日本"])
    writer.add_tensor("x", np.zeros(4, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    got = read_gguf_metadata(path)
    assert {k: v for k, v in got.items() if k.startswith("t.")} == {
        "t.u8": 200, "t.i16": -3, "t.u64": 2**40, "t.f64": 0.25, "t.bool": True, "t.str": "héllo ▁world",
        "t.ints": [1, -2, 3], "t.floats": [0.5, 1.5], "t.strs": ["a", "", "日本"],
    }  # fmt: skip
    assert got["general.architecture"] == "llama" and got.tensor_count == 1


def test_a_file_that_is_not_gguf_is_an_error_naming_it(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"PK\x03\x04 not a gguf")
    with pytest.raises(ValueError, match=r"model\.gguf is not a GGUF file"):
        read_gguf_metadata(str(path))
