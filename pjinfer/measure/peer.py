"""llama.cpp as the peer in `pjinfer bench --peer llama-cpp`: the same GGUF, prompt, token count and
threads, timed the way bench times pjinfer (a prefill alone, then the whole greedy generation).

llama-cpp-python is not a dependency: `make bench-peer` builds it (AVX2, see the Makefile)."""
from __future__ import annotations

import argparse
import ctypes
import sys
from pathlib import Path

import numpy as np

from pjinfer.config import ConfigError
from pjinfer.load import loader


def check_llama_cpp(model_path) -> None:
    """Refuse early (before any model loads) what the peer cannot run."""
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        raise ConfigError("llama-cpp-python is not installed: run `make bench-peer`") from None
    if not str(model_path).endswith(".gguf"):
        raise ConfigError(f"--peer llama-cpp needs a GGUF model, got {model_path}")


def llama_cpp_runner(model_path, prompt: list[int], new_tokens: int, threads: int):
    """(prefill, whole(n=new_tokens)) callables, as bench._runner's, driving llama.cpp through llama-cpp-python's
    low-level calls: greedy argmax of llama.cpp's own logits, end-of-text ignored (every token runs)."""
    check_llama_cpp(model_path)
    from llama_cpp import Llama

    llm = Llama(model_path=str(model_path), n_ctx=max(512, len(prompt) + new_tokens + 2), n_batch=512,
                n_threads=threads, n_threads_batch=threads, logits_all=False, verbose=False)
    n_vocab = llm.n_vocab()

    def next_token() -> int:
        logits = np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(n_vocab,))
        return int(np.argmax(logits))

    def prefill():
        llm.reset()
        llm.eval(prompt)
        return next_token()

    def whole(n=new_tokens):
        token = prefill()
        out = [token]
        for _ in range(n - 1):
            llm.eval([token])
            token = next_token()
            out.append(token)
        return out

    return prefill, whole


# llama.cpp file types `quantize` writes (llama_ftype names without the LLAMA_FTYPE_MOSTLY_ prefix).
QUANTIZE_TYPES = ("Q4_K_M", "Q8_0", "Q4_0", "Q5_K_M", "Q6_K")


def quantize(src, dst, ftype: str, threads: int = 2) -> None:
    """Write the GGUF `src` re-quantized by llama.cpp itself (llama_model_quantize, its default parameters, its own
    per-tensor type choices) to `dst` as `ftype` (QUANTIZE_TYPES). allow_requantize is set: the default model
    ships as Q4_1 only, so llama.cpp dequantizes those blocks and quantizes again."""
    if ftype not in QUANTIZE_TYPES:
        raise ConfigError(f"file type must be one of {', '.join(QUANTIZE_TYPES)}, got {ftype!r}")
    check_llama_cpp(src)
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype}")
    params.allow_requantize = True
    params.nthread = threads
    from llama_cpp._utils import suppress_stdout_stderr

    with suppress_stdout_stderr(disable=False):  # llama.cpp logs every tensor it writes
        rc = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params))
    if rc != 0:
        raise ConfigError(f"llama.cpp could not quantize {src} to {ftype}")


def main(argv=None) -> int:
    """`python -m pjinfer.measure.peer --types Q4_K_M,Q8_0 --dir out/quants [--model GGUF]`: the model (default: the
    embedded one) re-quantized by llama.cpp, one file per type, DIR/<stem without its type>.<TYPE>.gguf."""
    p = argparse.ArgumentParser(prog="python -m pjinfer.measure.peer", description=main.__doc__)
    p.add_argument("--types", default="Q4_K_M,Q8_0")
    p.add_argument("--dir", default="out/quants")
    p.add_argument("--model", default=None)
    args = p.parse_args(argv)
    try:
        src = Path(args.model) if args.model else loader.default_model_path()
        if not src.is_file():
            raise ConfigError(f"model not found: {src}")
        out = Path(args.dir)
        out.mkdir(parents=True, exist_ok=True)
        stem = src.name.removesuffix(".gguf").rsplit(".", 1)[0]
        for ftype in args.types.split(","):
            dst = out / f"{stem}.{ftype}.gguf"
            quantize(src, dst, ftype)
            print(dst)
    except (ConfigError, OSError) as e:
        print(f"pjinfer: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
