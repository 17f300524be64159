"""Text <-> token ids: byte-level BPE with the `tokenizers` package (built from GGUF metadata or an HF
tokenizer.json), and llama.cpp's SentencePiece vocabulary (pjinfer.load.spm) behind the same interface."""
from __future__ import annotations

import json
import re
from pathlib import Path

from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors

from pjinfer.config import ConfigError
from pjinfer.load.spm import CONTROL, UNKNOWN, USER_DEFINED, SpmVocab

# GGUF token types (llama.cpp) matched whole, never split: control and user-defined.
_SPECIAL_TOKEN_TYPES = (CONTROL, USER_DEFINED)
# llama.cpp's chat template for a model file that stores none (common/chat.cpp: ChatML).
CHATML_TEMPLATE = ("{% for message in messages %}{{ '<|im_start|>' + message.role + '\n' + message.content + "
                   "'<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
                   "{% endif %}")
# Pre-tokenizer regexes by `tokenizer.ggml.pre`: split first, then byte-level without its own regex.
_GPT2_PATTERN = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
# Qwen2's (llama.cpp's LLAMA_VOCAB_PRE_TYPE_QWEN2, the HF tokenizer.json's Split): single digits, letters with
# one leading non-letter, case-insensitive contractions.
_QWEN2_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                  r"|\s*[\r\n]+|\s+(?!\S)|\s+")
# Llama-3's (llama.cpp's LLAMA_VOCAB_PRE_TYPE_LLAMA3): Qwen2's with numbers in runs of up to three digits.
_LLAMA3_PATTERN = _QWEN2_PATTERN.replace(r"|\p{N}|", r"|\p{N}{1,3}|")


def _smollm():
    # SmolLM: every digit on its own, then GPT-2 byte-level splitting.
    return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])


def _gpt2():
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _split_then_bytes(pattern: str):
    return lambda: pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
                                            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


# `tokenizer.ggml.pre` -> pre-tokenizer. Names llama.cpp gives the same regex share one; each is checked on
# llama.cpp's tokenizer test files where one exists (tests/test_tokenizer_vocab.py). Others are refused.
_PRE_TOKENIZERS = {
    "smollm": _smollm, "starcoder": _smollm, "refact": _smollm, "command-r": _smollm,
    "gpt2": _gpt2, "gpt-2": _gpt2, "mpt": _gpt2,
    "qwen2": _split_then_bytes(_QWEN2_PATTERN),
    "llama-bpe": _split_then_bytes(_LLAMA3_PATTERN),
    "default": _split_then_bytes(_GPT2_PATTERN),
}
# Pre-tokenizers whose words are looked up whole before any merge (llama.cpp's ignore_merges).
_WHOLE_WORDS_FIRST = ("llama-bpe",)
# `tokenizer.ggml.model` values read: byte-level BPE, SentencePiece.
TOKENIZER_MODELS = ("gpt2", "llama")


def _spm_vocab(tokens, scores, token_types, unk_id, add_space_prefix) -> SpmVocab:
    if scores is None:
        raise ConfigError("the SentencePiece vocabulary has no tokenizer.ggml.scores, which its merges need")
    if len(scores) != len(tokens):
        raise ConfigError(f"the SentencePiece vocabulary has {len(scores)} scores for {len(tokens)} tokens")
    return SpmVocab(tokens, scores, token_types, unk_id=unk_id, add_space_prefix=bool(add_space_prefix))


def _byte_level_bpe(tokens, merges, token_types, pre, bos_id) -> HFTokenizer:
    """The `tokenizers` BPE of a "gpt2" GGUF vocabulary; bos_id: the BOS that encode(add_special=True) puts first."""
    if pre not in _PRE_TOKENIZERS:
        raise ConfigError(f"unsupported GGUF pre-tokenizer {pre!r} (supported: {', '.join(_PRE_TOKENIZERS)})")
    if merges is None:
        raise ConfigError("the BPE vocabulary has no tokenizer.ggml.merges")
    vocab = {t: i for i, t in enumerate(tokens)}
    bpe = models.BPE(vocab=vocab, merges=[tuple(m.split(" ", 1)) for m in merges], fuse_unk=False,
                     ignore_merges=pre in _WHOLE_WORDS_FIRST)
    tok = HFTokenizer(bpe)
    tok.pre_tokenizer = _PRE_TOKENIZERS[pre]()
    tok.decoder = decoders.ByteLevel()
    special = [t for t, kind in zip(tokens, token_types) if kind in _SPECIAL_TOKEN_TYPES]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    if bos_id is not None:
        bos = tokens[bos_id]
        tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", special_tokens=[(bos, bos_id)])
    return tok


