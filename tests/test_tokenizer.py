"""The default model's tokenizer, built from its GGUF metadata."""
from pjinfer.load.tokenizer import StreamDecoder


def test_digits_split_one_by_one_and_no_bos(engine):
    tok = engine.tokenizer
    ids = tok.encode("In 2024")
    assert [tok.decode([i]) for i in ids] == ["In", " ", "2", "0", "2", "4"]
    assert ids[0] != engine.config.bos_id


def test_round_trip_of_mixed_text(engine):
    text = "Grüße, 世界! def f(x):\n    return x ** 2  # 🙂\n\n\tend"
    assert engine.tokenizer.decode(engine.tokenizer.encode(text)) == text


def test_special_tokens_are_single_ids(engine):
    tok = engine.tokenizer
    assert tok.encode("<|im_start|>user") == [tok.token_id("<|im_start|>"), tok.token_id("user")]
    assert tok.token_id("<|im_end|>") in tok.eos_ids


def test_chat_template_renders_the_models_format(engine):
    text = engine.tokenizer.apply_chat([{"role": "user", "content": "Hi"}])
    assert text.startswith("<|im_start|>system\n")
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


def test_stream_decoder_never_splits_a_character(engine):
    tok = engine.tokenizer
    text = "naïve 🙂 emoji 世界"
    ids = tok.encode(text)
    decoder = StreamDecoder(tok)
    pieces = [decoder.push(i) for i in ids]
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)


def test_stream_decoder_cuts_at_the_first_stop_string_and_never_shows_its_head(engine):
    tok = engine.tokenizer
    ids = tok.encode("alpha beta. gamma END delta END")
    decoder = StreamDecoder(tok, stops=["END", "a. g"])
    shown = "".join(decoder.push(i) for i in ids)
    assert decoder.stop == "a. g" and decoder.text == "alpha bet" and shown + decoder.flush() == "alpha bet"
    assert decoder.push(ids[0]) == ""              # nothing after a stop


def test_stream_decoder_flushes_the_held_back_tail(engine):
    tok = engine.tokenizer
    decoder = StreamDecoder(tok, stops=["\n\nUser:"])
    shown = "".join(decoder.push(i) for i in tok.encode("Sure.\n\nUse"))
    assert decoder.stop is None and shown == "Sure" and shown + decoder.flush() == "Sure.\n\nUse"


def test_stream_decoder_decodes_a_short_window_and_its_pieces_add_up_to_the_whole_decode(engine):
    from pjinfer.load import data

    tok = engine.tokenizer
    wiki = data.wiki_eval_text()
    text = wiki[:4000] + " naïve 🙂 emoji 世界 Grüße " + wiki[4000:6000]
    ids = tok.encode(text)
    lengths = []

    class Counted:
        """The real tokenizer, recording how many ids each decode reads."""
        def decode(self, some, **kwargs):
            lengths.append(len(some))
            return tok.decode(some, **kwargs)

    decoder = StreamDecoder(Counted())
    shown = ""
    for n, i in enumerate(ids, 1):
        shown += decoder.push(i)
        if n % 50 == 0 or n > len(ids) - 20:
            assert tok.decode(ids[:n]).startswith(shown) and "\ufffd" not in shown
    assert len(ids) > 1000 and shown + decoder.flush() == tok.decode(ids) == decoder.text
    assert max(lengths) <= 8    # a window of the newest ids, whatever the length so far
