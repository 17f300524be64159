"""Hand-made hostile GGUF files, one per check the reader and the loader make before trusting a field: each is
refused in one line naming what is wrong, before anything sized by the bad field is allocated."""
import struct
import subprocess
import sys
import tracemalloc

import numpy as np
import pytest

from pjinfer.config import ConfigError
from pjinfer.load import loader
from tests.test_fuzz_gguf import small_metadata, write_small_gguf

U32, U64, STRING, ARRAY = 4, 10, 8, 9
F32_TYPE, Q8_0_TYPE = 0, 8


def s(text: str) -> bytes:
    raw = text.encode()
    return struct.pack("<Q", len(raw)) + raw


def gguf_bytes(fields=(), tensors=(), data=b"", *, n_fields=None, n_tensors=None, align=32) -> bytes:
    """A GGUF v3 file from parts: fields [(key, type, value bytes)], tensors [(name, ne, type, offset)]; the
    counts default to the parts' and can claim anything."""
    out = b"GGUF" + struct.pack("<I", 3)
    out += struct.pack("<QQ", len(tensors) if n_tensors is None else n_tensors,
                       len(fields) if n_fields is None else n_fields)
    for key, kind, value in fields:
        out += s(key) + struct.pack("<I", kind) + value
    for name, ne, kind, offset in tensors:
        out += s(name) + struct.pack("<I", len(ne)) + b"".join(struct.pack("<Q", n) for n in ne)
        out += struct.pack("<IQ", kind, offset)
    out += b"\0" * (-len(out) % align)
    return out + data


