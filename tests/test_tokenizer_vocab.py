"""GGUF vocabularies against llama.cpp's own tokenizer test files (ggml-vocab-NAME.gguf with NAME.gguf.inp texts and
NAME.gguf.out ids, from the llama-cpp-python sdist; `make setup` extracts them to .venv/share/llama-vocab).

llama.cpp's tests/test-tokenizer-0.cpp reads the cases (texts separated by a marker line, one line of ids per text)
and tokenizes each with add_special false and parse_special false; decode here is its detokenize. The SentencePiece
files must give every case's ids and decode back to the text; each byte-level BPE file must pass every case or be
refused in one line (its pre-tokenizer or tokenizer model not implemented)."""
from pathlib import Path

import pytest

from pjinfer.config import ConfigError
from pjinfer.load import loader
from pjinfer.load.gguf_file import GGUFFile
from pjinfer.load.tokenizer import StreamDecoder

VOCAB_DIR = Path(__file__).resolve().parents[1] / ".venv" / "share" / "llama-vocab"
SEPARATOR = "\n__ggml_vocab_test__\n"
SPM = ("llama-spm", "phi-3")
# Every vocabulary with test cases in llama-cpp-python 0.3.36, and what pjinfer does with it.
PASSES = SPM + ("gpt-2", "mpt", "qwen2", "llama-bpe", "starcoder", "refact", "command-r")
REFUSED = {
    "bert-bge": "unsupported GGUF tokenizer model 'bert'",
    "gemma-4": "unsupported GGUF tokenizer model 'gemma4'",
    "falcon": "unsupported GGUF pre-tokenizer 'falcon'",
    "deepseek-llm": "unsupported GGUF pre-tokenizer 'deepseek-llm'",
    "deepseek-coder": "unsupported GGUF pre-tokenizer 'deepseek-coder'",
    "qwen35": "unsupported GGUF pre-tokenizer 'qwen35'",
}


def vocab_file(name: str) -> Path:
    if not VOCAB_DIR.is_dir():
        pytest.fail(f"llama.cpp's vocabulary test files are missing ({VOCAB_DIR}): run `make setup`")
    return VOCAB_DIR / f"ggml-vocab-{name}.gguf"


def read_cases(path: Path) -> list[tuple[str, list[int]]]:
    """(text, ids) pairs as test-tokenizer-0.cpp reads them: the texts split at the marker (a trailing marker
    ends the last text), one line of space-separated ids per text."""
    raw = Path(f"{path}.inp").read_bytes().decode("utf-8")
    texts = raw.split(SEPARATOR)
    if raw.endswith(SEPARATOR):
        texts.pop()
    lines = Path(f"{path}.out").read_bytes().decode("utf-8").split("\n")
    if lines[-1] == "":
        lines.pop()
    assert len(texts) == len(lines) > 30, path
    return [(text, [int(i) for i in line.split()]) for text, line in zip(texts, lines)]


def tokenizer_of(path: Path):
    return loader.gguf_tokenizer(GGUFFile(path))


def test_the_table_covers_every_vocabulary_with_cases():
    vocab_file("llama-spm")
    names = {p.name[len("ggml-vocab-"):-len(".gguf.inp")] for p in VOCAB_DIR.glob("ggml-vocab-*.gguf.inp")}
    assert names == set(PASSES) | set(REFUSED)


@pytest.mark.parametrize("name", SPM)
def test_sentencepiece_vocabulary_gives_llama_cpps_ids_and_decodes_back(name):
    path = vocab_file(name)
    tok = tokenizer_of(path)
    cases = read_cases(path)
    special = [t for t, kind in zip(tok.vocab.tokens, tok.vocab.types) if kind in (2, 3, 4)]
    # encode matches special tokens' text (parse_special); the harness does not, which is the same on these texts.
    assert not any(s in text for s in special for text, _ in cases)
    wrong = [(text, ids, tok.encode(text, add_special=False)) for text, ids in cases
             if tok.encode(text, add_special=False) != ids]
    assert not wrong
    assert [tok.decode(ids) for _, ids in cases] == [text for text, _ in cases]


