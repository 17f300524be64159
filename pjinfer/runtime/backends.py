"""How an engine runs: one row per path in BACKENDS, and `resolve`, which picks the row once per request.

A request names the weights (config.WEIGHT_CHOICES) and, with a sparse bundle, the rule that runs
(config.SPARSE_RULES), where hot neurons or gathered products run (config.HOT_CHOICES) and how a predictor
bundle's cold rows are stored (config.COLD_WEIGHTS). `resolve` turns it into a `Plan` before any weight is read:
it settles "auto" (weights and hot backend), finds the one row that runs the combination, and refuses in one line
what no row runs or what this platform cannot. The engine builds the plan's backend; the CLI, the server and the
benchmarks ask `resolve` and check nothing themselves.

    backend            weights      rule        hot backends                  platforms   batched
    xla                float32      -           xla                           any         yes
    host               q4_1, int8   -           xla                           cpu         yes
    host-blocks        gguf         -           xla                           cpu         no
    host-thresholds    q4_1         thresholds  xla                           cpu         no
    xla-thresholds     float32      thresholds  xla                           any         no
    gathered           float32      thresholds  pallas, pallas-interpret      any (*)     no
    hybrid             float32      predictors  xla, pallas, pallas-interpret any (*)     no
    powerinfer         gguf         predictors  xla                           cpu         no
    powerinfer-dense   gguf         -           xla                           cpu         no
    powerinfer-hybrid  gguf         predictors  pallas, pallas-interpret      any (*)     no
    tensor-parallel    q4_1, gguf   -           xla                           cpu         no
    layer-split        q4_1, int8,  -           xla                           cpu (**)    yes
                       gguf

(*) "pallas" compiles its kernels for a GPU (pjinfer.runtime.gathered.pallas_interpret). "batched": the
server's scheduler decodes concurrent requests in one step (pjinfer.runtime.batch); the others take turns.
The two powerinfer rows run a PowerInfer file (its layers store neuron rows, ffn_down_t) on the host, sparse with
the file's own predictors (no bundle: pjinfer.runtime.predicted) or dense (--dense); the other host rows read
llama.cpp's layout only, and the float32 rows read either. The powerinfer-hybrid row is the same file as PowerInfer
runs it beside a GPU (--hot-backend, no bundle): its placement's hot neurons on the accelerator, the cold ones on the
host (pjinfer.runtime.powerinfer_hybrid). The tensor-parallel row splits the host decode over
the processes `jax.distributed` joined (Request.parallel; pjinfer.runtime.tensor_parallel). The layer-split row is
llama.cpp's -ngl (Request.offload_layers, `--offload-layers K`): the first K layers run whole in XLA (the device) on
the stored blocks, dequantized where used, and the rest with the head on the host decode. (**) With every layer in
XLA no host decoder is built, so that split runs on any platform.
"""
from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path

import jax
import numpy as np

from cpu_offload.blocks import BY_NAME
from cpu_offload.decoder import HostDecoder, quantize_weights
from cpu_offload.ffi import check_platform
from cpu_offload.host_call import bridge_for
from cpu_offload.qtensor import is_quantized
from cpu_offload.sparse_decode import SparseHostDecoder
from pjinfer.config import (COLD_WEIGHTS, HOT_BACKENDS, HOT_CHOICES, SPARSE_RULES, WEIGHT_CHOICES, WEIGHT_FORMATS,
                            ConfigError)
from pjinfer.load import loader
from pjinfer.load.powerinfer import file_layout, file_placement
from pjinfer.load.bundle import THRESHOLDS, Bundle
from pjinfer.runtime import gathered, host, tensor_parallel
from pjinfer.runtime.gathered import PALLAS_BACKENDS, pallas_interpret
from pjinfer.runtime.model import Float32View, Transformer, float32_weights, set_thresholds, to_xla
from pjinfer.runtime.predicted import attach_powerinfer

PREDICTORS = "predictors"


