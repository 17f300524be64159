"""What the subcommands share: argument types and option groups, loading the model, one-line messages, and
result files written atomically."""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

from pjinfer.arguments import layer_count, positive_int
from pjinfer.config import BRIDGES, COLD_WEIGHTS, HOT_CHOICES, SPARSE_RULES, WEIGHT_CHOICES, ConfigError


def port(text: str) -> int:
    value = positive_int(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"a port is at most 65535, got {value}")
    return value


def weight_list(text: str) -> list[str]:
    formats = [f.strip() for f in text.split(",") if f.strip()]
    bad = [f for f in formats if f not in WEIGHT_CHOICES]
    if not formats or bad or len(set(formats)) != len(formats):
        raise argparse.ArgumentTypeError(f"expected distinct {' / '.join(WEIGHT_CHOICES)}, comma-separated, "
                                         f"got {text!r}")
    return formats


def sparse_options(p):
    p.add_argument("--bundle", help="sparse bundle (`make bundle`): run the hybrid sparse engine")
    p.add_argument("--sparse-rule", default="auto", choices=SPARSE_RULES,
                   help="which of the bundle's rules runs: auto (default): its input thresholds when it has them "
                   "(calibrate), else its predictors and placement")
    p.add_argument("--hot-backend", default="auto", choices=HOT_CHOICES,
                   help="predictors: where hot neurons run; thresholds on float32: where one-token products run. "
                   "xla, compiled Pallas kernels (GPU), Pallas interpret mode; auto (default): pallas for a "
                   "PowerInfer file's own predictors where JAX runs on a GPU, else xla")
    p.add_argument("--cold-weights", default="float32", choices=COLD_WEIGHTS,
                   help="cold rows in host memory as float32, or int8 with a scale per block of 64 (17/64 the bytes)")
    p.add_argument("--bridge", default="auto", choices=("auto", *BRIDGES),
                   help="predictors: how the step reaches the cold rows' host kernels. ffi: XLA FFI targets (JAX on "
                   "the CPU); callback: jax.pure_callback (any platform, the same numbers); auto (default): ffi on "
                   "the CPU, else callback")


def weight_options(p, many=False):
    p.add_argument("--weights", default="auto", type=weight_list if many else None,
                   choices=None if many else WEIGHT_CHOICES,
                   help=("comma-separated dense engines to run side by side, e.g. float32,q4_1; " if many else "")
                   + "auto (default): the file's own quantization where the host decode runs it (q4_1 for the "
                   "default model, gguf for Q8_0, Q4_0, Q5_x and K-quant files), float32 otherwise; float32: "
                   "every matrix in XLA (the exact reference); int8 (a scale per block of 64), q4_1 (the GGUF's "
                   "4-bit blocks, head int8) or gguf (every matrix in the file's own block type): one-token steps "
                   "on the host's Numba kernels (cpu_offload.host_decode), prefill through XLA on the same values")
    p.add_argument("--offload-layers", type=layer_count, metavar="K", help="llama.cpp's -ngl: the first K layers "
                   "run whole in XLA (the accelerator, or the CPU's XLA) on the file's blocks, the rest and the head on "
                   "the host decode; all: every layer and the head in XLA (default: the --weights path alone)")
    p.add_argument("--dense", action="store_true", help="a PowerInfer file: compute every neuron (by default it "
                   "runs sparse with its own predictors, as PowerInfer does)")


def sampling_options(p):
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default)")
    p.add_argument("--top-k", type=int, default=0, help="0 keeps every token")
    p.add_argument("--top-p", type=float, default=1.0, help="keep the most likely tokens whose probabilities "
                   "add up to this (1 keeps every token)")
    p.add_argument("--min-p", type=float, default=0.0, help="keep tokens at least this share as likely as the "
                   "most likely one (0 keeps every token)")
    p.add_argument("--repeat-penalty", type=float, default=1.0, help="penalty on the last 64 tokens' ids "
                   "(1 is none; llama.cpp's --repeat-penalty)")
    p.add_argument("--seed", type=int, help="sampling's random seed, in [0, 2**32); none or -1: a random one, "
                   "printed (greedy runs use no seed)")
    p.add_argument("--threads", type=positive_int, help="host threads of the CPU kernels, at most the cores this "
                   "process may use (default: all of them)")


def parallel_options(p):
    p.add_argument("--coordinator", metavar="HOST:PORT", help="tensor parallel: the address process 0 serves and "
                   "every process of the run joins (default $PJINFER_COORDINATOR); each holds 1/N of the model")
    p.add_argument("--num-processes", type=positive_int, help="tensor parallel: how many processes split the model "
                   "(default $PJINFER_NUM_PROCESSES)")
    p.add_argument("--process-id", type=int, help="tensor parallel: this process, 0..N-1 (default "
                   "$PJINFER_PROCESS_ID); process 0 writes the output, the others follow it")


