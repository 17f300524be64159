"""Hostile GGUF files, made by mutating a small valid one (a few KB, written with gguf's writer): every case is
refused in one line (ConfigError) or loads as a consistent model, with no other exception, no crash, no hang and no
allocation sized by a field the file cannot back.

The valid file is walked once here (independently of pjinfer's reader) to find each field's bytes: counts, string
and array lengths, value types, tensor dimensions, types and offsets, general.alignment. A case overwrites one of
them with a hostile value, cuts the file at a field boundary, or flips random bytes. `make test` runs
FUZZ_EXAMPLES cases derandomized (reproducible in CI, nothing written to a database); `make fuzz` raises the
count through PJINFER_FUZZ_EXAMPLES and draws fresh cases each run."""
from __future__ import annotations

import faulthandler
import os
import tracemalloc

import gguf
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pjinfer.config import ConfigError
from pjinfer.load import loader

FUZZ_EXAMPLES = int(os.environ.get("PJINFER_FUZZ_EXAMPLES", "2000"))
CASE_DEADLINE_MS = 5000          # one case loads a few KB; far above that is a hang in the making
HANG_SECONDS = 120               # one case past this is a hang: faulthandler ends the process, printing its stacks
PEAK_BYTES = 16 << 20            # the most a case may allocate: far above what a few-KB file needs
TRACE_EVERY = 8                  # one case in 8 runs under tracemalloc (6x slower) to check PEAK_BYTES

TOKENS = ["<|endoftext|>", "a", "b", "ab", "Ġ", "Ġa", "c", "Ġab"]
MERGES = ["a b", "Ġ a", "Ġa b"]
D, HEADS, KV_HEADS, HEAD_DIM, D_FF = 32, 2, 1, 16, 32
Q8_0, Q4_1 = gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.Q4_1


def small_metadata() -> dict:
    """{key: (value, GGUFValueType)} of the small model, general.architecture aside (the writer adds it)."""
    V = gguf.GGUFValueType
    return {
        "general.alignment": (32, V.UINT32), "llama.block_count": (1, V.UINT32),
        "llama.context_length": (64, V.UINT32), "llama.embedding_length": (D, V.UINT32),
        "llama.feed_forward_length": (D_FF, V.UINT32), "llama.attention.head_count": (HEADS, V.UINT32),
        "llama.attention.head_count_kv": (KV_HEADS, V.UINT32), "llama.rope.dimension_count": (HEAD_DIM, V.UINT32),
        "llama.attention.layer_norm_rms_epsilon": (1e-5, V.FLOAT32), "tokenizer.ggml.model": ("gpt2", V.STRING),
        "tokenizer.ggml.pre": ("smollm", V.STRING), "tokenizer.ggml.tokens": (TOKENS, V.ARRAY),
        "tokenizer.ggml.merges": (MERGES, V.ARRAY),
        "tokenizer.ggml.token_type": ([3] + [1] * (len(TOKENS) - 1), V.ARRAY),
        "tokenizer.ggml.eos_token_id": (0, V.UINT32), "tokenizer.ggml.bos_token_id": (0, V.UINT32),
        "tokenizer.ggml.add_bos_token": (False, V.BOOL),
        "tokenizer.chat_template": ("{% for m in messages %}{{ m['content'] }}{% endfor %}", V.STRING),
    }


def small_tensors() -> dict:
    """{name: (array, ggml block type or None for the array's own type)} of the small model."""
    rng = np.random.default_rng(0)
    mat = lambda rows, cols: (rng.standard_normal((rows, cols)) / np.sqrt(cols)).astype(np.float32)
    q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    out = {"token_embd.weight": (mat(len(TOKENS), D).astype(np.float16), None),
           "output_norm.weight": (np.ones(D, np.float32), None),
           "blk.0.attn_norm.weight": (np.ones(D, np.float32), None),
           "blk.0.ffn_norm.weight": (np.ones(D, np.float32), None)}
    for name, (rows, cols), kind in (("attn_q", (q, D), Q8_0), ("attn_k", (kv, D), Q4_1), ("attn_v", (kv, D), Q8_0),
                                     ("attn_output", (D, q), Q8_0), ("ffn_gate", (D_FF, D), Q8_0),
                                     ("ffn_up", (D_FF, D), Q4_1), ("ffn_down", (D, D_FF), Q8_0)):
        out[f"blk.0.{name}.weight"] = (mat(rows, cols), kind)
    return out


