"""The object users hold: a loaded model, its tokenizer, and the jitted functions that run it."""
from __future__ import annotations

import sys
import time
from typing import Iterator

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from cpu_offload.qtensor import aligned, is_quantized
from pjinfer.config import HOT_BACKENDS, SPARSE_RULES, WEIGHT_CHOICES, WEIGHT_FORMATS, ConfigError, ModelConfig
from pjinfer.load import loader
from pjinfer.load.tokenizer import Tokenizer
from pjinfer.offline.bundle import THRESHOLDS, Bundle
from pjinfer.runtime import generate as gen
from pjinfer.runtime import host as pjinfer_host
from pjinfer.runtime.model import Float32View, Transformer, float32_weights, set_thresholds
from pjinfer.runtime.sampling import Sampling, recent_ids


def bundle_rule(bundle, asked: str = "auto") -> str:
    """Which of a bundle's sparse rules runs: "thresholds" (its calibrated input thresholds, `pjinfer calibrate`) or
    "predictors" (its predictors and placement). asked (config.SPARSE_RULES, --sparse-rule): "auto" is thresholds
    when the bundle has them, else predictors; a named rule runs as named. Reads the manifest only; the stages the
    rule reads are required when they load (check_bundle_stages checks them first)."""
    if asked not in SPARSE_RULES:
        raise ConfigError(f"sparse rule must be one of {', '.join(SPARSE_RULES)}, got {asked!r}")
    if asked != "auto":
        return asked
    return THRESHOLDS if THRESHOLDS in Bundle.open(bundle).manifest["stages"] else "predictors"


def check_bundle_stages(bundle, rule: str) -> None:
    """ConfigError (naming the command that makes it) when the bundle lacks a stage `rule` reads."""
    opened = Bundle.open(bundle)
    for stage in (THRESHOLDS,) if rule == THRESHOLDS else ("predictors", "placement"):
        opened.require(stage)


def resolve_weights(weights: str, path=None, bundle=None, *, sparse_rule: str = "auto",
                    hot_backend: str = "xla") -> str:
    """The weights format a request for `weights` runs (config.WEIGHT_CHOICES). "auto" is the checkpoint's own
    quantization where the host decode runs it: q4_1 for a GGUF whose layers are Q4_1 (with a bundle, only when
    the bundle's thresholds run on the host: bundle_rule gives thresholds and hot_backend is xla; its predictors,
    or thresholds on a Pallas backend, run float32), gguf for one whose layers are other block types with host
    kernels (without a bundle), float32 otherwise: said in one stderr line when the file holds block types without
    a host kernel, or when JAX runs on a GPU (the host decode runs where JAX runs on the CPU). Reads headers
    only."""
    if weights != "auto":
        return weights
    chosen = _auto_weights(path, bundle, sparse_rule, hot_backend)
    platform = jax.default_backend()
    if chosen != "float32" and platform != "cpu":
        print(f"pjinfer: running float32 weights on the {platform}: the {chosen} host decode runs where JAX runs "
              "on the CPU", file=sys.stderr)
        return "float32"
    return chosen


def check_host_weights(weights: str) -> None:
    """Weights other than float32 decode on the host (cpu_offload's FFI targets, registered for the CPU):
    ConfigError in one line where JAX runs on another platform."""
    if weights != "float32":
        from cpu_offload.ffi import check_platform

        check_platform(jax.default_backend(), f"--weights {weights} (the host decode)",
                       "--weights float32 runs there")


def _auto_weights(path, bundle, sparse_rule: str, hot_backend: str) -> str:
    """resolve_weights' "auto" from the checkpoint and the bundle alone."""
    stored = loader.stored_format(path)
    if stored == "gguf" and bundle is None:
        return "gguf"
    if stored != "q4_1":
        from cpu_offload.blocks import BY_NAME

        foreign = sorted((loader.layer_types(path) or set()) - set(BY_NAME) - {"F32", "F16", "BF16"})
        if foreign:
            print(f"pjinfer: running float32 weights: no host kernel reads type {', '.join(foreign)}",
                  file=sys.stderr)
        return "float32"
    if bundle is not None:
        on_host = bundle_rule(bundle, sparse_rule) == THRESHOLDS and hot_backend == "xla"
        return "q4_1" if on_host else "float32"
    return "q4_1"


