"""Loom's fast GGUF reader against the `gguf` package's GGUFReader (the reference): same
metadata, same tensors byte for byte, on the packaged SmolLM2 file and on files with every
metadata and several tensor types; byte-swapped and nested-array files fall back to GGUFReader."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFEndian, GGUFReader, GGUFValueType, GGUFWriter
from gguf.quants import quantize

from loom.loader.gguf_file import GGUFFile, GGUFFormatError, read_gguf
from loom.loader.resolve import default_gguf_path

T = GGMLQuantizationType


def assert_same_as_reference(ours: GGUFFile, path: Path) -> None:
    ref = GGUFReader(str(path))
    expected = {key: f.contents() for key, f in ref.fields.items()}
    assert list(ours.fields) == list(expected)
    assert ours.fields == expected
    assert [t.name for t in ours.tensors] == [t.name for t in ref.tensors]
    for mine, theirs in zip(ours.tensors, ref.tensors):
        assert mine.tensor_type == theirs.tensor_type, mine.name
        assert mine.shape == tuple(int(d) for d in reversed(theirs.shape.tolist())), mine.name
        assert mine.data.dtype == theirs.data.dtype, mine.name
        assert mine.data.shape == theirs.data.shape, mine.name
        assert mine.data.tobytes() == theirs.data.tobytes(), mine.name


@pytest.mark.slow
def test_smollm2_file_equals_gguf_reader() -> None:
    path = default_gguf_path()
    ours = read_gguf(path)
    assert_same_as_reference(ours, path)
    assert len(ours.get("tokenizer.ggml.tokens")) == 49152
    assert all(t.data.flags.writeable for t in ours.tensors)  # torch wraps them without a copy


def _write_all_types(path: Path, endianess: GGUFEndian = GGUFEndian.LITTLE,
                     nested: bool = False) -> Path:
    w = GGUFWriter(str(path), "llama", endianess=endianess)
    w.add_custom_alignment(64)
    for i, (kind, value) in enumerate([
        ("uint8", 250), ("int8", -5), ("uint16", 65000), ("int16", -300), ("uint32", 4_000_000_000),
        ("int32", -70000), ("float32", 0.1), ("uint64", 2**63 + 5), ("int64", -(2**40)),
        ("float64", 1 / 3), ("bool", True), ("string", "héllo ✓"),
    ]):
        getattr(w, f"add_{kind}")(f"test.{kind}.{i}", value)
    w.add_array("test.int_array", [1, -2, 3])
    w.add_array("test.float_array", [0.5, 1.25])
    w.add_array("test.bool_array", [True, False, True])
    w.add_array("test.string_array", ["a", "", "ünï", "<|im_end|>"])
    w.add_key_value("test.u8_array", [1, 2, 255], GGUFValueType.ARRAY, GGUFValueType.UINT8)
    w.add_array("test.empty_array", [])
    if nested:
        w.add_array("test.nested", [[1, 2], [3]])
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 256)).astype(np.float32)
    w.add_tensor("f32", x[:, :7].copy())
    w.add_tensor("f16", x.astype(np.float16))
    w.add_tensor("i32", np.arange(12, dtype=np.int32).reshape(3, 4))
    if endianess == GGUFEndian.LITTLE:  # the writer cannot byte-swap quantized blocks
        for qtype in (T.BF16, T.Q8_0, T.Q4_1):
            w.add_tensor(qtype.name, quantize(x, qtype), raw_dtype=qtype)
        k_blocks = rng.integers(0, 256, (4, 144), dtype=np.uint8)  # one Q4_K block per row
        w.add_tensor("Q4_K", k_blocks, raw_dtype=T.Q4_K)
    w.add_tensor("scalar_row", x[0, :3].copy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_every_metadata_type_and_tensor_type_equals_gguf_reader(tmp_path) -> None:
    path = _write_all_types(tmp_path / "all.gguf")
    ours = read_gguf(path)
    assert_same_as_reference(ours, path)
    assert ours.get("test.string_array") == ["a", "", "ünï", "<|im_end|>"]
    assert ours.get("general.alignment") == 64
    assert ours.get("missing", 7) == 7
    assert {t.tensor_type for t in ours.tensors} >= {T.F32, T.F16, T.I32, T.BF16, T.Q8_0, T.Q4_1, T.Q4_K}


@pytest.mark.parametrize("kind", ["big-endian", "nested-arrays"])
def test_files_the_fast_path_leaves_to_gguf_reader(tmp_path, kind) -> None:
    if kind == "big-endian":
        path = _write_all_types(tmp_path / "be.gguf", endianess=GGUFEndian.BIG)
    else:
        path = _write_all_types(tmp_path / "nested.gguf", nested=True)
    ours = read_gguf(path)
    expected = {key: f.contents() for key, f in GGUFReader(str(path)).fields.items()}
    assert ours.fields == expected
    assert [t.name for t in ours.tensors][:3] == ["f32", "f16", "i32"]


def test_bad_files_are_format_errors(tmp_path) -> None:
    src = _write_all_types(tmp_path / "all.gguf")
    data = src.read_bytes()
    cases = {
        "empty": b"",
        "magic": b"GGML" + data[4:],
        "version": data[:4] + (9).to_bytes(4, "little") + data[8:],
        "header": data[:200],  # cut inside the metadata
        "tensor data": data[:-100],  # cut inside the last tensor
    }
    for name, content in cases.items():
        bad = tmp_path / f"{name}.gguf"
        bad.write_bytes(content)
        with pytest.raises(GGUFFormatError):
            read_gguf(bad)
