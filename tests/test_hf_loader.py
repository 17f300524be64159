"""The Hugging Face loader (`pjinfer.load.loader.load` on a directory) on tiny checkpoints written into tmp_path.

a. Round trip without torch: HF tensor names -> canonical ones, checked against weights renamed by hand.
b. Against transformers' own Llama / OPT (skipped when torch or transformers is not installed).
c. Bad input: each case is a ConfigError with a one-line reason.
"""
from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import save_file
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models, pre_tokenizers

from pjinfer.config import ConfigError, ModelConfig
from pjinfer.load import loader
from pjinfer.runtime.engine import Engine
from pjinfer.runtime.model import Transformer
from tests.conftest import jitted_logits

VOCAB, D, LAYERS, HEADS, KV_HEADS, FF, MAX_POS = 128, 64, 2, 4, 2, 96, 64
HD = D // HEADS
SEQ = 11
ATOL = 1e-4  # float32 end to end: observed differences from torch are ~5e-6 on logits of magnitude ~5


# ---------------------------------------------------------------- tiny checkpoints
def llama_raw(**changes) -> dict:
    raw = dict(model_type="llama", vocab_size=VOCAB, hidden_size=D, num_hidden_layers=LAYERS,
               num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, intermediate_size=FF,
               max_position_embeddings=MAX_POS, rms_norm_eps=1e-6, rope_theta=10000.0, hidden_act="silu",
               tie_word_embeddings=False, bos_token_id=0, eos_token_id=1)
    return raw | changes


def opt_raw(**changes) -> dict:
    raw = dict(model_type="opt", vocab_size=VOCAB, hidden_size=D, num_hidden_layers=LAYERS,
               num_attention_heads=HEADS, ffn_dim=FF, max_position_embeddings=MAX_POS, do_layer_norm_before=True,
               word_embed_proj_dim=D, activation_function="relu", tie_word_embeddings=True,
               bos_token_id=2, eos_token_id=2)
    return raw | changes


def _rand(rng, *shape, mean=0.0):
    # Larger than HF's 0.02 init so that logits are O(1) and a wrong weight shows in the comparison.
    return (mean + 0.3 * rng.standard_normal(shape)).astype(np.float32)