def check_bundle_weights(weights: str, bundle, *, rule: str | None = None, hot_backend: str = "xla",
                         cold_weights: str = "float32") -> None:
    """Which weights a sparse bundle runs with: predictors and placement on float32 (cold rows in host memory as
    cold_weights); thresholds on q4_1 (the host decode, hot backend xla) or float32 (hot backend xla: dense masked
    products in XLA; pallas or pallas-interpret: the gather kernels, pjinfer.runtime.gathered), with no cold rows.
    rule: bundle_rule's answer, when known."""
    if bundle is None:
        return
    if weights in ("int8", "gguf"):
        raise ConfigError(f"--weights {weights} is the dense host decode; a sparse bundle takes --cold-weights int8 "
                          "(predictors) or --weights q4_1 (thresholds)")
    if hot_backend not in HOT_BACKENDS:
        raise ConfigError(f"unknown hot backend {hot_backend!r} (known: {', '.join(HOT_BACKENDS)})")
    if rule == THRESHOLDS and cold_weights != "float32":
        raise ConfigError(f"--cold-weights {cold_weights} stores a predictor bundle's cold rows; a bundle's thresholds "
                          "run without cold rows (--sparse-rule predictors runs its predictors)")
    if weights == "q4_1" and rule == "predictors":
        raise ConfigError("a bundle's predictors run with --weights float32; --weights q4_1 runs its thresholds")
    if weights == "q4_1" and rule == THRESHOLDS and hot_backend != "xla":
        raise ConfigError(f"--hot-backend {hot_backend} runs a bundle's thresholds on float32 weights; "
                          "--weights q4_1 decodes them on the host (leave --hot-backend xla)")


def _to_xla(a) -> jax.Array:
    """a in XLA's memory without a copy: on the CPU jax.device_put aliases an XLA-aligned numpy array."""
    return jax.device_put(aligned(a))