@dataclasses.dataclass(frozen=True)
class Backend:
    """One way of running a model. rule: None (dense), THRESHOLDS or PREDICTORS; host: one-token steps run on
    the host decoder (cpu_offload's FFI targets, registered for the CPU only); batched: concurrent requests
    decode in one step; neuron_rows: the file's layout it reads, PowerInfer's (True), llama.cpp's (False) or
    either (None); parallel: split over processes (tensor parallel), one-token steps only; split: the first
    layers in XLA, the rest on the host decoder (Request.offload_layers); grouped: its Q4_1 layers are loaded
    relaid 16 rows together (cpu_offload.blocks.group_rows, q4_groups' Q4_1 form)."""
    name: str
    weights: tuple[str, ...]
    rule: str | None
    hot_backends: tuple[str, ...]
    host: bool
    batched: bool
    neuron_rows: bool | None = False
    parallel: bool = False
    split: bool = False
    grouped: bool = False

    def runs(self, weights: str, rule: str | None, hot_backend: str, neuron_rows: bool = False,
             parallel: bool = False, split: bool = False) -> bool:
        return (weights in self.weights and rule == self.rule and hot_backend in self.hot_backends
                and self.neuron_rows in (None, neuron_rows) and self.parallel == parallel and self.split == split)

    def describe(self, weights: str, hot_backend: str, bundle=None, layers: tuple[int, int] | None = None) -> str:
        """The path in words, as the CLI prints it: the weights, and the sparse rule with its bundle, or where a
        layer split's layers run (layers: (in XLA, in all))."""
        if self.split:
            k, n = layers
            xla = f"layers 0-{k - 1} in XLA on the {jax.default_backend()}" if k else "no layer in XLA"
            host = "the head in XLA too" if k == n else f"layers {k}-{n - 1} and the head on the host decode"
            return f"weights {weights}, {xla}, {host}"
        if self.parallel:
            return f"weights {weights}, tensor parallel over {jax.process_count()} processes"
        if self.rule is None:
            return f"weights {weights}"
        if bundle is None and not self.host:
            return (f"weights {weights}, sparse (the file's predictors and placement: hot neurons on the "
                    f"{jax.default_backend()} by {hot_backend}, cold ones on the host)")
        if bundle is None:
            return f"weights {weights}, sparse (the file's predictors)"
        rule = "input thresholds" if self.rule == THRESHOLDS else "predictors"
        if self.rule == THRESHOLDS and hot_backend != "xla":
            rule += f" gathered by {hot_backend}"
        return f"weights {weights}, sparse ({rule}, {bundle})"


BACKENDS = (
    Backend("xla", ("float32",), None, ("xla",), host=False, batched=True, neuron_rows=None),
    Backend("host", ("q4_1", "int8"), None, ("xla",), host=True, batched=True, grouped=True),
    Backend("host-blocks", ("gguf",), None, ("xla",), host=True, batched=False, grouped=True),
    Backend("host-thresholds", ("q4_1",), THRESHOLDS, ("xla",), host=True, batched=False),
    Backend("xla-thresholds", ("float32",), THRESHOLDS, ("xla",), host=False, batched=False, neuron_rows=None),
    Backend("gathered", ("float32",), THRESHOLDS, PALLAS_BACKENDS, host=False, batched=False, neuron_rows=None),
    Backend("hybrid", ("float32",), PREDICTORS, HOT_BACKENDS, host=False, batched=False, neuron_rows=None),
    Backend("powerinfer", ("gguf",), PREDICTORS, ("xla",), host=True, batched=False, neuron_rows=True),
    Backend("powerinfer-dense", ("gguf",), None, ("xla",), host=True, batched=False, neuron_rows=True),
    Backend("powerinfer-hybrid", ("gguf",), PREDICTORS, PALLAS_BACKENDS, host=False, batched=False, neuron_rows=True),
    Backend("tensor-parallel", ("q4_1", "gguf"), None, ("xla",), host=True, batched=False, parallel=True,
            grouped=True),
    Backend("layer-split", ("q4_1", "int8", "gguf"), None, ("xla",), host=True, batched=True, split=True,
            grouped=True),
)