def llama_tensors(raw: dict, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    q, kv = raw["num_attention_heads"] * HD, raw["num_key_value_heads"] * HD
    t = {"model.embed_tokens.weight": _rand(rng, VOCAB, D), "model.norm.weight": _rand(rng, D, mean=1)}
    if not raw["tie_word_embeddings"]:
        t["lm_head.weight"] = _rand(rng, VOCAB, D)
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        t |= {p + "input_layernorm.weight": _rand(rng, D, mean=1),
              p + "post_attention_layernorm.weight": _rand(rng, D, mean=1),
              p + "self_attn.q_proj.weight": _rand(rng, q, D), p + "self_attn.k_proj.weight": _rand(rng, kv, D),
              p + "self_attn.v_proj.weight": _rand(rng, kv, D), p + "self_attn.o_proj.weight": _rand(rng, D, q),
              p + "mlp.gate_proj.weight": _rand(rng, FF, D), p + "mlp.up_proj.weight": _rand(rng, FF, D),
              p + "mlp.down_proj.weight": _rand(rng, D, FF)}
    return t


def opt_tensors(raw: dict, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    p = "model.decoder."
    t = {p + "embed_tokens.weight": _rand(rng, VOCAB, D),
         p + "embed_positions.weight": _rand(rng, MAX_POS + 2, D),  # OPT keeps 2 extra rows at the start
         p + "final_layer_norm.weight": _rand(rng, D, mean=1), p + "final_layer_norm.bias": _rand(rng, D)}
    if not raw["tie_word_embeddings"]:
        t["lm_head.weight"] = _rand(rng, VOCAB, D)
    for i in range(LAYERS):
        lp = f"{p}layers.{i}."
        for norm in ("self_attn_layer_norm", "final_layer_norm"):
            t |= {f"{lp}{norm}.weight": _rand(rng, D, mean=1), f"{lp}{norm}.bias": _rand(rng, D)}
        for proj in ("q_proj", "k_proj", "v_proj", "out_proj"):
            t |= {f"{lp}self_attn.{proj}.weight": _rand(rng, D, D), f"{lp}self_attn.{proj}.bias": _rand(rng, D)}
        t |= {lp + "fc1.weight": _rand(rng, FF, D), lp + "fc1.bias": _rand(rng, FF),
              lp + "fc2.weight": _rand(rng, D, FF), lp + "fc2.bias": _rand(rng, D)}
    return t


def llama_canonical(raw: dict, t: dict) -> dict:
    """The canonical names of pjinfer/runtime/model.py, renamed by hand (independently of the loader's tables)."""
    w = {"embed": t["model.embed_tokens.weight"], "final_norm.scale": t["model.norm.weight"]}
    if not raw["tie_word_embeddings"]:
        w["lm_head"] = t["lm_head.weight"]
    for i in range(LAYERS):
        p, c = f"model.layers.{i}.", f"layers.{i}."
        w |= {c + "attn_norm.scale": t[p + "input_layernorm.weight"],
              c + "ffn_norm.scale": t[p + "post_attention_layernorm.weight"],
              c + "wq": t[p + "self_attn.q_proj.weight"], c + "wk": t[p + "self_attn.k_proj.weight"],
              c + "wv": t[p + "self_attn.v_proj.weight"], c + "wo": t[p + "self_attn.o_proj.weight"],
              c + "w_gate": t[p + "mlp.gate_proj.weight"], c + "w_up": t[p + "mlp.up_proj.weight"],
              c + "w_down_t": t[p + "mlp.down_proj.weight"].T}
    return w


def opt_canonical(raw: dict, t: dict) -> dict:
    p = "model.decoder."
    w = {"embed": t[p + "embed_tokens.weight"], "pos_embed": t[p + "embed_positions.weight"][2:],
         "final_norm.scale": t[p + "final_layer_norm.weight"], "final_norm.bias": t[p + "final_layer_norm.bias"]}
    if not raw["tie_word_embeddings"]:
        w["lm_head"] = t["lm_head.weight"]
    for i in range(LAYERS):
        lp, c = f"{p}layers.{i}.", f"layers.{i}."
        w |= {c + "attn_norm.scale": t[lp + "self_attn_layer_norm.weight"],
              c + "attn_norm.bias": t[lp + "self_attn_layer_norm.bias"],
              c + "ffn_norm.scale": t[lp + "final_layer_norm.weight"], c + "ffn_norm.bias": t[lp + "final_layer_norm.bias"],
              c + "w_up": t[lp + "fc1.weight"], c + "b_up": t[lp + "fc1.bias"],
              c + "w_down_t": t[lp + "fc2.weight"].T, c + "b_down": t[lp + "fc2.bias"]}
        for proj, short in (("q_proj", "q"), ("k_proj", "k"), ("v_proj", "v"), ("out_proj", "o")):
            w |= {f"{c}w{short}": t[f"{lp}self_attn.{proj}.weight"], f"{c}b{short}": t[f"{lp}self_attn.{proj}.bias"]}
    return w


def write_tokenizer(path):
    # A word-level vocabulary w0..w127 is enough: the loader only has to find and read tokenizer.json.
    tok = HFTokenizer(models.WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(path / "tokenizer.json"))


def write_checkpoint(path, raw: dict, tensors: dict):
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(raw))
    save_file(tensors, str(path / "model.safetensors"))
    write_tokenizer(path)
    return path


def forward_logits(config: ModelConfig, weights: dict, ids) -> np.ndarray:
    """Full-vocab logits [T, vocab] of one sequence, from one forward pass (float32 attention, no cache)."""
    return np.asarray(jitted_logits(Transformer(config, weights))(jnp.asarray(ids, jnp.int32)[None]))[0]


def random_ids(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, VOCAB, SEQ)


# ---------------------------------------------------------------- a. round trip without torch
ROPE_V5 = {"rope_theta": None, "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}}


@pytest.mark.parametrize("act, activation, tie, rope", [
    ("silu", "swiglu", False, {}),
    ("relu", "reglu", True, ROPE_V5),            # transformers >= 5 keeps rope_theta under rope_parameters
    ("gelu_pytorch_tanh", "geglu", False, {"rope_theta": 1e6}),
], ids=["swiglu", "reglu-tied-rope_parameters", "geglu-theta"])
def test_llama_round_trip(tmp_path, act, activation, tie, rope):
    raw = llama_raw(hidden_act=act, tie_word_embeddings=tie, **rope)
    raw = {k: v for k, v in raw.items() if v is not None}
    tensors = llama_tensors(raw, seed=1)
    config, weights, tokenizer = loader.load(write_checkpoint(tmp_path, raw, tensors))

    theta = (raw.get("rope_parameters") or raw)["rope_theta"]
    assert config == ModelConfig(
        arch="llama", vocab_size=VOCAB, d_model=D, n_layers=LAYERS, n_heads=HEADS, n_kv_heads=KV_HEADS,
        head_dim=HD, d_ff=FF, activation=activation, max_seq_len=MAX_POS, norm_eps=1e-6, rope_theta=theta,
        tie_embeddings=tie, bos_id=0, eos_ids=(1,), name="llama")
    expected = llama_canonical(raw, tensors)
    assert weights.keys() == expected.keys()
    for name, w in expected.items():
        np.testing.assert_array_equal(weights[name], w, err_msg=name)
    # The same canonical weights built in memory give the same logits.
    ids = random_ids(2)
    np.testing.assert_allclose(forward_logits(config, weights, ids), forward_logits(config, expected, ids),
                               atol=1e-6)
    assert tokenizer.encode("w3 w17 w5") == [3, 17, 5] and tokenizer.eos_ids == (1,)


@pytest.mark.parametrize("tie, strip_prefix", [(True, False), (False, False), (True, True)],
                         ids=["tied", "untied", "tied-no-model-prefix"])
def test_opt_round_trip(tmp_path, tie, strip_prefix):
    raw = opt_raw(tie_word_embeddings=tie)
    tensors = opt_tensors(raw, seed=3)
    # Larger OPT checkpoints (e.g. opt-6.7b) name their tensors "decoder.*", without "model.".
    on_disk = {(k.removeprefix("model.") if strip_prefix else k): v for k, v in tensors.items()}
    config, weights, _ = loader.load(write_checkpoint(tmp_path, raw, on_disk))

    assert (config.arch, config.activation, config.d_ff, config.max_seq_len) == ("opt", "relu", FF, MAX_POS)
    assert (config.n_kv_heads, config.tie_embeddings, config.norm_eps) == (HEADS, tie, 1e-5)
    expected = opt_canonical(raw, tensors)
    assert weights.keys() == expected.keys()
    for name, w in expected.items():
        np.testing.assert_array_equal(weights[name], w, err_msg=name)
    assert weights["pos_embed"].shape == (MAX_POS, D)
    ids = random_ids(4)
    np.testing.assert_allclose(forward_logits(config, weights, ids), forward_logits(config, expected, ids),
                               atol=1e-6)


# ---------------------------------------------------------------- b. against transformers
def _hf_model(kind: str, seed: int, **cfg):
    """A tiny random transformers model in eval mode, weights scaled up as in _rand."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(seed)
    if kind == "llama":
        config = transformers.LlamaConfig(
            vocab_size=cfg.pop("vocab_size", VOCAB), hidden_size=D, intermediate_size=FF, num_hidden_layers=LAYERS,
            num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=MAX_POS, **cfg)
        model = transformers.LlamaForCausalLM(config)
    elif kind == "qwen2":
        config = transformers.Qwen2Config(
            vocab_size=cfg.pop("vocab_size", VOCAB), hidden_size=D, intermediate_size=FF, num_hidden_layers=LAYERS,
            num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=MAX_POS, **cfg)
        model = transformers.Qwen2ForCausalLM(config)
    else:
        config = transformers.OPTConfig(
            vocab_size=VOCAB, hidden_size=D, ffn_dim=FF, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
            max_position_embeddings=MAX_POS, word_embed_proj_dim=D, **cfg)
        model = transformers.OPTForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.3)
            else:  # norm scales around 1, biases around 0
                p.normal_(1.0 if "norm" in name and name.endswith("weight") else 0.0, 0.3)
    return model.float().eval()


def _torch_logits(model, ids) -> np.ndarray:
    import torch

    with torch.no_grad():
        return model(torch.as_tensor(ids)[None]).logits[0].float().numpy()


@pytest.mark.slow
@pytest.mark.parametrize("cfg", [
    dict(hidden_act="silu"),                                              # SwiGLU with GQA (4 heads, 2 KV)
    dict(hidden_act="relu"),                                              # ReGLU
    dict(hidden_act="gelu_pytorch_tanh", tie_word_embeddings=True, rope_theta=500000.0),
], ids=["swiglu", "reglu", "geglu-tied-theta"])
def test_llama_matches_transformers(tmp_path, cfg):
    model = _hf_model("llama", seed=5, **cfg)
    model.save_pretrained(tmp_path, safe_serialization=True)
    write_tokenizer(tmp_path)
    config, weights, _ = loader.load(tmp_path)
    assert config.rope_theta == cfg.get("rope_theta", 10000.0)
    ids = random_ids(6)
    np.testing.assert_allclose(forward_logits(config, weights, ids), _torch_logits(model, ids), atol=ATOL)


QWEN2 = [dict(tie_word_embeddings=True, rope_theta=1e6), dict(tie_word_embeddings=False, rope_theta=10000.0)]


@pytest.mark.parametrize("cfg", QWEN2, ids=["tied-theta1e6", "untied"])
def test_qwen2_matches_transformers(tmp_path, cfg):
    """Qwen2 (q/k/v biases, its rope theta, tied or untied head) from an HF directory."""
    model = _hf_model("qwen2", seed=11, **cfg)
    model.save_pretrained(tmp_path, safe_serialization=True)
    write_tokenizer(tmp_path)
    config, weights, _ = loader.load(tmp_path)
    assert (config.rope_theta, config.tie_embeddings) == (cfg["rope_theta"], cfg["tie_word_embeddings"])
    assert {f"layers.0.{b}" for b in ("bq", "bk", "bv")} <= set(weights) and "layers.0.bo" not in weights
    ids = random_ids(12)
    np.testing.assert_allclose(forward_logits(config, weights, ids), _torch_logits(model, ids), atol=ATOL)


@pytest.mark.parametrize("cfg", QWEN2, ids=["tied-theta1e6", "untied"])
def test_qwen2_gguf_matches_transformers(tmp_path, cfg):
    """The same model as a qwen2 GGUF (gguf's writer, llama.cpp's tensor names and keys, q/k rows not permuted)."""
    from tests.support.gguf_files import write_tiny_gguf

    vocab = 262  # write_tiny_gguf's byte-level vocabulary
    model = _hf_model("qwen2", seed=13, vocab_size=vocab, **cfg)
    model.save_pretrained(tmp_path / "hf", safe_serialization=True)
    write_tokenizer(tmp_path / "hf")
    config, weights, _ = loader.load(tmp_path / "hf")
    write_tiny_gguf(tmp_path / "q.gguf", config, weights, arch="qwen2")
    config, weights, _ = loader.load(tmp_path / "q.gguf")
    assert (config.rope_theta, config.tie_embeddings, config.vocab_size) == (
        cfg["rope_theta"], cfg["tie_word_embeddings"], vocab)
    ids = random_ids(14)
    np.testing.assert_allclose(forward_logits(config, weights, ids), _torch_logits(model, ids), atol=ATOL)


@pytest.mark.parametrize("tie", [True, False])
def test_opt_matches_transformers(tmp_path, tie):
    model = _hf_model("opt", seed=7, tie_word_embeddings=tie)
    model.save_pretrained(tmp_path, safe_serialization=True)
    write_tokenizer(tmp_path)
    config, weights, _ = loader.load(tmp_path)
    ids = random_ids(8)
    np.testing.assert_allclose(forward_logits(config, weights, ids), _torch_logits(model, ids), atol=ATOL)


def test_engine_token_logprobs_match_transformers(tmp_path):
    # The user-facing scoring path (jitted, through Engine) against torch's log-softmax.
    model = _hf_model("llama", seed=9)  # skips without torch / transformers
    import torch

    model.save_pretrained(tmp_path, safe_serialization=True)
    write_tokenizer(tmp_path)
    engine = Engine(*loader.load(tmp_path))
    ids = random_ids(10)
    logp = torch.log_softmax(torch.as_tensor(_torch_logits(model, ids)), dim=-1).numpy()
    expected = logp[np.arange(SEQ - 1), ids[1:]]
    np.testing.assert_allclose(engine.token_logprobs(ids[None])[0], expected, atol=ATOL)


# ---------------------------------------------------------------- c. bad input
def expect_error(path, match: str):
    with pytest.raises(ConfigError, match=match) as err:
        loader.load(path)
    assert "\n" not in str(err.value)  # one line for the user


def test_missing_path_and_config(tmp_path):
    expect_error(tmp_path / "nowhere", "model not found")
    expect_error(tmp_path, "no config.json")
    (tmp_path / "config.json").write_text("{not json")
    expect_error(tmp_path, "not valid JSON")


@pytest.mark.parametrize("raw, match", [
    (llama_raw(model_type="gpt_neox"), "unsupported model_type 'gpt_neox'"),
    ({"hidden_size": D}, "unsupported model_type None"),
    (llama_raw(hidden_act="gelu"), "unsupported hidden_act 'gelu'"),  # exact GELU != pjinfer's tanh GEGLU
    (llama_raw(rope_scaling={"type": "linear", "factor": 2.0}), "only plain RoPE"),
    (llama_raw(rope_parameters={"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0}), "only plain RoPE"),
    (llama_raw(attention_bias=True), "attention_bias"),
    ({k: v for k, v in llama_raw().items() if k != "num_attention_heads"}, "lacks 'num_attention_heads'"),
    (opt_raw(do_layer_norm_before=False), "post-layer-norm"),
    (opt_raw(word_embed_proj_dim=32), "word_embed_proj_dim"),
    (llama_raw(model_type="qwen2", use_sliding_window=True), "qwen2 variant: use_sliding_window"),
], ids=["gpt_neox", "no-model_type", "gelu", "rope_scaling", "rope_parameters", "attention_bias",
        "missing-key", "opt-post-ln", "opt-proj", "qwen2-sliding-window"])
def test_unsupported_config(tmp_path, raw, match):
    # The config is refused before any tensor is read, so config.json alone is enough.
    (tmp_path / "config.json").write_text(json.dumps(raw))
    expect_error(tmp_path, match)


def test_bad_safetensors(tmp_path):
    raw = llama_raw()
    write_checkpoint(tmp_path, raw, llama_tensors(raw, seed=11))
    weights_file = tmp_path / "model.safetensors"
    data = weights_file.read_bytes()
    weights_file.write_bytes(data[:len(data) // 2])  # an interrupted download
    expect_error(tmp_path, "model.safetensors: truncated or corrupt")
    weights_file.unlink()
    expect_error(tmp_path, r"no \*\.safetensors")


@pytest.mark.parametrize("edit, match", [
    (lambda t: t.pop("model.layers.1.mlp.up_proj.weight"), "lacks tensor 'model.layers.1.mlp.up_proj.weight'"),
    (lambda t: t.pop("lm_head.weight"), "lacks tensor 'lm_head.weight'"),  # untied: the head must be there
    # A tensor the model would not use (here a bias) must not be dropped silently.
    (lambda t: t.update({"model.layers.0.self_attn.q_proj.bias": np.zeros(D, np.float32)}), "unexpected tensor"),
    # Shapes that disagree with config.json: a clear message rather than a reshape error mid-forward.
    (lambda t: t.update({"model.layers.0.self_attn.k_proj.weight": np.zeros((D, D), np.float32)}),
     r"k_proj.weight' has shape \(64, 64\); config.json implies \(32, 64\)"),
], ids=["missing-layer-weight", "missing-lm_head", "unexpected-bias", "wrong-kv-shape"])
def test_bad_weights(tmp_path, edit, match):
    raw = llama_raw()
    tensors = llama_tensors(raw, seed=12)
    edit(tensors)
    expect_error(write_checkpoint(tmp_path, raw, tensors), match)


def test_missing_tokenizer(tmp_path):
    raw = opt_raw()
    write_checkpoint(tmp_path, raw, opt_tensors(raw, seed=13))
    (tmp_path / "tokenizer.json").unlink()
    expect_error(tmp_path, "no tokenizer.json")