def write_small_gguf(path, fields: dict | None = None, tensors: dict | None = None) -> None:
    """A one-layer Llama with an 8-token BPE vocabulary: matrices in Q8_0 and Q4_1, the embedding F16, norms F32.
    fields and tensors change small_metadata() and small_tensors() (a None value drops the entry)."""
    metadata, arrays = small_metadata() | (fields or {}), small_tensors() | (tensors or {})
    w = gguf.GGUFWriter(str(path), "llama")
    for key, entry in metadata.items():
        if entry is not None:
            value, vtype = entry
            sub = {str: gguf.GGUFValueType.STRING, int: gguf.GGUFValueType.INT32}.get(type(value[0])) \
                if vtype == gguf.GGUFValueType.ARRAY else None
            w.add_key_value(key, value, vtype, sub)
    for name, entry in arrays.items():
        if entry is None:
            continue
        value, kind = entry
        if kind is None:
            w.add_tensor(name, value)
        else:
            blocks = gguf.quants.quantize(value, kind)
            w.add_tensor(name, blocks, raw_shape=blocks.shape, raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


# ------------------------------------------------------------------ where the fields are
_SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


def field_map(data: bytes) -> list[tuple[int, int, str]]:
    """(offset, size, kind) of every header field of a valid GGUF, in file order. kind: "u64" (a count, length,
    dimension or offset), "u32" (a version, type, dimension count), "align" (general.alignment's value),
    "value" (another scalar)."""
    fields, pos = [], 0

    def take(size, kind):
        nonlocal pos
        fields.append((pos, size, kind))
        pos += size
        return int.from_bytes(data[pos - size:pos], "little")

    def string():
        nonlocal pos
        n = take(8, "u64")
        pos += n
        return data[pos - n:pos].decode()

    pos = 4
    take(4, "u32")
    n_tensors, n_kv = take(8, "u64"), take(8, "u64")
    for _ in range(n_kv):
        key = string()
        kind = take(4, "u32")
        if kind == 8:
            string()
        elif kind == 9:
            sub, count = take(4, "u32"), take(8, "u64")
            for _ in range(count):
                if sub == 8:
                    string()
                else:
                    take(_SCALAR_SIZES[sub], "value")
        else:
            take(_SCALAR_SIZES[kind], "align" if key == "general.alignment" else "value")
    for _ in range(n_tensors):
        string()
        for _ in range(take(4, "u32")):
            take(8, "u64")
        take(4, "u32")
        take(8, "u64")
    return fields


# ------------------------------------------------------------------ mutations
def hostile_u64(original: int, size: int) -> st.SearchStrategy:
    return st.sampled_from([0, 1, 2, 3, 4, original - 1, original + 1, 2 * original, 31, 33, 64, 1 << 16,
                            size - 1, size, size + 1, 1 << 31, 1 << 32, (1 << 32) + original, 1 << 40, 1 << 62,
                            1 << 63, (1 << 64) - 1]) | st.integers(0, (1 << 64) - 1)


def hostile_u32() -> st.SearchStrategy:
    return st.integers(0, 40) | st.sampled_from([1 << 16, 1 << 31, (1 << 32) - 1]) | st.integers(0, (1 << 32) - 1)


@st.composite
def mutated(draw, data: bytes, fields: list) -> bytes:
    out = bytearray(data)
    how = draw(st.sampled_from(["field", "field", "field", "cut at a field", "cut anywhere", "flip bytes",
                                "field and flips"]))
    if how.startswith("field"):
        at, size, kind = draw(st.sampled_from(fields))
        original = int.from_bytes(data[at:at + size], "little")
        if kind == "u64":
            value = draw(hostile_u64(original, len(data)))
        elif kind == "align":
            value = draw(st.sampled_from([0, 1, 2, 3, 6, 16, 24, 64, 4096, 1 << 31, (1 << 32) - 1]))
        elif kind == "u32":
            value = draw(hostile_u32())
        else:
            value = draw(st.integers(0, (1 << (8 * size)) - 1))
        out[at:at + size] = (value % (1 << (8 * size))).to_bytes(size, "little")
    if how.startswith("cut"):
        if how == "cut at a field":
            at, size, _ = draw(st.sampled_from(fields))
            end = at + draw(st.sampled_from([0, size // 2, size]))
        else:
            end = draw(st.integers(0, len(data) - 1))
        del out[end:]
    if how in ("flip bytes", "field and flips"):
        for _ in range(draw(st.integers(1, 4))):
            i = draw(st.integers(0, len(out) - 1))
            out[i] ^= draw(st.integers(1, 255))
    return bytes(out)


# ------------------------------------------------------------------ what every case must end in
def load_or_refuse(path) -> str:
    """Refused in one line, or loaded as a consistent model (float32 and in its own blocks)."""
    try:
        loader.stored_format(path)       # what --weights auto reads first: None for a file the loader refuses
        loader.open_gguf(path)           # the reader
        for blocks in (False, True):
            config, weights, tokenizer = loader.load(path, keep="gguf" if blocks else None)
            check_consistent(config, weights, tokenizer)
    except ConfigError as e:
        message = str(e)
        assert message and "\n" not in message, repr(message)
        return "refused"
    return "loaded"


def check_consistent(config, weights, tokenizer) -> None:
    """A loaded model the engine can run: every weight present with its shape, token ids inside the vocabulary."""
    d, q, kv = config.d_model, config.n_heads * config.head_dim, config.n_kv_heads * config.head_dim
    need = {"embed": (config.vocab_size, d), "final_norm.scale": (d,), "layers.0.wq": (q, d),
            "layers.0.wk": (kv, d), "layers.0.wv": (kv, d), "layers.0.wo": (d, q),
            "layers.0.w_gate": (config.d_ff, d), "layers.0.w_up": (config.d_ff, d)}
    assert config.n_layers == 1
    for name, shape in need.items():
        assert tuple(weights[name].shape) == shape, (name, weights[name].shape, shape)
    ids = tokenizer.encode("ab a b", add_special=False)
    assert ids and all(0 <= i < config.vocab_size for i in ids), ids


def traced(path) -> tuple[str, int]:
    """load_or_refuse(path) and the peak of the memory it allocated (tracemalloc on)."""
    tracemalloc.reset_peak()
    before = tracemalloc.get_traced_memory()[0]
    outcome = load_or_refuse(path)
    return outcome, tracemalloc.get_traced_memory()[1] - before


@pytest.fixture(scope="module")
def valid(tmp_path_factory):
    from hypothesis.configuration import set_hypothesis_home_dir

    set_hypothesis_home_dir(tmp_path_factory.mktemp("hypothesis"))   # its caches, out of the source tree
    path = tmp_path_factory.mktemp("fuzz") / "small.gguf"
    write_small_gguf(path)
    assert load_or_refuse(path) == "loaded"
    data = path.read_bytes()
    return data, field_map(data), path.with_name("case.gguf")


def test_valid_file_is_small_and_every_field_is_mapped(valid):
    data, fields, _ = valid
    assert len(data) < 16 << 10
    assert sum(1 for *_, kind in fields if kind == "align") == 1
    # each of the 11 tensors has a u64 name length, dimensions and offset
    assert sum(1 for *_, kind in fields if kind == "u64") > 3 * 11


def test_hostile_mutations_are_refused_in_one_line_or_load_consistently(valid):
    data, fields, case = valid
    outcomes = {"refused": 0, "loaded": 0}

    @settings(max_examples=FUZZ_EXAMPLES, deadline=CASE_DEADLINE_MS, database=None,
              derandomize="PJINFER_FUZZ_EXAMPLES" not in os.environ,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(mutated(data, fields))
    def case_ends_in_one_line_or_a_model(raw):
        faulthandler.dump_traceback_later(HANG_SECONDS, exit=True)   # re-armed for each case
        case.write_bytes(raw)
        if sum(outcomes.values()) % TRACE_EVERY:
            outcomes[load_or_refuse(case)] += 1
            return
        tracemalloc.start()
        try:
            outcome, peak = traced(case)
            if peak >= PEAK_BYTES:   # again: a path's first imports and compilations are not the file's doing
                outcome, peak = traced(case)
        finally:
            tracemalloc.stop()
        assert peak < PEAK_BYTES, f"a {len(raw)}-byte file made {peak} bytes of allocations"
        outcomes[outcome] += 1

    try:
        case_ends_in_one_line_or_a_model()
    finally:
        faulthandler.cancel_dump_traceback_later()
    print(f"{sum(outcomes.values())} cases: {outcomes}")
    assert outcomes["refused"] > FUZZ_EXAMPLES // 4 and outcomes["loaded"] > 0, outcomes