class Tokenizer:
    """A `tokenizers` tokenizer: a GGUF's byte-level BPE, or an HF tokenizer.json. `special_text`
    ({"bos_token": ..., "eos_token": ...}) is what the chat template may refer to."""

    def __init__(self, tok: HFTokenizer | None, *, eos_ids=(), chat_template: str | None = None,
                 special_text: dict | None = None):
        self._tok = tok
        self.eos_ids = tuple(eos_ids)
        self.chat_template = chat_template
        self.special_text = dict(special_text or {})

    @classmethod
    def from_gguf_fields(cls, *, tokens, merges, token_types, model, pre, chat_template, eos_ids, bos_id, add_bos,
                         scores=None, unk_id=None, add_space_prefix=None, add_eos=False):
        """The tokenizer a GGUF's `tokenizer.*` metadata describes; a model, pre-tokenizer or vocabulary pjinfer
        cannot run exactly is refused (ConfigError). add_bos / add_space_prefix None: the model's default
        (llama.cpp: SentencePiece adds a BOS and a leading space, BPE neither). Without a chat template, llama.cpp's
        fallback: ChatML (CHATML_TEMPLATE), after the BOS where the model adds one."""
        if model not in TOKENIZER_MODELS:
            raise ConfigError(f"unsupported GGUF tokenizer model {model!r} "
                              "(supported: gpt2 byte-level BPE, llama SentencePiece)")
        spm = model == "llama"
        bos_id = bos_id if (spm if add_bos is None else add_bos) else None    # None: no BOS added
        special_text = {name: tokens[i] for name, i in (("bos_token", bos_id), ("eos_token", (eos_ids or [None])[0]))
                        if i is not None and 0 <= i < len(tokens)}
        if chat_template is None:
            chat_template = ("{{ bos_token }}" if bos_id is not None else "") + CHATML_TEMPLATE
        common = dict(eos_ids=eos_ids, chat_template=chat_template, special_text=special_text)
        if spm:
            prefix = True if add_space_prefix is None else add_space_prefix
            vocab = _spm_vocab(tokens, scores, token_types, unk_id, prefix)
            return SpmTokenizer(vocab, bos_id=bos_id, eos_id=eos_ids[0] if add_eos and eos_ids else None, **common)
        return cls(_byte_level_bpe(tokens, merges, token_types, pre, bos_id), **common)

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

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        return env.from_string(self.chat_template).render(messages=messages, add_generation_prompt=True,
                                                          **self.special_text)


class SpmTokenizer(Tokenizer):
    """llama.cpp's SentencePiece vocabulary (pjinfer.load.spm) behind Tokenizer's interface.

    encode matches the text of control, user-defined and unknown tokens whole (as llama.cpp does with
    parse_special, which chat templates need), and encodes the text between them with a leading "▁" where
    add_space_prefix and the text starts the input or follows such a token. add_special puts the BOS in front
    (bos_id None: the model adds none) and the EOS at the end (eos_id None: none)."""

    def __init__(self, vocab: SpmVocab, *, bos_id: int | None, eos_id: int | None, eos_ids=(),
                 chat_template: str | None = None, special_text: dict | None = None):
        super().__init__(None, eos_ids=eos_ids, chat_template=chat_template, special_text=special_text)
        self.vocab = vocab
        self.bos_id, self.eos_id = bos_id, eos_id
        kinds = (UNKNOWN, *_SPECIAL_TOKEN_TYPES)
        whole = sorted((t for t, kind in zip(vocab.tokens, vocab.types) if kind in kinds and t), key=len, reverse=True)
        self._special = re.compile("|".join(map(re.escape, whole))) if whole else None

    @property
    def vocab_size(self) -> int:
        return len(self.vocab.tokens)

    def encode(self, text: str, *, add_special: bool = True) -> list[int]:
        ids = [self.bos_id] if add_special and self.bos_id is not None else []
        after_special, at = True, 0
        for match in (self._special.finditer(text) if self._special else ()):
            if match.start() > at:
                ids += self.vocab.encode_text(text[at:match.start()], prefix_space=after_special)
            ids.append(self.vocab.ids[match.group()])
            after_special, at = True, match.end()
        if at < len(text):
            ids += self.vocab.encode_text(text[at:], prefix_space=after_special)
        if add_special and self.eos_id is not None:
            ids.append(self.eos_id)
        return ids

    def decode(self, ids, *, skip_special: bool = True) -> str:
        return self.vocab.decode_bytes(ids, skip_special=skip_special).decode("utf-8", errors="replace")

    def token_id(self, token: str) -> int | None:
        return self.vocab.ids.get(token)


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
