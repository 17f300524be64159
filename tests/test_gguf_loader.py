"""The GGUF loader on tiny files written here with gguf's own writer (the real file is in test_real_model)."""
import gguf
import numpy as np
import pytest

from pjinfer.config import ConfigError
from pjinfer.load import loader
from tests.conftest import random_weights, tiny_config


def byte_level_vocab():
    # GPT-2's byte-to-unicode table: every byte is a printable character, so every text encodes.
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    chars, n = list(keep), 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + n)
            n += 1
    return [chr(c) for c in chars]


def permute_like_llama_cpp(w, n_heads):
    # What llama.cpp's converter does to HF's q/k rows (interleaved rotary pairs); the loader undoes it.
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, w.shape[1]).swapaxes(1, 2).reshape(w.shape)


def write_bpe_vocab(w, *, model="gpt2", pre="smollm"):
    """The tiny byte-level BPE vocabulary (SmolLM's tokenizer kind) with a ChatML template; returns its size."""
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tokens = specials + byte_level_vocab() + ["Ġt", "he", "Ġthe"]
    merges = ["Ġ t", "h e", "Ġt he"]
    types = [3] * len(specials) + [1] * (len(tokens) - len(specials))
    w.add_tokenizer_model(model)
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_merges(merges)
    w.add_token_types(types)
    w.add_eos_token_id(2)
    w.add_bos_token_id(1)
    w.add_add_bos_token(False)
    w.add_chat_template("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    return len(tokens)


def write_tiny_gguf(path, config, weights, *, arch="llama", quantize=False, layer_type=None, down_t=False,
                    extra=None, fields=None, magic=None, vocab=write_bpe_vocab, embed_rows=None):
    """quantize: every matrix Q8_0; layer_type (a gguf.GGMLQuantizationType): the layers' matrices in it instead,
    or a function of the canonical name giving each matrix's type (None: float32). K types are written by
    tests/kquants.py (gguf has no quantizer for them). PowerInfer's layout: down_t writes blk.N.ffn_down_t
    [d_ff, d] instead of ffn_down, extra {GGUF name: array} adds tensors as they are, fields {key: float} adds
    float32 metadata, and magic (b"PWRI") overwrites the file's first four bytes, as PowerInfer's converters do.
    vocab(writer) writes the tokenizer's metadata and returns its size (write_bpe_vocab: a tiny byte-level BPE);
    the embedding gets that many rows, or embed_rows."""
    w = gguf.GGUFWriter(str(path), arch)
    n_tokens = vocab(w)
    config = config.replace(vocab_size=embed_rows or n_tokens)
    w.add_block_count(config.n_layers)
    w.add_context_length(config.max_seq_len)
    w.add_embedding_length(config.d_model)
    w.add_feed_forward_length(config.d_ff)
    w.add_head_count(config.n_heads)
    w.add_head_count_kv(config.n_kv_heads)
    w.add_rope_dimension_count(config.head_dim)
    w.add_rope_freq_base(config.rope_theta)
    w.add_layer_norm_rms_eps(config.norm_eps)
    w.add_vocab_size(config.vocab_size)
    rng = np.random.default_rng(5)
    if weights["embed"].shape[0] != config.vocab_size:  # an embedding (and an untied head) for this vocabulary
        weights = dict(weights, embed=(rng.standard_normal((config.vocab_size, config.d_model)) * 0.1).astype(np.float32))
        if "lm_head" in weights:
            weights["lm_head"] = (rng.standard_normal((config.vocab_size, config.d_model)) * 0.1).astype(np.float32)
    names = {"embed": "token_embd.weight", "final_norm.scale": "output_norm.weight", "lm_head": "output.weight"}
    per_layer = {"attn_norm.scale": "attn_norm", "ffn_norm.scale": "ffn_norm", "wq": "attn_q", "wk": "attn_k",
                 "wv": "attn_v", "wo": "attn_output", "w_gate": "ffn_gate", "w_up": "ffn_up", "w_down_t": "ffn_down"}
    biases = {"bq": "attn_q", "bk": "attn_k", "bv": "attn_v"}  # Qwen2's
    for key, number in (fields or {}).items():
        w.add_float32(key, number)
    permuted = arch in ("llama", "bamboo")             # llama.cpp permutes Llama's q/k rows, not Qwen2's
    for name, value in weights.items():
        if name.startswith("layers."):
            _, i, rest = name.split(".", 2)
            gname = f"blk.{i}.{biases[rest]}.bias" if rest in biases else f"blk.{i}.{per_layer[rest]}.weight"
        else:
            gname = names[name]
        if rest_is(name, "wq") and permuted:
            value = permute_like_llama_cpp(value, config.n_heads)
        elif rest_is(name, "wk") and permuted:
            value = permute_like_llama_cpp(value, config.n_kv_heads)
        elif rest_is(name, "w_down_t") and down_t:
            gname = gname.replace("ffn_down", "ffn_down_t")
        elif rest_is(name, "w_down_t"):
            value = np.ascontiguousarray(value.T)
        kind = None
        if callable(layer_type):
            kind = layer_type(name) if value.ndim == 2 else None
        elif (quantize or layer_type) and value.ndim == 2:
            kind = layer_type if layer_type and name.startswith("layers.") else gguf.GGMLQuantizationType.Q8_0
        if kind is not None:
            q = quantize_blocks(value, kind)
            w.add_tensor(gname, q, raw_shape=q.shape, raw_dtype=kind)
        else:
            w.add_tensor(gname, value)
    for gname, value in (extra or {}).items():
        w.add_tensor(gname, value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    if magic:
        with open(path, "r+b") as f:
            f.write(magic)
    return config, weights


def quantize_blocks(value, kind):
    """float32 [rows, cols] -> uint8 blocks of kind: gguf's quantizer, or tests/kquants.py for the K types."""
    if kind.name in ("Q4_K", "Q5_K", "Q6_K"):
        from tests import kquants

        return kquants.quantize(value, kind.name)
    if kind.name == "Q2_K":  # a type without a host kernel (and without a gguf quantizer): zero blocks
        block, nbytes = gguf.GGML_QUANT_SIZES[kind]
        return np.zeros((value.shape[0], value.shape[1] // block * nbytes), np.uint8)
    return gguf.quants.quantize(value, kind)


def rest_is(name, suffix):
    return name.startswith("layers.") and name.endswith("." + suffix)


@pytest.fixture
def tiny():
    config = tiny_config(d_model=64, head_dim=16, d_ff=96, tie_embeddings=False)
    return config, random_weights(config, seed=11)


def test_round_trip_restores_canonical_weights(tmp_path, tiny):
    config, weights = write_tiny_gguf(tmp_path / "m.gguf", *tiny)
    got_config, got, tok = loader.load(tmp_path / "m.gguf")
    assert got_config == config.replace(name=got_config.name, bos_id=1, eos_ids=(2,), norm_eps=got_config.norm_eps)
    assert abs(got_config.norm_eps - config.norm_eps) < 1e-9
    assert set(got) == set(weights)
    for name in weights:
        np.testing.assert_array_equal(got[name], weights[name], err_msg=name)
    # "the" has no merge "t he"; " the" merges all the way to "Ġthe".
    assert tok.encode("the the") == [tok.token_id("t"), tok.token_id("he"), tok.token_id("Ġthe")]
    assert tok.decode(tok.encode("the the 123")) == "the the 123"


def test_quantized_tensors_dequantize_close(tmp_path, tiny):
    _, weights = write_tiny_gguf(tmp_path / "q.gguf", *tiny, quantize=True)
    _, got, _ = loader.load(tmp_path / "q.gguf")
    for name in ("layers.0.wq", "layers.1.w_down_t", "embed"):
        scale = np.abs(weights[name]).max()
        np.testing.assert_allclose(got[name], weights[name], atol=scale / 100)


def test_unsupported_architecture_is_refused(tmp_path, tiny):
    write_tiny_gguf(tmp_path / "g.gguf", *tiny, arch="gpt2")
    with pytest.raises(ConfigError, match="unsupported GGUF architecture 'gpt2'"):
        loader.load(tmp_path / "g.gguf")


def test_truncated_and_foreign_files_are_refused(tmp_path, tiny):
    write_tiny_gguf(tmp_path / "m.gguf", *tiny)
    data = (tmp_path / "m.gguf").read_bytes()
    (tmp_path / "cut.gguf").write_bytes(data[: len(data) // 2])
    with pytest.raises(ConfigError, match="truncated"):
        loader.load(tmp_path / "cut.gguf")
    (tmp_path / "text.gguf").write_text("not a model")
    with pytest.raises(ConfigError, match="truncated or not a GGUF"):
        loader.load(tmp_path / "text.gguf")
    with pytest.raises(ConfigError, match="model not found"):
        loader.load(tmp_path / "absent.gguf")


def test_auto_weights_are_the_files_own_blocks_or_float32(tmp_path, capsys):
    """--weights auto (pjinfer.runtime.engine.resolve_weights) runs q4_1 for a GGUF whose layers are all Q4_1, gguf for
    other block types with host kernels, float32 otherwise."""
    from pjinfer.runtime.engine import resolve_weights

    config = tiny_config(d_model=64, n_heads=4, head_dim=16, d_ff=128)
    weights = random_weights(config)
    q4, q8 = tmp_path / "q4.gguf", tmp_path / "q8.gguf"
    write_tiny_gguf(q4, config, weights, layer_type=gguf.GGMLQuantizationType.Q4_1)
    write_tiny_gguf(q8, config, weights, quantize=True)
    assert loader.stored_format(q4) == "q4_1" and resolve_weights("auto", q4) == "q4_1"
    assert loader.stored_format(q8) == "gguf" and resolve_weights("auto", q8) == "gguf"   # blocks with a kernel
    assert resolve_weights("auto", None) == "q4_1"                         # the embedded model
    assert resolve_weights("auto", tmp_path) == "float32"                  # a directory (HF layout)
    assert resolve_weights("int8", q4) == "int8"
    # A block type without a host kernel: float32, said in one line naming the type.
    q2 = tmp_path / "q2.gguf"
    wide = tiny_config(d_model=256, n_heads=4, head_dim=64, d_ff=256)
    write_tiny_gguf(q2, wide, random_weights(wide), layer_type=gguf.GGMLQuantizationType.Q2_K)
    capsys.readouterr()
    assert loader.stored_format(q2) is None and resolve_weights("auto", q2) == "float32"
    assert capsys.readouterr().err.strip() == "pjinfer: running float32 weights: no host kernel reads type Q2_K"
    (tmp_path / "junk.gguf").write_bytes(b"not a model")
    assert resolve_weights("auto", tmp_path / "junk.gguf") == "float32"    # the loader refuses it in one line
    # With a bundle: q4_1 runs calibrated thresholds; a predictor bundle runs float32.
    import json

    for stages, want in (({"profile": {}}, "float32"), ({"thresholds": {}}, "q4_1")):
        bundle = tmp_path / f"bundle-{want}"
        bundle.mkdir()
        (bundle / "manifest.json").write_text(json.dumps({"format": 1, "stages": stages, "model": {}}))
        assert resolve_weights("auto", None, bundle) == want