class Engine:
    def __init__(self, config: ModelConfig, weights: dict, tokenizer: Tokenizer, *, source: str = "",
                 weights_format: str = "float32", thresholds=None, hot_backend: str = "xla"):
        """weights: canonical weights (pjinfer.runtime.model), float32 arrays or quantized matrices (cpu_offload.qtensor).
        weights_format "float32": every matrix float32 in XLA (quantized ones dequantized here, one at a time).
        "int8" (every matrix quantized with a scale per block of 64) or "q4_1" (the layers in the GGUF's 4-bit
        blocks, a Q4Tensor of the file kept as it is; the head int8): the model holds only the quantized
        arrays, once. They are handed to XLA with jax.device_put, which on the CPU aliases a 64-byte-aligned
        numpy array (qtensor.aligned) instead of copying it, and the host decode reads the same bytes.
        One-token decode steps run on the host through cpu_offload.host_decode; prefill and scoring through XLA,
        which dequantizes each matrix where it is used (a float32 transient), so every path computes one model.
        thresholds ([n_layers, 4], pjinfer.offline.teal): input sparsity in every path; with "q4_1" decode runs
        cpu_offload.sparse_decode (the same Q4_1 numbers laid out by input column, only active inputs read; a
        second copy of the layers); with "float32", hot_backend says where one-token products run: "xla" (dense
        products of the masked inputs) or "pallas" / "pallas-interpret" (pjinfer.runtime.gathered: the blocks held
        input-major, only the active inputs' rows read by the Pallas gather kernel; every weight on the
        accelerator). hot_backend is for thresholds on float32 only (a predictor bundle's: use_bundle)."""
        if weights_format not in WEIGHT_FORMATS:
            raise ConfigError(f"weights must be one of {', '.join(WEIGHT_FORMATS)}, got {weights_format!r}")
        if hot_backend not in HOT_BACKENDS:
            raise ConfigError(f"unknown hot backend {hot_backend!r} (known: {', '.join(HOT_BACKENDS)})")
        if hot_backend != "xla" and (thresholds is None or weights_format != "float32"):
            raise ConfigError(f"hot backend {hot_backend} runs input thresholds on float32 weights, not "
                              f"{weights_format} weights {'with' if thresholds is not None else 'without'} thresholds")
        self.config = config
        self.tokenizer = tokenizer
        self.source = source
        self.weights_format = weights_format
        self.bundle = None        # the sparse bundle it runs: predictors (use_bundle) or thresholds (load)
        self.load_seconds = None  # set by load(): reading the file to a ready engine
        host = None
        if thresholds is not None and weights_format in ("int8", "gguf"):
            raise ConfigError("input-sparsity thresholds run with --weights q4_1 or float32, not int8 or gguf")
        check_host_weights(weights_format)
        if weights_format != "float32":
            from cpu_offload.decoder import HostDecoder, quantize_weights

            if thresholds is not None:   # checks the model and lays the layers out by input column
                from cpu_offload.sparse_decode import SparseHostDecoder   # its FFI handler loads at import: 3 MB

                host = SparseHostDecoder(config, Float32View(weights), thresholds)
            stored = quantize_weights(config, weights, weights_format, check=thresholds is None)
            weights = None  # the caller's float32 copies (if any) are not kept alive by this frame
            stored = {k: v.map(_to_xla) if is_quantized(v) else v for k, v in stored.items()}
            if thresholds is None:
                host = HostDecoder(config, stored, weights_format)
            weights = stored
        elif any(is_quantized(w) for w in weights.values()):
            weights = float32_weights(weights)
        model = Transformer(config, weights)
        if host is not None:
            pjinfer_host.attach(model, host)
        self.host = host          # the host decoder one-token steps run on (None: every step through XLA)
        if thresholds is not None:
            set_thresholds(model, thresholds)
        if hot_backend != "xla":
            from pjinfer.runtime import gathered

            gathered.attach(model, hot_backend)
        self.thresholds = thresholds
        self.hot_backend = hot_backend  # where one-token threshold products run (float32 weights with thresholds)
        self.graphdef, self.state = nnx.split(model)

    @classmethod
    def load(cls, path=None, *, bundle=None, hot_backend: str = "xla", cold_weights: str = "float32",
             weights: str = "auto", sparse_rule: str = "auto", progress=None, compile_cache: bool = True) -> "Engine":
        """The model at `path` (default: the embedded SmolLM2-135M), ready to generate. weights: a format or
        "auto" (resolve_weights). bundle: a sparse bundle to run with; sparse_rule picks its rule (bundle_rule):
        thresholds run on q4_1 (host decode) or float32 (hot_backend: xla, or the Pallas gather kernels),
        predictors and placement on float32 (hot_backend and cold_weights: use_bundle). compile_cache: keep
        compiled executables on disk (runtime.enable_compilation_cache), so the next process does not compile
        again."""
        from pjinfer.runtime.compile_cache import enable_compilation_cache, trim_after_compiles

        start = time.perf_counter()
        trim_after_compiles()
        if compile_cache:
            enable_compilation_cache()
        if weights not in WEIGHT_CHOICES:
            raise ConfigError(f"weights must be one of {', '.join(WEIGHT_CHOICES)}, got {weights!r}")
        rule = None if bundle is None else bundle_rule(bundle, sparse_rule)
        asked, weights = weights, resolve_weights(weights, path, bundle, sparse_rule=sparse_rule,
                                                  hot_backend=hot_backend)
        check_bundle_weights(weights, bundle, rule=rule, hot_backend=hot_backend, cold_weights=cold_weights)
        check_host_weights(weights)   # before the file is read (__init__ checks again for direct construction)
        config, tensors, tokenizer = loader.load(path, progress=progress, keep_q4_1=weights == "q4_1",
                                                 keep_blocks=weights == "gguf")
        if asked == "auto" and weights != "float32":
            from cpu_offload.decoder import check_supported

            try:
                check_supported(config, tensors, weights)
            except ConfigError as e:   # said, not silent: the slower path runs
                print(f"pjinfer: running float32 weights: the {weights} host decode cannot run this model ({e})",
                      file=sys.stderr)
                weights = "float32"
        source = str(path or loader.default_model_path())
        thresholds = None
        if rule == THRESHOLDS:
            thresholds = Bundle.open(bundle, source=source).thresholds(config)
        engine = cls(config, tensors, tokenizer, source=source, weights_format=weights, thresholds=thresholds,
                     hot_backend=hot_backend if thresholds is not None else "xla")
        if thresholds is not None:
            engine.bundle = Bundle.open(bundle)
        elif bundle is not None:
            engine.use_bundle(bundle, hot_backend=hot_backend, cold_weights=cold_weights)
        engine.load_seconds = time.perf_counter() - start
        return engine

    def use_bundle(self, path, *, hot_backend: str = "xla", cold_weights: str = "float32") -> None:
        """Run sparse from now on: the bundle's predictors pick active neurons, its placement splits
        them into hot (accelerator) and cold (host memory, Numba) rows."""
        from pjinfer.runtime import sparse

        bundle = Bundle.open(path, source=self.source)
        predictors = bundle.predictors(self.config)
        hot = bundle.placement(self.config)
        model = nnx.merge(self.graphdef, self.state)
        sparse.sparsify(model, hot, predictors, hot_backend=hot_backend, cold_weights=cold_weights)
        self.graphdef, self.state = nnx.split(model)
        self.bundle = bundle

    @property
    def graph(self) -> gen.Graph:
        """self.graphdef as the jitted functions' static argument (made again when graphdef is replaced)."""
        graph = getattr(self, "_graph", None)
        if graph is None or graph.graphdef is not self.graphdef:
            graph = self._graph = gen.Graph(self.graphdef)
        return graph

    @property
    def path(self) -> str:
        """Which engine runs, in words: the weights, and the sparse rule when a bundle is in use."""
        if self.bundle is None:
            return f"weights {self.weights_format}"
        rule = "input thresholds" if self.thresholds is not None else "predictors"
        if self.thresholds is not None and self.hot_backend != "xla":
            rule += f" gathered by {self.hot_backend}"
        return f"weights {self.weights_format}, sparse ({rule}, {self.bundle.path})"

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

    def stop_tokens(self, stop_ids) -> jnp.ndarray:
        ids = list(self.tokenizer.eos_ids if stop_ids is None else stop_ids)[:gen.MAX_STOP_IDS]
        return jnp.array(ids + [-1] * (gen.MAX_STOP_IDS - len(ids)), jnp.int32)

    def prompt_rows(self, padded_len: int):
        """Where a prompt padded to padded_len tokens runs: the dense host decoder's prompt decoder (a
        BatchDecoder of PROMPT_ROWS rows, made on first use) when the engine decodes in batches (batch.unsupported)
        and the prompt fits it, else None: XLA (pjinfer.runtime.host.prefill says why)."""
        from pjinfer.runtime import batch

        if padded_len > pjinfer_host.PROMPT_ROWS or batch.unsupported(self) is not None:
            return None
        rows = getattr(self, "_prompt_rows", None)
        if rows is None or rows.host is not self.host:
            from cpu_offload.batched_decode import BatchDecoder

            rows = self._prompt_rows = BatchDecoder(self.host, pjinfer_host.PROMPT_ROWS, span=pjinfer_host.PROMPT_ROWS)
        return rows

    def pad_prompt(self, prompt_ids, padded_len):
        tokens = np.zeros((1, padded_len), np.int32)
        tokens[0, :len(prompt_ids)] = prompt_ids
        return jnp.asarray(tokens)

    def prefill(self, prompt_ids, *, cache_len: int, sampling: Sampling = Sampling(), key=None):
        """Run the prompt into a fresh cache of cache_len slots: (first new token, cache). key: the sampling
        key (default: sampling.seed's)."""
        padded = min(gen.bucket(len(prompt_ids), gen.MIN_PROMPT_BUCKET), cache_len)
        key = jax.random.key(sampling.seed) if key is None else key
        return gen.prefill(self.graph, self.state, self.pad_prompt(prompt_ids, padded),
                           jnp.int32(len(prompt_ids)), key, sampling.params(), cache_len=cache_len,
                           greedy=sampling.greedy, rows=self.prompt_rows(padded))

    def generate(self, prompt_ids, *, max_new_tokens: int = 64, sampling: Sampling = Sampling(),
                 stop_ids=None, cache_len: int | None = None) -> list[int]:
        """Generated ids (a final stop id dropped), produced by one jitted call. stop_ids: default the
        tokenizer's end ids, [] for none. cache_len: at least what plan() gives (one executable for several
        max_new_tokens)."""
        padded, planned = self.plan(len(prompt_ids), max_new_tokens)
        cache_len = planned if cache_len is None else max(cache_len, planned)
        stops = self.stop_tokens(stop_ids)
        out, n = gen.generate_tokens(
            self.graph, self.state, self.pad_prompt(prompt_ids, padded), jnp.int32(len(prompt_ids)),
            jax.random.key(sampling.seed), sampling.params(), jnp.int32(max_new_tokens), stops,
            cache_len=cache_len, greedy=sampling.greedy, rows=self.prompt_rows(padded))
        ids = np.asarray(out)[:int(n)].tolist()  # slice on the host: a device slice compiles per length
        return ids[:-1] if ids and ids[-1] in np.asarray(stops).tolist() else ids

    def stream(self, prompt_ids, *, max_new_tokens: int = 64, sampling: Sampling = Sampling(),
               stop_ids=None) -> Iterator[int]:
        """Yields generated ids as they come: the first from the prefill, then up to gen.STREAM_CHUNK at a time,
        each batch from one jitted loop of decode steps (gen.decode_chunk). The ids, key schedule and stops are
        generate()'s. Stopping early wastes at most the rest of a chunk."""
        _, cache_len = self.plan(len(prompt_ids), max_new_tokens)
        stops = self.stop_tokens(stop_ids)
        stop_set = set(np.asarray(stops).tolist())
        params = sampling.params()
        key, sub = jax.random.split(jax.random.key(sampling.seed))
        token, cache = self.prefill(prompt_ids, cache_len=cache_len, sampling=sampling, key=sub)
        value = int(token)
        if value in stop_set:
            return
        yield value
        produced, pos, recent = 1, len(prompt_ids), recent_ids(prompt_ids)
        while produced < max_new_tokens:
            count = min(gen.STREAM_CHUNK, max_new_tokens - produced)
            out, n, cache, key, recent = gen.decode_chunk(
                self.graph, self.state, token, jnp.int32(pos), cache, key, params, recent, stops, jnp.int32(count),
                chunk=gen.STREAM_CHUNK, greedy=sampling.greedy)
            ids = np.asarray(out)[:int(n)].tolist()
            for value in ids:
                if value in stop_set:
                    return
                yield value
            produced, pos, token = produced + len(ids), pos + len(ids), np.int32(ids[-1])

    # ------------------------------------------------------------ scoring
    def token_logprobs(self, tokens: np.ndarray, *, with_greedy: bool = False):
        """tokens [B, T] -> log-probabilities [B, T-1] of each token after the first given the ones before;
        with_greedy also returns whether each of those tokens is the model's argmax there."""
        tokens = np.asarray(tokens, np.int32)
        if tokens.shape[1] > self.config.max_seq_len:
            raise ConfigError(f"{tokens.shape[1]} tokens exceed the model's context of {self.config.max_seq_len}")
        logp, greedy = gen.token_logprobs(self.graph, self.state, jnp.asarray(tokens))
        return (np.asarray(logp), np.asarray(greedy)) if with_greedy else np.asarray(logp)

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
