"""Text <-> token ids with the `tokenizers` package, built from GGUF metadata or an HF tokenizer.json."""
from __future__ import annotations

import json
from pathlib import Path

from tokenizers import AddedToken, Regex
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors

from pjinfer.config import ConfigError

# GGUF token types (llama.cpp): 3 = control, 4 = user-defined; both are matched whole, never split.
_SPECIAL_TOKEN_TYPES = (3, 4)
# Pre-tokenizer regexes by `tokenizer.ggml.pre`: split first, then byte-level without its own regex.
_GPT2_PATTERN = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
# Qwen2's (llama.cpp's LLAMA_VOCAB_PRE_TYPE_QWEN2, the HF tokenizer.json's Split): single digits, letters with
# one leading non-letter, case-insensitive contractions.
_QWEN2_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                  r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_PRE_TOKENIZERS = {
    # SmolLM: every digit on its own, then GPT-2 byte-level splitting.
    "smollm": lambda: pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]),
    "gpt2": lambda: pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    "qwen2": lambda: pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_QWEN2_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]),
    "default": lambda: pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_GPT2_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]),
}


class Tokenizer:
    def __init__(self, tok: HFTokenizer, *, eos_ids=(), chat_template: str | None = None):
        self._tok = tok
        self.eos_ids = tuple(eos_ids)
        self.chat_template = chat_template

    @classmethod
    def from_gguf_fields(cls, *, tokens, merges, token_types, model, pre, chat_template, eos_ids, bos_id, add_bos):
        if model != "gpt2":
            raise ConfigError(f"unsupported GGUF tokenizer model {model!r} (supported: gpt2 byte-level BPE)")
        if pre not in _PRE_TOKENIZERS:
            raise ConfigError(f"unsupported GGUF pre-tokenizer {pre!r} (supported: {', '.join(_PRE_TOKENIZERS)})")
        vocab = {t: i for i, t in enumerate(tokens)}
        bpe = models.BPE(vocab=vocab, merges=[tuple(m.split(" ", 1)) for m in merges], fuse_unk=False)
        tok = HFTokenizer(bpe)
        tok.pre_tokenizer = _PRE_TOKENIZERS[pre]()
        tok.decoder = decoders.ByteLevel()
        special = [t for t, kind in zip(tokens, token_types) if kind in _SPECIAL_TOKEN_TYPES]
        tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
        if add_bos and bos_id is not None:
            bos = tokens[bos_id]
            tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", special_tokens=[(bos, bos_id)])
        return cls(tok, eos_ids=eos_ids, chat_template=chat_template)

    @classmethod
    def from_hf_dir(cls, path: Path, *, eos_ids=()):
        file = path / "tokenizer.json"
        if not file.exists():
            raise ConfigError(f"no tokenizer.json in {path}")
        try:
            tok = HFTokenizer.from_file(str(file))
        except Exception as e:
            raise ConfigError(f"cannot read {file}: {e}") from None
        template = None
        cfg = path / "tokenizer_config.json"
        if cfg.exists():
            template = json.loads(cfg.read_text()).get("chat_template")
        return cls(tok, eos_ids=eos_ids, chat_template=template)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, *, add_special: bool = True) -> list[int]:
        """add_special adds what the model's tokenizer adds (a BOS for most HF Llamas, nothing for SmolLM2)."""
        return self._tok.encode(text, add_special_tokens=add_special).ids

    def decode(self, ids, *, skip_special: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special)

    def token_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def apply_chat(self, messages: list[dict]) -> str:
        """Render the model's chat template with a generation prompt, as HF's apply_chat_template does."""
        if not self.chat_template:
            raise ConfigError("this model has no chat template; drop --chat")
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        return env.from_string(self.chat_template).render(messages=messages, add_generation_prompt=True)


class StreamDecoder:
    """Turns a growing list of ids into text pieces without splitting a multi-byte character, and ends the text
    before the first of `stops` (strings): once one appears, `stop` names it and `text` is cut before it. Text
    that could still be the start of a stop string is held back from `push` until it cannot; `flush` returns it
    when the stream ends for another reason.

    Each push decodes a short window of the newest ids, not the whole list (which made a long reply quadratic):
    the window starts at the ids before the last piece, so a decoder that treats the first token specially
    (a stripped leading space) treats both decodes the same, and the new text is what the window adds to them.
    The window restarts only where the text so far was whole, so the pieces add up to decode(ids)."""

    def __init__(self, tokenizer: Tokenizer, stops=()):
        self.tokenizer = tokenizer
        self.stops = [s for s in stops if s]
        self.hold = max((len(s) - 1 for s in self.stops), default=0)
        self.ids: list[int] = []
        self.text = ""             # everything decoded so far (cut at a stop string)
        self.emitted = 0           # characters of `text` returned by push/flush
        self.stop: str | None = None
        self._start = 0            # the window: ids[_start:], of which ids[_start:_read] are already in `text`
        self._read = 0
        self._head = ""            # decode(ids[_start:_read])

    def push(self, token_id: int) -> str:
        """The new text that is safe to show after `token_id` (empty once a stop string has been seen)."""
        if self.stop is not None:
            return ""
        self.ids.append(token_id)
        window = self.tokenizer.decode(self.ids[self._start:])
        if window.endswith("\ufffd") or len(window) <= len(self._head):
            return ""              # an incomplete UTF-8 sequence (wait for the next token), or no new text yet
        self.text += window[len(self._head):]
        self._start, self._read = self._read, len(self.ids)
        self._head = self.tokenizer.decode(self.ids[self._start:self._read])
        # A stop string that ends in the new text starts at or after `emitted`: held-back text covers its head.
        hits = [(self.text.find(s, self.emitted), s) for s in self.stops]
        hits = [(at, s) for at, s in hits if at >= 0]
        if hits:
            at, self.stop = min(hits)
            self.text = self.text[:at]
            return self.flush()
        upto = max(self.emitted, len(self.text) - self.hold)
        piece, self.emitted = self.text[self.emitted:upto], upto
        return piece

    def flush(self) -> str:
        """What was held back: the rest of the text."""
        piece, self.emitted = self.text[self.emitted:], len(self.text)
        return piece

    def text_ids(self) -> list[int]:
        """The ids `text` comes from: every id pushed, or, once a stop string cut the text, the ids up to and
        including the one whose text holds the stop string's first character (the later ones are dropped)."""
        if self.stop is None:
            return list(self.ids)
        cut = len(self.text)

        def reaches(k):   # do the first k ids decode past the cut? (an unfinished character does not count)
            return len(self.tokenizer.decode(self.ids[:k]).rstrip("\ufffd")) > cut

        low, high = 0, len(self.ids)   # reaches(high) holds; find the smallest such k
        while low < high:
            mid = (low + high) // 2
            if reaches(mid):
                high = mid
            else:
                low = mid + 1
        return self.ids[:high]
