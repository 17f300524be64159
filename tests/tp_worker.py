"""One process of a tensor-parallel run, for tests/test_tensor_parallel.py (a real run: N such processes join over
local sockets through jax.distributed and gloo).

    python tests/tp_worker.py COORDINATOR N I TOKENS [--model PATH --weights gguf] PROMPT [PROMPT ...]

Process I of N loads the model (default: the default model, --weights q4_1) split N ways, generates TOKENS greedy
tokens for each prompt, takes the logits of the first prompt's first token at position 0 and scores the first prompt
with its first 24 new tokens, and takes the log-probabilities after the first prompt (a padded row of 32 tokens
beside a padding row). Process 0 prints one JSON line: {"ids": [[...] per prompt], "logits": [...], "logp": [...],
"last": [[...], [...]]}. N 0: one process, the host decode unsplit (the reference)."""
import argparse
import json

import jax
import numpy as np

from pjinfer.runtime.engine import Engine
from pjinfer.runtime.model import KVCache
from pjinfer.runtime.tensor_parallel import Processes


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("coordinator")
    p.add_argument("n", type=int)
    p.add_argument("i", type=int)
    p.add_argument("tokens", type=int)
    p.add_argument("prompts", nargs="+")
    p.add_argument("--model")
    p.add_argument("--weights", default="q4_1")
    args = p.parse_args()
    n, i, tokens, prompts = args.n, args.i, args.tokens, args.prompts
    if n:
        Processes(args.coordinator, n, i).start()
    engine = Engine.load(args.model, weights=args.weights, parallel=n > 0)
    ids = [engine.tokenizer.encode(p) for p in prompts]
    out = [engine.generate(p, max_new_tokens=tokens, stop_ids=[]) for p in ids]
    graph, state = engine.model_args

    @jax.jit
    def first_logits(state, token):
        model = graph.merge(state)
        return model.decode(token, 0, KVCache.create(model.config, 1, 256))[0]

    logits = np.asarray(first_logits(state, np.int32(ids[0][0])))
    logp = engine.token_logprobs(np.array([ids[0] + out[0][:24]]))   # scoring: decode steps when split
    rows = np.zeros((2, 32), np.int32)
    rows[0, :len(ids[0])] = ids[0]
    last = engine.last_logprobs(rows, [len(ids[0]), 0])
    if i == 0:
        print(json.dumps({"ids": out, "logits": logits.tolist(), "logp": logp[0].tolist(), "last": last.tolist()}),
              flush=True)


if __name__ == "__main__":
    main()
