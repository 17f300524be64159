"""Zero/few-shot benchmark accuracy with lm-evaluation-harness's log-likelihood protocol.

Multiple choice: each (context, continuation) pair is scored by the summed log-probability of the
continuation's tokens given the context. As the harness's `_encode_pair`: trailing white space of the
context moves to the front of the continuation; the whole string is tokenized and the continuation's
tokens are those past the context's own tokenization. acc takes the choice with the highest sum;
acc_norm divides each sum by the continuation's length in UTF-8 bytes first. stderr is the standard
error of the mean, sqrt(acc (1 - acc) / (n - 1)).

LAMBADA: acc is greedy exactness (every target token is the argmax given the tokens before it);
perplexity is exp(-mean over passages of the target word's summed log-probability), as the harness.

Scoring runs batched: sequences sorted by length, right-padded to a power-of-two length (at least 32,
at most the model's context) with as many rows as a token budget allows, so each padded length
compiles once. A sequence longer than the context keeps its last max_seq_len tokens (the context is
cut from the left, the continuation kept whole). One-token continuations that share a context
(MMLU's " A".." D", BoolQ's " no"/" yes") take one forward pass per context: the next-token
distribution after the context scores them all (the same numbers, a quarter of MMLU's work).
"""
from __future__ import annotations

import math
import time
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import numpy as np

from pjinfer.config import ConfigError
from pjinfer.load.loader import model_identity
from pjinfer.measure.tasks import GENERATIVE, TASKS, Request, load_task
from pjinfer.progress import Progress
from pjinfer.runtime.generate import bucket

MIN_LEN_BUCKET = 32
BATCH_ROWS = 16            # at most this many sequences per call
TOKEN_BUDGET = 2048        # rows * padded length per call (bounds the [B, T, vocab] logits in memory)


# ------------------------------------------------------------------ encoding

