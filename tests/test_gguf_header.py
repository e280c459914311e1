"""engine/gguf_header.read_gguf against the gguf package's GGUFReader on the same files."""
import numpy as np
import pytest
from gguf import GGUFReader

from engine.gguf_file import GGUFFile
from engine.gguf_header import read_gguf
from tests.support.tiny_gguf import write_tiny_gguf


def _reader_fields(path):
    values = {}
    for key, field in GGUFReader(path, "r").fields.items():
        if not key.startswith("GGUF."):
            value = field.contents()
            values[key] = value.item() if isinstance(value, np.generic) else value
    return values


@pytest.mark.parametrize("arch,quant", [("llama", "Q4_1"), ("gemma3", "Q8_0"), ("qwen2", "F16")])
def test_read_gguf_gives_the_readers_fields_and_tensors(tmp_path, arch, quant):
    path = tmp_path / "m.gguf"
    write_tiny_gguf(path, arch, quant=quant, extra_metadata={"test.flag": True, "test.ratio": 0.5})
    fields, tensors = read_gguf(path)
    expected = _reader_fields(path)
    assert fields == expected
    assert all(type(fields[k]) is type(expected[k]) for k in expected)
    reader_tensors = GGUFReader(path, "r").tensors
    assert list(tensors) == [t.name for t in reader_tensors]
    for t in reader_tensors:
        mine = tensors[t.name]
        assert (mine.tensor_type, mine.n_bytes, mine.data.shape, mine.data.dtype) == (
            t.tensor_type, t.n_bytes, t.data.shape, t.data.dtype)
        np.testing.assert_array_equal(mine.shape, t.shape)
        np.testing.assert_array_equal(mine.data.view(np.uint8), t.data.view(np.uint8))


def test_a_file_that_is_not_gguf_is_a_value_error(tmp_path):
    path = tmp_path / "bad.gguf"
    path.write_bytes(b"not a gguf file at all, just some bytes")
    with pytest.raises(ValueError, match="not a readable GGUF file"):
        GGUFFile(path)


def test_a_truncated_gguf_is_a_value_error(tmp_path):
    path = tmp_path / "m.gguf"
    write_tiny_gguf(path, "llama")
    (tmp_path / "cut.gguf").write_bytes(path.read_bytes()[:2000])
    with pytest.raises(ValueError, match="not a readable GGUF file"):
        GGUFFile(tmp_path / "cut.gguf")