@pytest.mark.parametrize("name", [n for n in PASSES if n not in SPM])
def test_bpe_vocabulary_gives_llama_cpps_ids(name):
    path = vocab_file(name)
    tok = tokenizer_of(path)
    wrong = [(text, ids) for text, ids in read_cases(path) if tok.encode(text, add_special=False) != ids]
    assert not wrong


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_vocabulary_pjinfer_cannot_run_exactly_is_refused_in_one_line(name):
    with pytest.raises(ConfigError) as e:
        tokenizer_of(vocab_file(name))
    assert str(e.value).startswith(REFUSED[name]) and "\n" not in str(e.value)


def test_sentencepiece_special_ids_spaces_and_byte_fallback():
    tok = tokenizer_of(vocab_file("llama-spm"))
    bos, eos = tok.token_id("<s>"), tok.token_id("</s>")
    assert (bos, eos) == (1, 2) and tok.eos_ids == (2,) and tok.vocab_size == 32000
    hello = tok.encode("Hello", add_special=False)
    assert tok.encode("Hello") == [bos] + hello                 # Llama adds a BOS by default
    # control tokens written in the text are single ids, and the text after one gets its own leading space
    assert tok.encode("<s>Hello</s>", add_special=False) == [bos] + hello + [eos]
    assert tok.decode([bos] + hello + [eos]) == " Hello"        # as llama.cpp: the space stays after a BOS
    assert tok.decode([bos] + hello + [eos], skip_special=False) == "<s> Hello</s>"
    ids = tok.encode("🦙", add_special=False)                   # no token: its four UTF-8 bytes
    assert [tok.vocab.tokens[i] for i in ids] == ["▁", "<0xF0>", "<0x9F>", "<0xA6>", "<0x99>"]


def test_stream_decoder_pieces_add_up_to_the_sentencepiece_decode():
    path = vocab_file("llama-spm")
    tok = tokenizer_of(path)
    text = "".join(text for text, _ in read_cases(path))  # Khmer, emoji joiners, CJK, runs of spaces and newlines
    ids = tok.encode(text, add_special=False)
    decoder = StreamDecoder(tok)
    pieces = [decoder.push(i) for i in ids]
    assert "".join(pieces) + decoder.flush() == tok.decode(ids) == text
    assert all("\ufffd" not in p for p in pieces)
    # a continuation's first "▁" is the text's first space, dropped as the whole decode drops it
    paris = tok.encode(" Paris.", add_special=False)[1:]
    assert StreamDecoder(tok).push(paris[0]) == "Paris" == tok.decode(paris[:1])


def test_fallback_chat_template_is_llama_cpps_chatml_after_the_bos():
    tok = tokenizer_of(vocab_file("llama-spm"))     # the file stores no chat template
    text = tok.apply_chat([{"role": "user", "content": "Hi"}])
    assert text == "<s><|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.encode(text, add_special=False)[0] == tok.token_id("<s>")
    phi3 = tokenizer_of(vocab_file("phi-3"))        # a file with its own template keeps it
    assert phi3.apply_chat([{"role": "user", "content": "Hi"}]).endswith("<|user|>\nHi<|end|>\n<|assistant|>\n")


# ---------------------------------------------------------------- a tiny Llama GGUF with a SentencePiece vocabulary
def spm_vocab_writer(*, scores=True):
    """A write_tiny_gguf vocab: llama-spm's tokens, scores and types as a Llama-2 GGUF stores them, no template."""
    fields = GGUFFile(vocab_file("llama-spm")).fields

    def write(w):
        w.add_tokenizer_model("llama")
        w.add_token_list(fields["tokenizer.ggml.tokens"])
        if scores:
            w.add_token_scores([float(s) for s in fields["tokenizer.ggml.scores"]])
        w.add_token_types([int(t) for t in fields["tokenizer.ggml.token_type"]])
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_unk_token_id(0)
        return len(fields["tokenizer.ggml.tokens"])
    return write