def encode_pair(tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """(context ids, continuation ids) the harness's way: trailing white space moves to the continuation."""
    n = len(context) - len(context.rstrip())
    if n:
        context, continuation = context[:-n], context[-n:] + continuation
    whole = tokenizer.encode(context + continuation, add_special=False)
    ctx = tokenizer.encode(context, add_special=False) if context else []
    if not ctx:   # an empty context: condition on the end-of-text token, as the harness's prefix token
        eot = (tokenizer.eos_ids or (0,))[0]
        return [eot], tokenizer.encode(continuation, add_special=False)
    return ctx, whole[len(ctx):]


def _rows_for(padded_len: int, batch_rows: int, token_budget: int) -> int:
    rows = max(1, min(batch_rows, token_budget // padded_len))
    return 1 << (rows.bit_length() - 1)      # a power of two: a fixed row count per padded length


def engine_scorer(engine, *, greedy: bool = False):
    """tokens [B, T], lengths [B] (each row's real tokens; 0: a padding row) -> (logp [B, T-1], is_greedy
    [B, T-1] or None)."""
    if not greedy:
        return lambda tokens, lengths: (engine.token_logprobs(tokens, lengths=lengths), None)
    return lambda tokens, lengths: engine.token_logprobs(tokens, with_greedy=True, lengths=lengths)


def score_sequences(scorer, seqs: list[tuple[list[int], list[int]]], *, max_len: int,
                    batch_rows: int = BATCH_ROWS, token_budget: int = TOKEN_BUDGET,
                    progress=None, last_scorer=None) -> list[tuple[float, bool]]:
    """For each (context ids, continuation ids): (summed log-prob of the continuation, all greedy).

    `scorer(tokens [B, T] int32, lengths [B]) -> (logp [B, T-1], is_greedy [B, T-1] or None)`, lengths each
    row's real tokens (0: a padding row, whose figures are not read).
    `last_scorer(tokens [B, T], lengths [B]) -> next-token logp [B, V]`, when given, scores at once the
    one-token continuations that share a context (MMLU's " A".." D"): one forward pass per context.
    """
    full = []
    for ctx, cont in seqs:
        if not cont:
            raise ConfigError("a continuation encodes to no tokens")
        if len(cont) >= max_len:
            raise ConfigError(f"a continuation of {len(cont)} tokens does not fit the context of {max_len}")
        full.append((ctx + cont)[-max_len:])     # left-truncate: the context loses its oldest tokens
    out: list[tuple[float, bool]] = [(0.0, True)] * len(seqs)
    if progress:
        progress(0, len(seqs))
    rest = list(range(len(seqs)))
    done = 0
    if last_scorer is not None:
        groups: dict[tuple, list[int]] = {}
        for i in rest:
            if len(seqs[i][1]) == 1:
                groups.setdefault(tuple(full[i][:-1]), []).append(i)
        groups = {k: v for k, v in groups.items() if len(v) > 1}
        grouped = {i for v in groups.values() for i in v}
        rest = [i for i in rest if i not in grouped]
        prefixes = sorted(groups, key=len, reverse=True)
        start = 0
        while start < len(prefixes):
            padded = min(bucket(len(prefixes[start]), MIN_LEN_BUCKET), max_len)
            rows = _rows_for(padded, batch_rows, token_budget)
            batch = prefixes[start:start + rows]
            tokens = np.zeros((rows, padded), np.int32)
            lengths = np.ones((rows,), np.int32)
            for r, prefix in enumerate(batch):
                tokens[r, :len(prefix)], lengths[r] = prefix, len(prefix)
            logp = last_scorer(tokens, lengths)
            for r, prefix in enumerate(batch):
                best = int(np.argmax(logp[r]))
                for i in groups[prefix]:
                    token = full[i][-1]
                    out[i] = (float(logp[r, token]), best == token)
                done += len(groups[prefix])
            start += len(batch)
            if progress:
                progress(done, len(seqs))
    order = sorted(rest, key=lambda i: -len(full[i]))
    done, base = 0, done
    while done < len(order):
        padded = min(bucket(len(full[order[done]]), MIN_LEN_BUCKET), max_len)
        rows = _rows_for(padded, batch_rows, token_budget)
        idx = order[done:done + rows]
        tokens, lengths = np.zeros((rows, padded), np.int32), np.zeros(rows, np.int32)
        for r, i in enumerate(idx):
            tokens[r, :len(full[i])], lengths[r] = full[i], len(full[i])
        logp, greedy = scorer(tokens, lengths)
        for r, i in enumerate(idx):
            end, n = len(full[i]) - 1, len(seqs[i][1])      # logp[t-1] scores token t
            out[i] = (float(np.sum(logp[r, end - n:end], dtype=np.float64)),
                      True if greedy is None else bool(np.all(greedy[r, end - n:end])))
        done += len(idx)
        if progress:
            progress(base + done, len(seqs))
    return out


# ------------------------------------------------------------------ metrics

def _stderr(acc: float, n: int) -> float:
    return math.sqrt(acc * (1 - acc) / (n - 1)) if n > 1 else 0.0


def multiple_choice_metrics(requests: list[Request], loglikelihoods: list[float]) -> dict:
    """loglikelihoods: one per (request, continuation) pair, in order."""
    k = correct = correct_norm = 0
    for req in requests:
        lls = np.array(loglikelihoods[k:k + len(req.continuations)])
        k += len(req.continuations)
        lens = np.array([max(1, len(c.encode("utf-8"))) for c in req.continuations])
        correct += int(np.argmax(lls)) == req.gold
        correct_norm += int(np.argmax(lls / lens)) == req.gold
    n = len(requests)
    acc, acc_norm = correct / n, correct_norm / n
    return {"acc": acc, "acc_norm": acc_norm, "n": n, "stderr": _stderr(acc, n),
            "stderr_norm": _stderr(acc_norm, n)}


def lambada_metrics(scores: list[tuple[float, bool]]) -> dict:
    n = len(scores)
    acc = sum(g for _, g in scores) / n
    mean_ll = sum(ll for ll, _ in scores) / n
    return {"acc": acc, "acc_norm": None, "n": n, "stderr": _stderr(acc, n), "perplexity": math.exp(-mean_ll)}


# ------------------------------------------------------------------ driver

def _model_name(engine) -> str:
    return getattr(engine.config, "name", "") or getattr(engine, "source", "") or "model"


def _model_identity(engine) -> str | None:
    source = getattr(engine, "source", "")
    return model_identity(Path(source)) if source and Path(source).exists() else None


def _version() -> str:
    try:
        return version("pjinfer")
    except PackageNotFoundError:
        return "unknown"


def check_results(results, name: str) -> dict:
    """`results` as `evaluate` writes it (a "tasks" table of per-task metric dicts), or a one-line ConfigError."""
    tasks = results.get("tasks") if isinstance(results, dict) else None
    if not isinstance(tasks, dict) or not all(isinstance(m, dict) and "acc" in m and "n" in m
                                              for m in tasks.values()):
        raise ConfigError(f"{name} is not a pjinfer eval results file (no 'tasks' table of acc and n per task)")
    return results


def count_mismatches(a: dict, b: dict) -> list[str]:
    """Tasks present in both results whose item counts differ: their accuracies are not like for like."""
    return [f"{t} has {a['tasks'][t]['n']} items in A and {b['tasks'][t]['n']} in B"
            for t in a["tasks"] if t in b["tasks"] and a["tasks"][t]["n"] != b["tasks"][t]["n"]]


def check_tasks(task_names) -> None:
    unknown = [t for t in task_names if t not in TASKS]
    if unknown:
        raise ConfigError(f"unknown task {unknown[0]!r} (known: {', '.join(TASKS)})")
    if not task_names:
        raise ConfigError(f"no task given (known: {', '.join(TASKS)})")


def evaluate(engine, task_names, *, limit: int | None = None, num_fewshot: int | None = None,
             progress_factory=None, batch_rows: int = BATCH_ROWS, token_budget: int = TOKEN_BUDGET) -> dict:
    """{"model", "model_identity", "weights", "bundle", "pjinfer_version", "limit", "num_fewshot",
    "tasks": {name: {"acc", "acc_norm", "n", "stderr", "seconds", ...}}}."""
    if isinstance(task_names, str):
        task_names = [task_names]
    check_tasks(task_names)
    if limit is not None and limit < 1:
        raise ConfigError(f"limit must be >= 1, got {limit}")
    progress_factory = progress_factory or (lambda label, total, unit: Progress(label, total, unit))
    bundle = getattr(engine, "bundle", None)
    results = {"model": _model_name(engine), "model_identity": _model_identity(engine),
               "weights": getattr(engine, "weights_format", None),
               "bundle": str(bundle.path) if bundle is not None else None, "pjinfer_version": _version(),
               "limit": limit, "num_fewshot": num_fewshot, "tasks": {}}
    max_len = engine.config.max_seq_len
    for name in task_names:
        start = time.perf_counter()
        requests = load_task(name, limit=limit, num_fewshot=num_fewshot)
        if not requests:
            raise ConfigError(f"{name}: no items")
        pairs = [encode_pair(engine.tokenizer, c, x) for req in requests for c, x in req.pairs()]
        generative = name in GENERATIVE
        scores = score_sequences(engine_scorer(engine, greedy=generative), pairs, max_len=max_len,
                                 batch_rows=batch_rows, token_budget=token_budget,
                                 progress=progress_factory(name, len(pairs), " seq"),
                                 last_scorer=engine.last_logprobs)
        if generative:
            metrics = lambada_metrics(scores)
        else:
            metrics = multiple_choice_metrics(requests, [ll for ll, _ in scores])
        metrics["seconds"] = time.perf_counter() - start
        results["tasks"][name] = metrics
    return results


# ------------------------------------------------------------------ tables

def _f(v, digits=4) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def _render(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]
    lines = ["  ".join(h.ljust(w) if i == 0 else h.rjust(w) for i, (h, w) in enumerate(zip(header, widths)))]
    lines.append("  ".join("-" * w for w in widths))
    for r in rows:
        lines.append("  ".join(v.ljust(w) if i == 0 else v.rjust(w) for i, (v, w) in enumerate(zip(r, widths))))
    return "\n".join(lines)


def format_table(results: dict) -> str:
    title = f"model: {results.get('model')}" + (f"  bundle: {results['bundle']}" if results.get("bundle") else "")
    rows = []
    for name, m in results["tasks"].items():
        rows.append([name, str(m["n"]), _f(m["acc"]), _f(m["stderr"]), _f(m.get("acc_norm")),
                     _f(m.get("perplexity"), 3), _f(m.get("seconds"), 1)])
    return title + "\n" + _render(["task", "n", "acc", "±stderr", "acc_norm", "perplexity", "seconds"], rows)


def compare_table(a: dict, b: dict) -> str:
    """Side by side: a's and b's acc and acc_norm per task and b - a."""
    def diff(x, y):
        return "-" if x is None or y is None else f"{y - x:+.4f}"
    names = list(a["tasks"]) + [t for t in b["tasks"] if t not in a["tasks"]]
    rows = []
    for name in names:
        ma, mb = a["tasks"].get(name, {}), b["tasks"].get(name, {})
        rows.append([name, str(ma.get("n", "-")), str(mb.get("n", "-")),
                     _f(ma.get("acc")), _f(mb.get("acc")), diff(ma.get("acc"), mb.get("acc")),
                     _f(ma.get("acc_norm")), _f(mb.get("acc_norm")), diff(ma.get("acc_norm"), mb.get("acc_norm"))])
    label = lambda r: f"{r.get('model')}" + (f" + {r['bundle']}" if r.get("bundle") else "")
    title = f"A: {label(a)}\nB: {label(b)}"
    return title + "\n" + _render(["task", "n A", "n B", "acc A", "acc B", "diff", "norm A", "norm B", "diff"], rows)
