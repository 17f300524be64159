"""llama.cpp as the peer in `pjinfer bench --peer llama-cpp`: the same GGUF, prompt, token count and
threads, timed the way bench times pjinfer (a prefill alone, then the whole greedy generation).

llama-cpp-python is not a dependency: `make bench-peer` builds it (AVX2, see the Makefile)."""
from __future__ import annotations

import numpy as np

from pjinfer.config import ConfigError


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