def bpe_vocab_writer(model="gpt2", pre="smollm"):
    from tests.support.gguf_files import write_bpe_vocab

    return lambda w: write_bpe_vocab(w, model=model, pre=pre)


def tiny_gguf(path, vocab, embed_rows=None):
    from tests.conftest import random_weights, tiny_config
    from tests.support.gguf_files import write_tiny_gguf

    config = tiny_config(tie_embeddings=True)
    write_tiny_gguf(path, config, random_weights(config, seed=2), vocab=vocab, embed_rows=embed_rows)
    return path


def test_tiny_llama_with_a_sentencepiece_vocabulary_generates(tmp_path, capsys):
    import json

    from tests.support.cli import run_cli

    model = tiny_gguf(tmp_path / "spm.gguf", spm_vocab_writer())
    code, out, err = run_cli(capsys, "generate", "--model", str(model), "--prompt", "Hello world",
                             "--max-new-tokens", "8", "--json")
    assert code == 0, err
    result = json.loads(out)
    tok = tokenizer_of(model)
    assert len(result["token_ids"]) == 8 and result["text"] == tok.decode(result["token_ids"]) and result["text"]
    code, out, err = run_cli(capsys, "generate", "--model", str(model), "--prompt", "Hello world",
                             "--max-new-tokens", "8")
    assert code == 0 and out.strip(), err


def test_tiny_llama_chats_through_the_fallback_template(tmp_path, capsys, monkeypatch):
    import io
    import sys

    from tests.support.cli import run_cli

    model = tiny_gguf(tmp_path / "spm.gguf", spm_vocab_writer())
    monkeypatch.setattr(sys, "stdin", io.StringIO("Hi there\n"))
    code, out, err = run_cli(capsys, "chat", "--model", str(model), "--max-new-tokens", "4")
    assert code == 0, err
    reply = out.split("> ", 1)[1]
    assert reply.strip() and "Traceback" not in err


@pytest.mark.parametrize("vocab,embed_rows,fragment", [
    (lambda: spm_vocab_writer(scores=False), None, "SentencePiece vocabulary has no tokenizer.ggml.scores"),
    (lambda: spm_vocab_writer(), 32001, "has 32000 tokens in its vocabulary but 32001 rows in token_embd.weight"),
    (lambda: bpe_vocab_writer(), 300, "tokens in its vocabulary but 300 rows in token_embd.weight"),
    (lambda: bpe_vocab_writer(pre="falcon"), None, "unsupported GGUF pre-tokenizer 'falcon'"),
    (lambda: bpe_vocab_writer(model="bert"), None, "unsupported GGUF tokenizer model 'bert'"),
])
def test_bad_vocabulary_is_refused_in_one_line(tmp_path, capsys, vocab, embed_rows, fragment):
    from tests.support.cli import assert_clean_error, run_cli

    model = tiny_gguf(tmp_path / "bad.gguf", vocab(), embed_rows)
    assert_clean_error(run_cli(capsys, "generate", "--model", str(model), "--prompt", "x"), fragment)


def test_sentencepiece_without_byte_tokens_writes_the_unknown_token():
    from pjinfer.load.tokenizer import Tokenizer

    tokens = ["<unk>", "<s>", "</s>", "▁", "a", "b", "▁a", "ab", "▁ab"]
    tok = Tokenizer.from_gguf_fields(tokens=tokens, scores=[0, 0, 0, -1, -2, -2, -3, -4, -1], merges=None,
                                     token_types=[2, 3, 3, 1, 1, 1, 1, 1, 1], model="llama", pre=None,
                                     chat_template=None, eos_ids=(2,), bos_id=1, add_bos=None, unk_id=0)
    # "▁a" is the better pair (over "ab"), then "▁ab"; "c" is no token and has no byte token: <unk>
    assert tok.encode("ab c") == [1, 8, 3, 0]
    assert tok.decode([1, 8, 3, 0]) == " ab " and tok.decode([8, 3, 0], skip_special=False) == "ab <unk>"