def select(weights: str, rule: str | None = None, hot_backend: str = "xla", cold_weights: str = "float32", *,
           neuron_rows: bool = False, parallel: bool = False, split: bool = False) -> Backend:
    """The row that runs these settings (rule: None, THRESHOLDS or PREDICTORS; neuron_rows: a PowerInfer file's
    layout; parallel: split over processes; split: --offload-layers), or ConfigError in one line that says what
    runs instead."""
    if weights not in WEIGHT_FORMATS:
        raise ConfigError(f"weights must be one of {', '.join(WEIGHT_FORMATS)}, got {weights!r}")
    if hot_backend not in HOT_BACKENDS:
        raise ConfigError(f"unknown hot backend {hot_backend!r} (known: {', '.join(HOT_BACKENDS)})")
    if cold_weights not in COLD_WEIGHTS:
        raise ConfigError(f"unknown cold weights {cold_weights!r} (known: {', '.join(COLD_WEIGHTS)})")
    if cold_weights != "float32" and rule != PREDICTORS:
        raise ConfigError(f"--cold-weights {cold_weights} stores a predictor bundle's cold rows; a bundle's thresholds "
                          "run without cold rows (--sparse-rule predictors runs its predictors)")
    for backend in BACKENDS:
        if backend.runs(weights, rule, hot_backend, neuron_rows, parallel, split):
            return backend
    if split:
        runs = ", ".join(w for b in BACKENDS if b.split for w in b.weights)
        what = ("a sparse bundle" if rule else "tensor parallel" if parallel else "a PowerInfer file" if neuron_rows
                else f"--weights {weights}, which runs every layer in XLA already")
        raise ConfigError(f"--offload-layers splits the layers of dense {runs} weights between XLA and the host "
                          f"decode, not {what}")
    if parallel:
        runs = ", ".join(w for b in BACKENDS if b.parallel for w in b.weights)
        raise ConfigError(f"tensor parallel runs the dense host decode of {runs} weights (a file of those blocks), "
                          f"not {'a bundle' if rule else weights}")
    rows = [b for b in BACKENDS if weights in b.weights]
    if neuron_rows and all(b.neuron_rows is False for b in rows):
        raise ConfigError(f"--weights {weights} reads llama.cpp's layout, not a PowerInfer file's neuron rows "
                          "(ffn_down_t); --weights gguf (auto) or float32 run it")
    if rule is None:
        raise ConfigError(f"hot backend {hot_backend} runs a bundle's input thresholds or predictors, not dense "
                          f"{weights} weights")
    if not any(b.rule and b.neuron_rows is not True for b in rows):   # no bundle's rule runs these weights
        raise ConfigError(f"--weights {weights} is the dense host decode; a sparse bundle takes --cold-weights int8 "
                          "(predictors) or --weights q4_1 (thresholds)")
    if rule == PREDICTORS:
        raise ConfigError(f"a bundle's predictors run with --weights float32; --weights {weights} runs its thresholds")
    raise ConfigError(f"--hot-backend {hot_backend} runs a bundle's thresholds on float32 weights; "
                      f"--weights {weights} decodes them on the host (leave --hot-backend xla)")


def check_platform_runs(backend: Backend, weights: str, hot_backend: str, host_layers: int = 0) -> None:
    """ConfigError in one line when this JAX platform cannot run the backend: the host decode's FFI targets are
    registered for the CPU; "pallas" compiles for a GPU. host_layers: a layer split's layers on the host decode
    (with none, the split builds no host decoder)."""
    if backend.split:
        if host_layers:
            check_platform(jax.default_backend(), f"--offload-layers with {host_layers} layers left to the host decode",
                           "--offload-layers all runs every layer there")
    elif backend.host:
        check_platform(jax.default_backend(), f"--weights {weights} (the host decode)", "--weights float32 runs there")
    if hot_backend in PALLAS_BACKENDS:
        pallas_interpret(hot_backend)


