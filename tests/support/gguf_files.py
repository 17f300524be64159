"""Tiny GGUF files written with gguf's writer, as llama.cpp lays them out: a byte-level BPE vocabulary, every
block type (the K types through tests/support/kquants.py), PowerInfer's layout."""
import gguf
import numpy as np


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
    tests/support/kquants.py (gguf has no quantizer for them). PowerInfer's layout: down_t writes blk.N.ffn_down_t
    [d_ff, d] instead of ffn_down, extra {GGUF name: array} adds tensors as they are, fields {key: float} adds
    float32 metadata (a str: string metadata, for files that get it wrong), and magic (b"PWRI") overwrites the file's first four bytes, as PowerInfer's converters do.
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
        w.add_string(key, number) if isinstance(number, str) else w.add_float32(key, number)
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
    """float32 [rows, cols] -> uint8 blocks of kind: gguf's quantizer, or tests/support/kquants.py for the K types."""
    if kind.name in ("Q4_K", "Q5_K", "Q6_K"):
        from tests.support import kquants

        return kquants.quantize(value, kind.name)
    if kind.name == "Q2_K":  # a type without a host kernel (and without a gguf quantizer): zero blocks
        block, nbytes = gguf.GGML_QUANT_SIZES[kind]
        return np.zeros((value.shape[0], value.shape[1] // block * nbytes), np.uint8)
    return gguf.quants.quantize(value, kind)


def rest_is(name, suffix):
    return name.startswith("layers.") and name.endswith("." + suffix)


def write_spm_vocab(w):
    """A tiny SentencePiece vocabulary as a Llama-2 GGUF stores it (PowerInfer's files use one): <unk>, <s>, </s>,
    the 256 byte tokens, the letters and a few scored joins; no chat template. Returns its size."""
    pieces = ["\u2581", *"abcdefghijklmnopqrstuvwxyz", "\u2581t", "he", "\u2581the", "\u2581q", "ui", "ck", "\u2581fox",
              "ll", "\u2581he", "\u2581hello", "or", "\u2581wor", "ld", "\u2581world"]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * 259 + [-float(i) for i in range(len(pieces))])
    w.add_token_types([2, 3, 3] + [6] * 256 + [1] * len(pieces))
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    return len(tokens)


def write_requantized_default_model(path, layer_type) -> None:
    """The default model's own weights and tokenizer, its matrices re-quantized: layer_type(canonical name) gives
    each one's gguf.GGMLQuantizationType (write_tiny_gguf's)."""
    from pjinfer.load import loader
    from pjinfer.load.gguf_file import GGUFFile

    source = loader.default_model_path()
    config, weights, _ = loader.load(source)
    fields = GGUFFile(source).fields

    def vocab(w):
        w.add_tokenizer_model(fields["tokenizer.ggml.model"])
        w.add_tokenizer_pre(fields["tokenizer.ggml.pre"])
        w.add_token_list(list(fields["tokenizer.ggml.tokens"]))
        w.add_token_merges(list(fields["tokenizer.ggml.merges"]))
        w.add_token_types([int(t) for t in fields["tokenizer.ggml.token_type"]])
        w.add_eos_token_id(int(fields["tokenizer.ggml.eos_token_id"]))
        w.add_bos_token_id(int(fields["tokenizer.ggml.bos_token_id"]))
        return len(fields["tokenizer.ggml.tokens"])

    write_tiny_gguf(path, config, {k: np.asarray(v) for k, v in weights.items()}, layer_type=layer_type, vocab=vocab)
