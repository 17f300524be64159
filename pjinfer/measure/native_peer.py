"""The native peers of `pjinfer bench --peer llama-bench|powerinfer`: llama.cpp's own `llama-bench` and PowerInfer's
runtime (`main` of its llama.cpp fork), each built once by `make peers` into out/peers and run here as a subprocess
on the same GGUF, prompt length, new-token count and thread count as pjinfer. Each run reports the peer's own
decode timing (parsed from its output); bench alternates those runs with pjinfer's.

The build folder is out/peers under the repository root, or PJINFER_PEERS_DIR. PowerInfer refuses a file whose
output head is tied to the embedding (no `output.weight`): it runs on an untied copy written once next to the builds
(untied_copy)."""
from __future__ import annotations

import csv
import io
import os
import re
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import gguf

from pjinfer.config import ConfigError
from pjinfer.load.gguf_file import GGUFFile

NATIVE_PEERS = ("llama-bench", "powerinfer")

# Each peer's binary under the peers folder, and the file the Makefile writes next to its build naming its source.
BINARIES = {"llama-bench": "llama.cpp/build/bin/llama-bench", "powerinfer": "PowerInfer/build/bin/main"}


def peers_dir() -> Path:
    """Where `make peers` builds: PJINFER_PEERS_DIR, else out/peers in the repository this package sits in."""
    if os.environ.get("PJINFER_PEERS_DIR"):
        return Path(os.environ["PJINFER_PEERS_DIR"])
    return Path(__file__).resolve().parents[2] / "out" / "peers"


def binary(peer: str) -> Path:
    return peers_dir() / BINARIES[peer]


def check_native(peer: str, model_path) -> None:
    """Refuse early (before any model loads) a peer that is not built, or a model it cannot run."""
    if peer not in NATIVE_PEERS:
        raise ConfigError(f"--peer must be one of {', '.join(NATIVE_PEERS)}, got {peer!r}")
    path = binary(peer)
    if not (path.is_file() and os.access(path, os.X_OK)):
        name = "llama-bench" if peer == "llama-bench" else "PowerInfer's main"
        raise ConfigError(f"{name} is not built: run `make peers` (looked for {path})")
    if not str(model_path).endswith(".gguf"):
        raise ConfigError(f"--peer {peer} needs a GGUF model, got {model_path}")


def build_source(peer: str) -> str:
    """What the peer was built from, as the Makefile recorded it (SOURCE next to its build), or 'unknown source'."""
    stamp = binary(peer).parents[2] / "SOURCE"
    return stamp.read_text().strip() if stamp.is_file() else "unknown source"


# --- output parsers ---------------------------------------------------------------------------------------------

def parse_llama_bench_csv(text: str) -> dict:
    """llama-bench's `-o csv` output (one header line, one row per test) -> the token-generation row's figures:
    decode_tok_s (its avg_ts), n_gen, n_depth, n_threads and its build (build_commit, build_number)."""
    rows = [r for r in csv.DictReader(io.StringIO(text)) if r.get("n_gen") not in (None, "", "0")]
    if len(rows) != 1:
        raise ConfigError(f"llama-bench printed {len(rows)} token-generation rows in its csv, expected 1")
    r = rows[0]
    try:
        return {"decode_tok_s": float(r["avg_ts"]), "n_gen": int(r["n_gen"]), "n_depth": int(r.get("n_depth") or 0),
                "n_threads": int(r["n_threads"]), "build": f"{r['build_commit']} ({r['build_number']})",
                "cpu": r.get("cpu_info", "")}
    except (KeyError, ValueError) as e:
        raise ConfigError(f"llama-bench's csv lacks a field or a number ({e})") from None


_TIMING = r"llama_print_timings:\s+{what} time =\s*([\d.]+) ms /\s*(\d+) {unit}"


_LOAD_TIME = r"llama_print_timings:\s+load time =\s*([\d.]+) ms"
# What llama_model_load prints when the file is PowerInfer's (magic PWRI): its sparse operators run.
POWERINFER_SPARSE_LINE = "PowerInfer model loaded. Sparse inference will be used."


def parse_powerinfer_timings(stderr: str) -> dict:
    """PowerInfer main's timings on stderr -> decode_tok_s and eval_runs (its `eval time = T ms / K runs`),
    prompt_tokens, prefill_s (its `prompt eval time = T ms / P tokens`), load_s (its `load time`, which it takes
    again after the first evaluation so that the mapped file's page faults count; None if absent) and sparse
    (whether it said it runs the file sparse). It prints no density: which neurons its predictors chose is not
    in its output."""
    decode = re.search(_TIMING.format(what="eval", unit="runs"), stderr)
    prompt = re.search(_TIMING.format(what="prompt eval", unit="tokens"), stderr)
    if not decode or not prompt:
        raise ConfigError(f"PowerInfer's main printed no eval timings (its last line: {_last_line(stderr)!r})")
    ms, runs = float(decode.group(1)), int(decode.group(2))
    if runs < 1 or ms <= 0:
        raise ConfigError(f"PowerInfer's main timed {runs} decode runs in {ms} ms")
    load = re.search(_LOAD_TIME, stderr)
    return {"decode_tok_s": 1000 * runs / ms, "eval_runs": runs,
            "prompt_tokens": int(prompt.group(2)), "prefill_s": float(prompt.group(1)) / 1000,
            "load_s": float(load.group(1)) / 1000 if load else None, "sparse": POWERINFER_SPARSE_LINE in stderr}


def _last_line(text: str) -> str:
    lines = text.strip().splitlines()
    return lines[-1] if lines else ""


# --- the untied copy PowerInfer runs on ----------------------------------------------------------------------------