def bundle_rule(bundle, asked: str = "auto") -> str:
    """Which of a bundle's sparse rules runs: THRESHOLDS (its calibrated input thresholds, `pjinfer calibrate`) or
    PREDICTORS (its predictors and placement). asked (--sparse-rule): "auto" is thresholds when the bundle has
    them, else predictors; a named rule runs as named. Reads the manifest only."""
    if asked not in SPARSE_RULES:
        raise ConfigError(f"sparse rule must be one of {', '.join(SPARSE_RULES)}, got {asked!r}")
    if asked != "auto":
        return asked
    return THRESHOLDS if THRESHOLDS in Bundle.open(bundle).manifest["stages"] else PREDICTORS


def check_bundle_stages(bundle, rule: str) -> None:
    """ConfigError (naming the command that makes it) when the bundle lacks a stage `rule` reads."""
    opened = Bundle.open(bundle)
    for stage in (THRESHOLDS,) if rule == THRESHOLDS else (PREDICTORS, "placement"):
        opened.require(stage)


@dataclasses.dataclass(frozen=True)
class Request:
    """What a user asked for (the CLI's --model, --weights, --bundle, --sparse-rule, --hot-backend,
    --cold-weights, --bridge). model None: the embedded default model."""
    model: str | os.PathLike | None = None
    weights: str = "auto"
    bundle: str | os.PathLike | None = None
    sparse_rule: str = "auto"
    hot_backend: str = "auto"   # config.HOT_CHOICES
    cold_weights: str = "float32"
    bridge: str = "auto"   # how a predictor bundle's step reaches its cold rows (cpu_offload.host_call.bridge_for)
    dense: bool = False   # a PowerInfer file without its predictors (--dense)
    parallel: bool = False   # split over the processes jax.distributed joined (tensor_parallel.Processes)
    offload_layers: int | str | None = None   # the first layers in XLA, the rest on the host: 0..n_layers or "all"


@dataclasses.dataclass(frozen=True)
class Plan:
    """A request resolved: the backend that runs it, with "auto" settled (weights, hot backend) and the bundle's
    rule; a layer split's (layers in XLA, layers in all), "all" settled; the powerinfer-hybrid row's placement (bool
    [n_layers, d_ff], read from the file's header or GPU index, before the weights)."""
    request: Request
    backend: Backend
    weights: str
    rule: str | None
    layers: tuple[int, int] | None = None
    placement: np.ndarray | None = dataclasses.field(default=None, compare=False)
    hot_backend: str = "xla"

    def on_float32(self) -> "Plan":
        """The same request on float32 weights (an "auto" whose host decode cannot run the loaded model)."""
        rule = None if self.backend.neuron_rows else self.rule
        backend = select("float32", rule, self.hot_backend, self.request.cold_weights)
        return dataclasses.replace(self, backend=backend, weights="float32", rule=rule)