def join(args) -> bool:
    """With --coordinator (or its environment variable): join the run's other processes before JAX starts
    (pjinfer.runtime.tensor_parallel.Processes). Process 0 writes the output; the others' standard output goes
    nowhere, and what native libraries print to file descriptor 1 (gloo's connection lines) goes to stderr. Sets
    args.parallel, which plan() reads. Returns whether this process follows process 0 (I > 0)."""
    from pjinfer.runtime.tensor_parallel import Processes

    processes = Processes.from_args(args.coordinator, args.num_processes, args.process_id)
    args.parallel = processes is not None
    if processes is not None:
        sys.stdout.flush()
        out = open(os.devnull, "w") if processes.index else os.fdopen(os.dup(1), "w")
        os.dup2(2, 1)
        sys.stdout = out
        processes.start()
    return processes is not None and processes.index > 0


def say(*parts):
    print(*parts, file=sys.stderr, flush=True)


def plan(args, bundle=None, weights=None):
    """How the model of --model runs (pjinfer.runtime.backends.resolve): --weights (or `weights`), and with
    `bundle` its rule and --sparse-rule, --hot-backend, --cold-weights, --bridge. Every setting, the bundle (made for this
    model, holding the stages its rule reads) and the platform are checked here, before any weight is read.
    Subcommands without --weights run float32."""
    from pjinfer.runtime import backends

    return backends.resolve(backends.Request(
        args.model, weights=weights or getattr(args, "weights", "float32"), bundle=bundle,
        sparse_rule=getattr(args, "sparse_rule", "auto"), hot_backend=getattr(args, "hot_backend", "auto"),
        cold_weights=getattr(args, "cold_weights", "float32"), bridge=getattr(args, "bridge", "auto"),
        dense=getattr(args, "dense", False), parallel=getattr(args, "parallel", False),
        offload_layers=getattr(args, "offload_layers", None)))


def load(args, bundle=None, weights=None, *, plan_made=None, until_first_token=False):
    """The model of --model, run as `plan_made` or else as plan(args, bundle, weights) says. Kernels compiled
    meanwhile (a cold cache) are announced in one line (compile_cache.kernel_notice), which ends here, or, with
    until_first_token, where the caller finishes it once the first token came (the first prompt compiles
    kernels of its own)."""
    from pjinfer.progress import Progress
    from pjinfer.runtime.compile_cache import enable_compilation_cache, kernel_notice
    from pjinfer.runtime.engine import Engine

    chosen = plan_made or plan(args, bundle, weights)
    check_host_threads()
    enable_compilation_cache()
    kernel_notice.start()
    engine = Engine.from_plan(chosen, progress=Progress("loading tensors", 0))
    if not until_first_token:
        kernel_notice.finish()
    return engine


def check_host_threads() -> None:
    """PJINFER_HOST_THREADS (set by the user, or by --threads) is a whole number no larger than the usable cores;
    checked here, before the model loads, rather than when the first host kernel starts the team."""
    from cpu_offload.team import default_size

    default_size()


def sampling(args):
    """The sampling settings of generate and chat, checked before the model loads; --threads checked and applied.
    The seed: --seed, or a random one when the run samples without one (runtime.sampling.choose_seed)."""

    from pjinfer.runtime.sampling import Sampling, choose_seed

    if args.threads:
        from cpu_offload.team import check_size

        check_size(args.threads, f"--threads {args.threads}")
        os.environ["PJINFER_HOST_THREADS"] = os.environ["PJINFER_COLD_THREADS"] = str(args.threads)
    seed = choose_seed(args.seed, args.temperature)
    return Sampling(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                    seed=0 if seed is None else seed, min_p=args.min_p, repeat_penalty=args.repeat_penalty)


def read_json(path) -> dict:

    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ConfigError(f"results file not found: {path}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path} is not a results JSON file ({e})") from None


def check_writable(path) -> None:
    """Refuses, in one line, an output path that a later write would fail on."""

    target = Path(path)
    if target.is_dir():
        raise ConfigError(f"--output {path} is a directory; give a file name")
    parent = target.parent
    if not parent.is_dir():
        raise ConfigError(f"--output {path}: directory {parent} does not exist")
    try:
        with tempfile.NamedTemporaryFile(dir=parent, prefix=f".{target.name}.", suffix=".tmp"):
            pass
    except OSError as e:
        raise ConfigError(f"--output {path} is not writable ({e.strerror})") from None
    if target.exists() and not os.access(target, os.W_OK):
        raise ConfigError(f"--output {path} is not writable")


def write_json(path, obj) -> None:
    """Atomic: a temporary file beside `path`, renamed over it; never a half-written results file or a stray temp.
    The file gets the mode any new file gets (0666 less the umask), not mkstemp's private 0600."""

    target = Path(path)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o666 & ~current_umask())
        with os.fdopen(fd, "w") as f:
            json.dump(obj, f, indent=1)
        os.replace(tmp, target)
    except BaseException:
        os.unlink(tmp)
        raise


def current_umask() -> int:
    """This process's umask (reading it means setting it: it is put straight back)."""

    mask = os.umask(0o022)
    os.umask(mask)
    return mask