def refused(tmp_path, raw: bytes, name="bad.gguf") -> str:
    """The one-line message the reader refuses `raw` with; no more than 1 MiB allocated on the way."""
    path = tmp_path / name
    path.write_bytes(raw)
    tracemalloc.start()
    try:
        with pytest.raises(ConfigError) as e:
            loader.open_gguf(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, peak
    message = str(e.value)
    assert "\n" not in message
    return message


ONE_F32 = [("w", [4], F32_TYPE, 0)]


@pytest.mark.parametrize("raw, message", [
    (b"", "the file is empty"),
    (b"GGUF", "the file ends inside its header (at byte 4)"),
    (gguf_bytes(n_fields=1 << 60), "the metadata count at byte 16 claims 1152921504606846976 items"),
    (gguf_bytes(n_tensors=(1 << 64) - 1), "the tensor count at byte 8 claims 18446744073709551615 items"),
    (gguf_bytes([("k", STRING, struct.pack("<Q", 1 << 40))]), "a string at byte 37 claims 1099511627776 bytes"),
    (gguf_bytes([("k", ARRAY, struct.pack("<IQ", STRING, 1 << 60))]),
     "a string array at byte 41 claims 1152921504606846976 items"),
    (gguf_bytes([("k", ARRAY, struct.pack("<IQ", U32, 1 << 60))]),
     "an array at byte 41 claims 1152921504606846976 items"),
    (gguf_bytes([("k", ARRAY, struct.pack("<IQ", STRING, 2) + s("a") + struct.pack("<Q", 1 << 62))]),
     "a string at byte 58 claims 4611686018427387904 bytes"),
    (gguf_bytes([("k", 13, b"")]), "unsupported metadata type 13"),
    (gguf_bytes([("k", ARRAY, struct.pack("<IQ", ARRAY, 1))]), "unsupported metadata array type 9"),
    (gguf_bytes([("k", U32, b"\1\0\0\0")] * 2), "metadata key 'k' appears twice"),
    (gguf_bytes([("a\nb", U32, b"\1\0\0\0")]), "metadata key of 3 characters is not 65535 printable ones"),
], ids=lambda x: x if isinstance(x, str) else "")
def test_counts_and_lengths_past_the_file_are_refused_before_allocating(tmp_path, raw, message):
    assert message in refused(tmp_path, raw)


def align_field(value: int, kind=U32) -> tuple:
    return ("general.alignment", kind, struct.pack("<I" if kind == U32 else "<f", value))


@pytest.mark.parametrize("tensors, fields, data, message", [
    # dims whose product overflows int64 (2**96 elements), an offset past the end
    ([("w", [1 << 32] * 3, F32_TYPE, 0)], [], b"\0" * 16, "tensor w [4294967296, 4294967296, 4294967296] needs bytes"),
    ([("w", [4], F32_TYPE, 1 << 40)], [], b"\0" * 16, "tensor w [4] needs bytes 1099511627840 to"),
    ([("w", [4], F32_TYPE, 0), ("v", [4], F32_TYPE, 0)], [], b"\0" * 16, "tensors v and w overlap in the file"),
    ([("w", [16], F32_TYPE, 0), ("v", [4], F32_TYPE, 32)], [], b"\0" * 64, "tensors w and v overlap in the file"),
    ([("w", [4], F32_TYPE, 4)], [], b"\0" * 64, "tensor w starts at offset 4, not a multiple of the alignment 32"),
    ([("w", [], F32_TYPE, 0)], [], b"\0" * 16, "tensor w has 0 dimensions (1 to 4)"),
    ([("w", [1] * 5, F32_TYPE, 0)], [], b"\0" * 16, "tensor w has 5 dimensions (1 to 4)"),
    ([("w", [4], 99, 0)], [], b"\0" * 16, "tensor w has unknown type 99"),
    ([("w", [33], Q8_0_TYPE, 0)], [], b"\0" * 64, "tensor w: 33 columns are not whole blocks of 32"),
    (ONE_F32 * 2, [], b"\0" * 32, "tensor w appears twice"),
    ([("x" * 64, [4], F32_TYPE, 0)], [], b"\0" * 16, "a tensor name is not 63 bytes of printable text"),
    (ONE_F32, [align_field(0)], b"\0" * 16, "general.alignment is 0: it must be a power of two"),
    (ONE_F32, [align_field(24)], b"\0" * 16, "general.alignment is 24: it must be a power of two"),
    (ONE_F32, [align_field(32, kind=6)], b"\0" * 16, "general.alignment is 32.0: it must be a power of two"),
], ids=lambda x: x if isinstance(x, str) else "")
def test_tensor_dims_offsets_and_alignment_are_checked_against_the_file(tmp_path, tensors, fields, data, message):
    assert message in refused(tmp_path, gguf_bytes(fields, tensors, data))


def test_a_tensor_starts_after_the_header_it_is_described_in(tmp_path):
    """Offsets count from the aligned end of the header, so offset 0 is the first byte after it: a tensor cannot
    overlap the header. The reader's view of such a tensor is the data section's first bytes."""
    from pjinfer.load.gguf_file import GGUFFile

    data = np.arange(4, dtype=np.float32).tobytes()
    path = tmp_path / "ok.gguf"
    path.write_bytes(gguf_bytes([], ONE_F32, data))
    np.testing.assert_array_equal(GGUFFile(path).tensors[0].data, np.arange(4, dtype=np.float32))


def test_a_file_cut_anywhere_is_refused_in_one_line(tmp_path):
    path = tmp_path / "small.gguf"
    write_small_gguf(path)
    raw = path.read_bytes()
    header_end = raw.index(b"blk.0.ffn_down.weight") + 60
    for cut in (3, 4, 8, 23, 24, 40, 100, 1000, header_end - 30, header_end, len(raw) - 600, len(raw) - 1):
        message = refused(tmp_path, raw[:cut], name=f"cut{cut}.gguf") if cut < header_end else None
        if message is None:   # a cut in the tensor data: the reader names the tensor that does not fit
            (tmp_path / "cut.gguf").write_bytes(raw[:cut])
            with pytest.raises(ConfigError, match=r"tensor \S+ \[.*\] needs bytes .* the file ends"):
                loader.load(tmp_path / "cut.gguf")
        else:
            assert "truncated or not a GGUF file" in message, (cut, message)
            assert any(m in message for m in ("ends inside its header", "no GGUF magic", "bytes left")), (cut, message)


V = __import__("gguf").GGUFValueType


@pytest.mark.parametrize("fields, tensors, message", [
    ({"llama.attention.head_count": None}, {}, "lacks the metadata llama.attention.head_count"),
    ({"llama.attention.head_count": (0, V.UINT32)}, {}, "llama.attention.head_count must be positive, got 0"),
    ({"llama.embedding_length": ("32", V.STRING)}, {}, "llama.embedding_length must be an integer, got '32'"),
    ({"llama.attention.layer_norm_rms_epsilon": (float("nan"), V.FLOAT32)}, {},
     "layer_norm_rms_epsilon must be a finite number, got nan"),
    ({"llama.block_count": ((1 << 40), V.UINT64)}, {}, "block_count is 1099511627776, but the file holds only 11"),
    ({"llama.vocab_size": (4, V.UINT32)}, {}, "8 tokens, more than llama.vocab_size 4"),
    ({"llama.rope.dimension_count": (15, V.UINT32)}, {}, "rope.dimension_count is 15; rotary pairs need an even"),
    ({"tokenizer.ggml.tokens": ([1, 2], V.ARRAY)}, {}, "tokenizer.ggml.tokens must be an array of strings"),
    ({"tokenizer.ggml.eos_token_id": (8, V.UINT32)}, {}, "eos_token_id is 8; the vocabulary has 8 tokens"),
    ({"tokenizer.ggml.merges": (["a c"], V.ARRAY)}, {}, "merge 0 ('a c') is not two tokens whose concatenation"),
    ({"tokenizer.ggml.merges": None}, {}, "lacks the metadata tokenizer.ggml.merges"),
    ({"tokenizer.ggml.token_type": ([1, 1], V.ARRAY)}, {}, "token_type must be 8 integers, one per token"),
    ({"tokenizer.ggml.pre": (7, V.UINT32)}, {}, "tokenizer.ggml.pre must be a string, got 7"),
    ({"tokenizer.ggml.scores": ([0.5, 1.0], V.ARRAY)}, {}, "scores must be 8 finite numbers, one per token"),
    ({"tokenizer.ggml.add_space_prefix": (1, V.UINT32)}, {}, "add_space_prefix must be a bool, got 1"),
    ({}, {"blk.0.attn_q.weight": None}, "lacks tensor blk.0.attn_q.weight"),
    ({}, {"blk.0.ffn_up.weight": (np.zeros((16, 32), np.float32), None)},
     "tensor blk.0.ffn_up.weight is [16, 32]; the metadata implies [32, 32]"),
    ({}, {"blk.1.attn_q.weight": (np.zeros((32, 32), np.float32), None)},
     "unexpected tensor blk.1.attn_q.weight in bad.gguf (the model has 1 layers)"),
    ({}, {"blk.0.ffn_down_t.weight": (np.zeros((32, 32), np.float32), None)},
     "layer 0 needs one of ffn_down.weight and ffn_down_t.weight, has 2"),
], ids=lambda x: x if isinstance(x, str) else "")
def test_metadata_and_tensors_the_model_reads_are_checked_before_loading(tmp_path, fields, tensors, message):
    path = tmp_path / "bad.gguf"
    write_small_gguf(path, fields, tensors)
    with pytest.raises(ConfigError) as e:
        loader.load(path)
    assert message in str(e.value) and "\n" not in str(e.value)
    assert loader.stored_format(path) in (None, "gguf")   # --weights auto reads the header without failing


def test_the_small_file_loads(tmp_path):
    path = tmp_path / "ok.gguf"
    write_small_gguf(path)
    config, weights, tokenizer = loader.load(path)
    assert (config.n_layers, config.d_model, config.vocab_size) == (1, 32, 8) and len(small_metadata()) == 18
    assert tokenizer.decode(tokenizer.encode("ab a", add_special=False)) == "ab a"


def test_cli_refuses_a_hostile_gguf_in_one_line(tmp_path):
    bad = tmp_path / "BAD.gguf"
    bad.write_bytes(gguf_bytes([align_field(0)], ONE_F32, b"\0" * 16))
    run = subprocess.run([sys.executable, "-m", "pjinfer.cli.main", "generate", "--model", str(bad), "--prompt", "hi"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 2, run.stderr
    assert run.stderr.count("\n") == 1 and "Traceback" not in run.stderr
    assert run.stderr.startswith("pjinfer: error: ") and "general.alignment is 0" in run.stderr, run.stderr