def resolve(request: Request) -> Plan:
    """The plan for `request`, or ConfigError in one line, before any weight is read (headers, the bundle's
    manifest and the model's fingerprint are). "auto" weights: the checkpoint's own quantization where a backend
    runs it with this rule and hot backend on this platform (q4_1 for a GGUF whose layers are Q4_1, gguf for one
    whose layers are other block types with host kernels), else float32, said in one stderr line when the file's
    own format was passed over for a reason the user may not expect. "auto" hot backend: "pallas" for a PowerInfer
    file's own predictors where JAX runs on a GPU (its powerinfer-hybrid row; the powerinfer row that runs them
    elsewhere is the host decode's), "xla" otherwise."""
    r = request
    if r.weights not in WEIGHT_CHOICES:
        raise ConfigError(f"weights must be one of {', '.join(WEIGHT_CHOICES)}, got {r.weights!r}")
    if r.hot_backend not in HOT_CHOICES:
        raise ConfigError(f"hot backend must be one of {', '.join(HOT_CHOICES)}, got {r.hot_backend!r}")
    rule = None
    neuron_rows, has_predictors = file_layout(r.model)
    own_predictors = neuron_rows and has_predictors and r.bundle is None and not r.dense   # as PowerInfer runs it
    hot = r.hot_backend
    if hot == "auto":
        gpu_hybrid = own_predictors and r.weights in ("auto", "gguf") and jax.default_backend() == "gpu"
        hot = "pallas" if gpu_hybrid else "xla"
    if r.bundle is None:
        for flag, value, default in (("--sparse-rule", r.sparse_rule, "auto"), ("--hot-backend", hot, "xla"),
                                     ("--cold-weights", r.cold_weights, "float32"), ("--bridge", r.bridge, "auto")):
            if value != default and not (flag == "--hot-backend" and own_predictors):
                raise ConfigError(f"{flag} {value} applies to a sparse bundle (or, --hot-backend, to a PowerInfer file "
                                  "with its predictors); give --bundle DIR")
    else:
        if r.weights != "auto" and not any(b.rule and r.weights in b.weights for b in BACKENDS):
            select(r.weights, THRESHOLDS)   # no sparse row runs these weights: said before any file is read
        model = Path(r.model) if r.model else loader.default_model_path()
        if not model.exists():
            raise ConfigError(f"model not found: {model}")
        Bundle.open(r.bundle).check_model(loader.model_identity(model))
        rule = bundle_rule(r.bundle, r.sparse_rule)
        if r.weights != "auto":   # the settings before the stages: what cannot run says so first
            select(r.weights, rule, hot, r.cold_weights)
        bridge_for(r.bridge, jax.default_backend())
        check_bundle_stages(r.bundle, rule)
    if r.dense and not neuron_rows:
        raise ConfigError("--dense runs a PowerInfer file without its predictors; this model is not one")
    layers = None if r.offload_layers is None else split_layers(r)
    weights = (r.weights if r.weights != "auto" else
               _auto_weights(r, PREDICTORS if own_predictors else rule, hot, neuron_rows, layers is not None))
    if own_predictors and weights == "gguf":
        rule = PREDICTORS   # the file's own, as PowerInfer runs it
    # With a bundle, a PowerInfer file runs the bundle's rule on float32 (the loader lays its rows out as any file's).
    backend = select(weights, rule, hot, r.cold_weights, neuron_rows=neuron_rows and r.bundle is None,
                     parallel=r.parallel, split=layers is not None)
    check_platform_runs(backend, weights, hot, host_layers(layers))
    placement = None
    if backend.neuron_rows and not backend.host:   # the hybrid: its placement is read before the weights
        model = Path(r.model) if r.model else loader.default_model_path()
        placement = file_placement(model, loader.gguf_header(model)[1])
    return Plan(r, backend, weights, rule, layers, placement, hot)


def split_layers(r: Request) -> tuple[int, int]:
    """(layers in XLA, layers in all) of --offload-layers, read against the GGUF's header, or ConfigError in one
    line."""
    model = Path(r.model) if r.model else loader.default_model_path()
    if not model.is_file():
        raise ConfigError(f"--offload-layers splits the layers of a GGUF file; {model} is not one")
    n = loader.gguf_header(model)[1].n_layers
    k = n if r.offload_layers == "all" else r.offload_layers
    if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= n:
        raise ConfigError(f"--offload-layers {r.offload_layers}: the model has {n} layers (give 0 to {n}, or all)")
    return k, n


def host_layers(layers: tuple[int, int] | None) -> int:
    """How many layers a split leaves to the host decode (0 without a split)."""
    return 0 if layers is None else layers[1] - layers[0]