def untied_copy(src, folder=None) -> Path:
    """A copy of the GGUF src with its embedding also written as `output.weight` (every other field and tensor as it
    is), for PowerInfer, which needs an explicit output head. Written once into folder (default: peers_dir()/untied),
    named by src's size and modification time, so a changed source gets a new copy; src itself if it has the head."""
    src = Path(src)
    names = {t.name for t in GGUFFile(src).tensors}   # pjinfer's reader: it reads PowerInfer's magic too
    if "output.weight" in names:
        return src
    if "token_embd.weight" not in names:
        raise ConfigError(f"{src} has neither output.weight nor token_embd.weight")
    stat = src.stat()
    folder = Path(folder) if folder is not None else peers_dir() / "untied"
    dst = folder / f"{src.stem}.{stat.st_size}-{stat.st_mtime_ns}.untied.gguf"
    if dst.is_file():
        return dst
    folder.mkdir(parents=True, exist_ok=True)
    part = dst.with_suffix(".part")
    _write_untied(gguf.GGUFReader(str(src)), part)
    part.replace(dst)
    return dst


def _write_untied(reader, path: Path) -> None:
    """Write reader's fields and tensors to path, plus token_embd.weight's data again as output.weight."""
    arch = reader.fields["general.architecture"].contents()
    w = gguf.GGUFWriter(str(path), arch)
    for key, f in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":  # the writer writes these itself
            continue
        sub_type = f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(key, f.contents(), f.types[0], sub_type=sub_type)
    for t in reader.tensors:
        w.add_tensor(t.name, t.data, raw_shape=t.data.shape, raw_dtype=t.tensor_type)
    embedding = next(t for t in reader.tensors if t.name == "token_embd.weight")
    w.add_tensor("output.weight", embedding.data, raw_shape=embedding.data.shape, raw_dtype=embedding.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


# --- the runs ------------------------------------------------------------------------------------------------------

@dataclass
class NativePeer:
    """One native peer set up for a bench: `measure()` runs it once and returns its decode_tok_s (and prefill_s where
    it times its prompt). info: what ran (binary, build, model file) for the output."""
    name: str
    command: list[str]
    parse: Callable[[subprocess.CompletedProcess], dict]
    info: dict = field(default_factory=dict)
    timeout_s: float = 600.0

    def measure(self) -> dict:
        try:
            done = subprocess.run(self.command, capture_output=True, text=True, timeout=self.timeout_s,
                                  stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            raise ConfigError(f"{self.name} ran past {self.timeout_s:.0f} s") from None
        if done.returncode != 0:
            raise ConfigError(f"{self.name} exited with {done.returncode} ({_last_line(done.stderr)!r})")
        return self.parse(done)


def llama_bench(model_path, *, prompt_len: int, new_tokens: int, threads: int) -> NativePeer:
    """llama-bench timing new_tokens generated after a context of prompt_len tokens (-d: the depth, filled
    untimed), one repetition per run so its runs interleave with pjinfer's. The depth is filled a token a batch
    (-ub 1), as the timed tokens run: on a CPU with AMX, llama.cpp's batched products take its AMX tiles, which a
    VM may not grant (llama-bench then dies of SIGILL or SIGSEGV), while its one-token products (VNNI, on the
    same repacked weights) run."""
    check_native("llama-bench", model_path)
    command = [str(binary("llama-bench")), "-m", str(model_path), "-p", "0", "-n", str(new_tokens),
               "-d", str(prompt_len), "-ub", "1", "-t", str(threads), "-r", "1", "-o", "csv"]

    def parse(done):
        got = parse_llama_bench_csv(done.stdout)
        if (got["n_gen"], got["n_depth"], got["n_threads"]) != (new_tokens, prompt_len, threads):
            raise ConfigError(f"llama-bench ran n_gen {got['n_gen']}, depth {got['n_depth']}, "
                              f"{got['n_threads']} threads; asked {new_tokens}, {prompt_len}, {threads}")
        known = "" if got["build"].startswith("unknown") else f", build {got['build']}"   # no git in an sdist
        peer.info.setdefault("build", build_source("llama-bench") + known)
        return {"decode_tok_s": got["decode_tok_s"], "prefill_s": None}

    peer = NativePeer("llama-bench", command, parse,
                      {"binary": command[0], "model": str(model_path), "prompt_tokens": prompt_len})
    return peer


def powerinfer(model_path, *, prompt_text: str, prompt_len: int, new_tokens: int, threads: int) -> NativePeer:
    """PowerInfer's main generating new_tokens greedily (end-of-text ignored, no repetition penalty) after prompt_text,
    on the untied copy of the model. Its prompt token count (from its timings) is recorded: its tokenizer may
    split the text differently."""
    check_native("powerinfer", model_path)
    model = untied_copy(model_path)
    command = [str(binary("powerinfer")), "-m", str(model), "-n", str(new_tokens), "-t", str(threads),
               "-c", str(prompt_len + new_tokens + 16), "-b", str(max(512, prompt_len)),
               "-p", prompt_text, "--temp", "0", "--repeat-penalty", "1.0", "--ignore-eos",
               "--log-disable"]   # else it writes main.log into the current folder; its timings still go to stderr

    def parse(done):
        got = parse_powerinfer_timings(done.stderr)
        peer.info["prompt_tokens"] = got["prompt_tokens"]
        peer.info["sparse"] = got["sparse"]
        return {"decode_tok_s": got["decode_tok_s"], "prefill_s": got["prefill_s"]}

    peer = NativePeer("powerinfer", command, parse,
                      {"binary": command[0], "build": build_source("powerinfer"), "model": str(model),
                       "untied_copy": model != Path(model_path)})
    return peer
