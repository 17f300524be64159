"""The object users hold: a loaded model, its tokenizer, and the jitted functions that run it."""
from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Iterator

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from cpu_offload.batched_decode import BatchDecoder
from cpu_offload.decoder import check_supported
from pjinfer.config import ConfigError, ModelConfig
from pjinfer.load import loader, powerinfer
from pjinfer.load.tokenizer import Tokenizer
from pjinfer.load.bundle import THRESHOLDS, Bundle
from pjinfer.runtime import backends, batch, sparse, tensor_parallel
from pjinfer.runtime import generate as gen
from pjinfer.runtime import host as pjinfer_host
from pjinfer.runtime.compile_cache import enable_compilation_cache, trim_after_compiles
from pjinfer.runtime.sampling import Sampling


class Engine:
    def __init__(self, config: ModelConfig, weights: dict, tokenizer: Tokenizer, *, source: str = "",
                 weights_format: str = "float32", thresholds=None, hot_backend: str = "xla", predictors=None,
                 neuron_rows: bool = False, parallel: bool = False, layers: tuple[int, int] | None = None,
                 placement=None):
        """weights: canonical weights (pjinfer.runtime.model), float32 arrays or quantized matrices
        (cpu_offload.qtensor), built into the backend (pjinfer.runtime.backends) that runs weights_format with
        `thresholds` and `hot_backend`.
        weights_format "float32": every matrix float32 in XLA (quantized ones dequantized here, one at a time).
        A host decode format (a key of cpu_offload.blocks.FORMATS, whose row says which block types it keeps the
        layers and the head in): the model holds only the quantized arrays, once. They are handed to XLA with
        jax.device_put, which on the CPU aliases a 64-byte-aligned numpy array (qtensor.aligned) instead of
        copying it, and the host decode reads the same bytes. One-token decode steps run on the host
        (cpu_offload.host_decode); prefill and scoring through XLA, which dequantizes each matrix where it is used
        (a float32 transient), so every path computes one model.
        thresholds ([n_layers, 4], pjinfer.offline.teal): input sparsity in every path; on Q4_1 layers (the
        host-thresholds row of backends.BACKENDS) decode runs cpu_offload.sparse_decode (the same Q4_1 numbers
        laid out by input column, only active inputs read; a second copy of the layers); with "float32",
        hot_backend says where one-token products run: "xla" (dense products of the masked inputs) or "pallas" /
        "pallas-interpret" (pjinfer.runtime.gathered: the blocks held input-major, only the active inputs' rows
        read by the Pallas gather kernel). A predictor bundle's hot_backend is use_bundle's. neuron_rows:
        `weights` are a PowerInfer file's as the loader keeps them with neuron_rows (the weights_format of
        backends.BACKENDS' powerinfer rows), run on the host with the file's `predictors`
        (pjinfer.load.powerinfer.Predictors), or dense without them. parallel: split over the processes
        jax.distributed joined (pjinfer.runtime.tensor_parallel; the formats of backends.BACKENDS' tensor-parallel
        row). layers: a layer split (--offload-layers; backends.Plan.layers): (k, n_layers), the first k layers in
        XLA on the stored blocks, the rest and the head on the host decode (none of them when k is n_layers).
        placement: a PowerInfer file's hot neurons (bool [n_layers, d_ff]) with a Pallas hot_backend: the
        powerinfer-hybrid row."""
        rule = THRESHOLDS if thresholds is not None else backends.PREDICTORS if predictors is not None else None
        self.backend = backends.select(weights_format, rule, hot_backend, neuron_rows=neuron_rows, parallel=parallel,
                                       split=layers is not None)
        if layers is not None and layers[1] != config.n_layers:
            raise ConfigError(f"a layer split of {layers[1]} layers for a model of {config.n_layers}")
        backends.check_platform_runs(self.backend, weights_format, hot_backend, backends.host_layers(layers))
        self.layers = layers
        self.config = config
        self.tokenizer = tokenizer
        self.source = source
        self.weights_format = weights_format
        self.bundle = None        # the sparse bundle it runs: predictors (use_bundle) or thresholds (load)
        self.load_seconds = None  # set by load(): reading the file to a ready engine
        model, self.host = backends.build(self.backend, config, weights, weights_format, thresholds=thresholds,
                                          hot_backend=hot_backend, predictors=predictors,
                                          device_layers=0 if layers is None else layers[0], placement=placement)
        del weights   # the caller's float32 copies (if any) are not kept alive by this frame
        self.thresholds = thresholds
        self.hot_backend = hot_backend  # where hot neurons or one-token threshold products run
        self.graphdef, self.state = nnx.split(model)

    @classmethod
    def load(cls, path=None, *, bundle=None, hot_backend: str = "auto", cold_weights: str = "float32",
             bridge: str = "auto", weights: str = "auto", sparse_rule: str = "auto", dense: bool = False, progress=None,
             compile_cache: bool = True, parallel: bool = False, offload_layers: int | str | None = None) -> "Engine":
        """The model at `path` (default: the embedded SmolLM2-135M), ready to generate: the plan
        pjinfer.runtime.backends.resolve makes of these settings (from_plan). dense: a PowerInfer file computes
        every neuron (by default its own predictors pick them). parallel: split over the processes
        jax.distributed joined (pjinfer.runtime.tensor_parallel.Processes.start). offload_layers: the first layers
        in XLA, the rest on the host decode (llama.cpp's -ngl): 0 to the model's layers, or "all"."""
        request = backends.Request(path, weights=weights, bundle=bundle, sparse_rule=sparse_rule,
                                   hot_backend=hot_backend, cold_weights=cold_weights, bridge=bridge, dense=dense,
                                   parallel=parallel, offload_layers=offload_layers)
        return cls.from_plan(backends.resolve(request), progress=progress, compile_cache=compile_cache)

    @classmethod
    def from_plan(cls, plan: backends.Plan, *, progress=None, compile_cache: bool = True) -> "Engine":
        """Read the plan's model and build its backend. compile_cache: keep compiled executables on disk
        (runtime.compile_cache), so the next process does not compile again."""
        start = time.perf_counter()
        trim_after_compiles()
        if compile_cache:
            enable_compilation_cache()
        r = plan.request
        model_path = Path(r.model) if r.model else loader.default_model_path()
        predictors = None
        if plan.backend.neuron_rows:
            config, tensors, tokenizer = loader.load_gguf(model_path, progress=progress, keep=plan.weights,
                                                          neuron_rows=True)
            if plan.rule == backends.PREDICTORS:
                predictors = powerinfer.read_predictors(loader.open_gguf(model_path), config, model_path)
        else:
            config, tensors, tokenizer = loader.load(model_path, progress=progress,
                                                     keep=plan.weights if plan.backend.host else None,
                                                     part=tensor_parallel.part if plan.backend.parallel else None,
                                                     grouped=plan.backend.grouped)
        if r.weights == "auto" and plan.backend.host and not plan.backend.neuron_rows:
            try:
                check_supported(config, tensors, plan.weights)
            except ConfigError as e:   # said, not silent: the slower path runs (a split has none)
                if plan.backend.split:
                    raise ConfigError(f"--offload-layers leaves layers to the host decode, which cannot run this "
                                      f"model ({e})") from None
                print(f"pjinfer: running float32 weights: the {plan.weights} host decode cannot run this model ({e})",
                      file=sys.stderr)
                plan = plan.on_float32()
        source = str(model_path)
        bundle = Bundle.open(r.bundle, source=source) if plan.rule == THRESHOLDS else None
        engine = cls(config, tensors, tokenizer, source=source, weights_format=plan.weights,
                     thresholds=None if bundle is None else bundle.thresholds(config),
                     hot_backend=plan.hot_backend if bundle is not None or plan.placement is not None else "xla",
                     predictors=predictors, placement=plan.placement,
                     neuron_rows=bool(plan.backend.neuron_rows), parallel=plan.backend.parallel, layers=plan.layers)
        del tensors
        if bundle is not None:
            engine.bundle = bundle
        elif plan.rule == backends.PREDICTORS and r.bundle is not None:
            engine.use_bundle(r.bundle, hot_backend=plan.hot_backend, cold_weights=r.cold_weights, bridge=r.bridge)
        engine.load_seconds = time.perf_counter() - start
        return engine

    def use_bundle(self, path, *, hot_backend: str = "xla", cold_weights: str = "float32", bridge: str = "auto") -> None:
        """Run sparse from now on: the bundle's predictors pick active neurons, its placement splits
        them into hot (accelerator) and cold (host memory, Numba) rows, reached through `bridge`."""
        backend = backends.select(self.weights_format, backends.PREDICTORS, hot_backend, cold_weights)
        bundle = Bundle.open(path, source=self.source)
        predictors = bundle.predictors(self.config)
        hot = bundle.placement(self.config)
        model = nnx.merge(self.graphdef, self.state)
        sparse.sparsify(model, hot, predictors, hot_backend=hot_backend, cold_weights=cold_weights, bridge=bridge)
        self.graphdef, self.state = nnx.split(model)
        self.bundle, self.backend, self.hot_backend = bundle, backend, hot_backend

    @property
    def model_args(self) -> tuple[gen.Graph, list]:
        """(graph, state) as the jitted functions of pjinfer.runtime.generate take them (gen.split of graphdef and
        state; made again when either is replaced, as use_bundle does, not when one is changed in place)."""
        made = getattr(self, "_model_args", None)
        if made is None or made[0] is not self.graphdef or made[1] is not self.state:
            made = self._model_args = (self.graphdef, self.state, *gen.split(self.graphdef, self.state))
        return made[2], made[3]

    @property
    def path(self) -> str:
        """Which engine runs, in words: the weights, and the sparse rule when a bundle is in use."""
        return self.backend.describe(self.weights_format, self.hot_backend, None if self.bundle is None else
                                     self.bundle.path, self.layers)

    # ------------------------------------------------------------ generation
    def plan(self, prompt_len: int, max_new_tokens: int) -> tuple[int, int]:
        """(padded prompt length, cache length) for a request; refuses what the context cannot hold."""
        if prompt_len < 1:
            raise ConfigError("the prompt is empty")
        if max_new_tokens < 1:
            raise ConfigError(f"max new tokens must be >= 1, got {max_new_tokens}")
        total = prompt_len + max_new_tokens
        if total > self.config.max_seq_len:
            raise ConfigError(f"prompt ({prompt_len} tokens) plus max new tokens ({max_new_tokens}) exceed "
                              f"the model's context of {self.config.max_seq_len} tokens")
        cache_len = min(gen.bucket(total, gen.MIN_CACHE_BUCKET), self.config.max_seq_len)
        return min(gen.bucket(prompt_len, gen.MIN_PROMPT_BUCKET), cache_len), cache_len

    def stop_tokens(self, stop_ids) -> np.ndarray:
        ids = list(self.tokenizer.eos_ids if stop_ids is None else stop_ids)[:gen.MAX_STOP_IDS]
        return np.array(ids + [-1] * (gen.MAX_STOP_IDS - len(ids)), np.int32)

    def prompt_rows(self, padded_len: int):
        """Where a prompt padded to padded_len tokens runs (pjinfer.runtime.host.prefill says why): the dense host
        decoder's prompt decoder (a BatchDecoder of PROMPT_ROWS rows, made on first use) when the engine's backend
        decodes in batches on the host and the prompt fits it; host.STEPS, one-token decode steps, on another host
        backend for a prompt of at most STEPPED_PROMPT tokens (a layer split's too: its prompt decoder would run every
        layer on the host) and on a tensor-parallel one for any prompt; else None: XLA."""
        if not self.backend.host:
            return None
        if self.backend.parallel:
            return pjinfer_host.STEPS
        if not self.backend.batched or self.backend.split:
            return pjinfer_host.STEPS if padded_len <= pjinfer_host.STEPPED_PROMPT else None
        if padded_len > pjinfer_host.PROMPT_ROWS:
            return None
        rows = getattr(self, "_prompt_rows", None)
        if rows is None or rows.host is not self.host:
            rows = self._prompt_rows = BatchDecoder(self.host, pjinfer_host.PROMPT_ROWS, span=pjinfer_host.PROMPT_ROWS)
        return rows

    def pad_prompt(self, prompt_ids, padded_len):
        tokens = np.zeros((1, padded_len), np.int32)
        tokens[0, :len(prompt_ids)] = prompt_ids
        return jax.device_put(tokens)   # no executable, as jnp.asarray compiles one per shape

    def prefill(self, prompt_ids, *, cache_len: int, sampling: Sampling = Sampling(), key=None):
        """Run the prompt into a fresh cache of cache_len slots: (first new token, cache). key: the sampling
        key (default: sampling.seed's)."""
        padded = min(gen.bucket(len(prompt_ids), gen.MIN_PROMPT_BUCKET), cache_len)
        key = jax.random.key(sampling.seed) if key is None else key
        return gen.prefill(*self.model_args, self.pad_prompt(prompt_ids, padded),
                           np.int32(len(prompt_ids)), key, sampling.params(), cache_len=cache_len,
                           greedy=sampling.greedy, rows=self.prompt_rows(padded))

    def generate(self, prompt_ids, *, max_new_tokens: int = 64, sampling: Sampling = Sampling(),
                 stop_ids=None, cache_len: int | None = None) -> list[int]:
        """stream()'s ids as a list, every decode step in one jitted call."""
        return list(self.stream(prompt_ids, max_new_tokens=max_new_tokens, sampling=sampling, stop_ids=stop_ids,
                                chunk=None, cache_len=cache_len))

    def stream(self, prompt_ids, *, max_new_tokens: int = 64, sampling: Sampling = Sampling(), stop_ids=None,
               chunk: int | None = gen.STREAM_CHUNK, cache_len: int | None = None, into=None) -> Iterator[int]:
        """Yields generated ids as they come (a final stop id dropped): the first from the prefill, then up to
        `chunk` at a time (None: all of them), each chunk from one jitted loop of decode steps. The request is a
        batch of one in the decode loop every request runs (pjinfer.runtime.batch): a new Batch, or slot 0 of
        `into`, released when the stream ends (a tensor-parallel chat's LeaderBatch, whose calls its followers
        make too). stop_ids: default the tokenizer's end ids, [] for none. cache_len: at least what plan() gives
        (one executable for several max_new_tokens). Stopping early wastes at most the rest of a chunk."""
        _, planned = self.plan(len(prompt_ids), max_new_tokens)
        cache_len = planned if cache_len is None else max(cache_len, planned)
        one = batch.Batch(self, 1) if into is None else into
        state = one.start(0, prompt_ids, max_new_tokens, sampling, stop_ids, cache_len=cache_len)
        new = [state.token]
        try:
            while True:
                for token in new:
                    if token in state.stops:
                        return
                    yield token
                if state.remaining <= 0:
                    return
                one.step([state], chunk or cache_len)   # a chunk of the cache's length: one executable per cache
                new = state.new
        finally:
            one.release(0)

    # ------------------------------------------------------------ scoring
    def token_logprobs(self, tokens: np.ndarray, *, with_greedy: bool = False, lengths=None):
        """tokens [B, T] -> log-probabilities [B, T-1] of each token after the first given the ones before;
        with_greedy also returns whether each of those tokens is the model's argmax there. lengths [B]: how many
        of each row's tokens are real (default: all T); the figures past them are undefined, and a tensor-parallel
        engine skips them (a row of length 0 costs nothing)."""
        tokens = self._check_len(tokens)
        if self.backend.parallel:
            lengths = np.full(len(tokens), tokens.shape[1]) if lengths is None else np.asarray(lengths)
            logp, greedy, _ = self._stepped(tokens, lengths - 1)
        else:
            logp, greedy = gen.token_logprobs(*self.model_args, jnp.asarray(tokens))
        return (np.asarray(logp), np.asarray(greedy)) if with_greedy else np.asarray(logp)

    def last_logprobs(self, tokens: np.ndarray, lengths) -> np.ndarray:
        """tokens [B, T], lengths [B] (each at least 1) -> log-probabilities [B, vocab] of the token after each
        row's first lengths[b] tokens."""
        tokens = self._check_len(tokens)
        if self.backend.parallel:
            return self._stepped(tokens, np.asarray(lengths))[2]
        return np.asarray(gen.last_logprobs(*self.model_args, jnp.asarray(tokens),
                                            jnp.asarray(lengths, jnp.int32)))

    def _check_len(self, tokens) -> np.ndarray:
        tokens = np.asarray(tokens, np.int32)
        if tokens.shape[1] > self.config.max_seq_len:
            raise ConfigError(f"{tokens.shape[1]} tokens exceed the model's context of {self.config.max_seq_len}")
        return tokens

    def _stepped(self, tokens: np.ndarray, steps: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """generate.stepped_logprobs row by row, steps[b] decode steps for row b (decode steps only: one sequence
        at a time; a row of no steps costs nothing and reads zeros): (logp [B, T-1], greedy, last [B, vocab])."""
        b, t = tokens.shape
        cache_len = min(gen.bucket(t, gen.MIN_CACHE_BUCKET), self.config.max_seq_len)
        out = (np.zeros((b, t - 1), np.float32), np.zeros((b, t - 1), bool),
               np.zeros((b, self.config.vocab_size), np.float32))
        for r in np.flatnonzero(steps > 0):
            got = gen.stepped_logprobs(*self.model_args, tokens[r][None], np.int32(steps[r]),
                                       cache_len=cache_len)
            for into, row in zip(out, got):
                into[r] = np.asarray(row[0])
        return out

    def perplexity(self, ids, *, windows: int, window_len: int) -> tuple[float, int]:
        """llama.cpp's protocol: `windows` consecutive windows of window_len+1 tokens from the start;
        score tokens 2..window_len+1 of each from the ones before. Returns (perplexity, tokens scored)."""
        if windows < 1 or window_len < 1:
            raise ConfigError("--windows and --window-len must be >= 1")
        need = windows * (window_len + 1)
        if len(ids) < need:
            raise ConfigError(f"text has {len(ids)} tokens; {windows} windows of {window_len + 1} need {need}")
        batch = np.asarray(ids[:need], np.int32).reshape(windows, window_len + 1)
        logp = np.concatenate([self.token_logprobs(row[None]) for row in batch])
        return float(np.exp(-logp.mean())), int(logp.size)