def _auto_weights(r: Request, rule: str | None, hot_backend: str, neuron_rows: bool, split: bool = False) -> str:
    stored = loader.stored_format(r.model)
    if neuron_rows and r.bundle is None:   # a PowerInfer file: its layers' own types on the host, where they have kernels
        stored = "gguf" if loader.layer_types(r.model) <= set(BY_NAME) | {"F16", "F32"} else None
    if stored is None:
        foreign = sorted((loader.layer_types(r.model) or set()) - set(BY_NAME) - {"F32", "F16", "BF16"})
        if foreign:
            print(f"pjinfer: running float32 weights: no host kernel reads type {', '.join(foreign)}", file=sys.stderr)
        return "float32"
    backend = next((b for b in BACKENDS if b.runs(stored, rule, hot_backend, neuron_rows, split=split)), None)
    if backend is None:
        return "float32"
    platform = jax.default_backend()
    if backend.host and platform != "cpu" and not split:   # a split's platform is checked with its layers
        hybrid = " (a PowerInfer file's hybrid runs there: --hot-backend pallas)" if neuron_rows else ""
        print(f"pjinfer: running float32 weights on the {platform}: the {stored} host decode runs where JAX runs "
              f"on the CPU{hybrid}", file=sys.stderr)
        return "float32"
    return stored


def build(backend: Backend, config, weights: dict, fmt: str, *, thresholds=None, hot_backend: str = "xla",
          predictors=None, device_layers: int = 0, placement=None):
    """The model a backend runs, and its host decoder (None when every step runs in XLA). weights: canonical
    weights (pjinfer.runtime.model), float32 arrays or quantized matrices (cpu_offload.qtensor); for the
    powerinfer rows the loader's neuron rows (pjinfer.runtime.predicted). fmt: the row's weights; thresholds
    [n_layers, 4] for the THRESHOLDS rows; predictors: a PowerInfer file's (pjinfer.load.powerinfer.Predictors)
    for the powerinfer rows, with `placement` (bool [n_layers, d_ff], hot on the accelerator) for the hybrid one;
    device_layers: the layer-split row's layers left in XLA on the stored blocks (the rest and the head are swapped
    for the host decoder's, which is not built when every layer stays). The hybrid row builds its dense float32
    model here; the engine then swaps its FFNs (Engine.use_bundle)."""
    if backend.parallel:
        return tensor_parallel.build(config, weights, fmt)
    if backend.neuron_rows and not backend.host:
        from pjinfer.runtime import powerinfer_hybrid   # Pallas with it (architecture.md, "Lazy imports")

        return powerinfer_hybrid.build(config, weights, predictors, placement, hot_backend), None
    if backend.neuron_rows:
        stored = {k: v.map(to_xla) if is_quantized(v) else v for k, v in weights.items()}
        model = Transformer(config, stored)
        return model, attach_powerinfer(model, config, stored, predictors, dense=predictors is None)
    if not backend.host:
        if any(is_quantized(w) for w in weights.values()):
            weights = float32_weights(weights)
        model = Transformer(config, weights)
        if thresholds is not None:
            set_thresholds(model, thresholds)
        if hot_backend in PALLAS_BACKENDS:
            gathered.attach(model, hot_backend)
        return model, None
    sparse = None
    if thresholds is not None:   # checks the model and lays the layers out by input column
        sparse = SparseHostDecoder(config, Float32View(weights), thresholds)
    stored = quantize_weights(config, weights, fmt, check=thresholds is None)
    stored = {k: v.map(to_xla) if is_quantized(v) else v for k, v in stored.items()}
    model = Transformer(config, stored)
    if device_layers == config.n_layers:   # a layer split with every layer in XLA
        return model, None
    decoder = sparse or HostDecoder(config, stored, fmt)
    host.attach(model, decoder, first=device_layers)
    if thresholds is not None:
        set_thresholds(model, thresholds)
    return model, decoder
