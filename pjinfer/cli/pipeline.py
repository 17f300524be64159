"""`pjinfer profile`, `calibrate`, `train-predictors`, `solve` and `import-powerinfer`: the offline pipeline's
stages, each adding its part to a sparse bundle."""
from __future__ import annotations

from pathlib import Path

from pjinfer.cli import common
from pjinfer.config import ConfigError
from pjinfer.load import data


def add_commands(command) -> None:
    """Register this module's subcommands: command(name, function, help) -> their parser."""
    p = command("profile", cmd_profile, "measure how often each FFN neuron fires; starts (or refreshes) a sparse bundle")
    p.add_argument("--bundle", required=True, help="bundle directory (created if absent)")
    p.add_argument("--text-file", help="calibration text (default: the exllamav2 calibration set)")
    p.add_argument("--tokens", type=common.positive_int, default=32768, help="tokens to profile (whole 1024-token calls)")
    p.add_argument("--sparsity", type=float, default=0.5,
                   help="target share of inactive neurons per layer for smooth activations (SwiGLU, GeGLU); "
                        "ignored for the ReLU family, where inactive means exactly zero")
    p.add_argument("--train-tokens", type=common.positive_int, default=12288,
                   help="tokens kept for predictor training (memory: layers x tokens x d_model x 2 bytes)")

    p = command("calibrate", cmd_calibrate, "fit input-sparsity thresholds (TEAL) into a bundle, for --weights q4_1 --bundle")
    p.add_argument("--bundle", required=True, help="bundle directory (created if absent)")
    p.add_argument("--target", type=float, default=0.3,
                   help="sparsity level of every matrix input: the share of the layers' weights left unread per token "
                        "(0 to 0.9; default 0.3, +1.6%% perplexity on the default model)")
    p.add_argument("--text-file", help="calibration text (default: the exllamav2 calibration set, wiki's "
                                       "evaluation slice left out)")

    p = command("train-predictors", cmd_train_predictors, "train one low-rank activation predictor per layer (optax) on the profile")
    p.add_argument("--bundle", required=True)
    p.add_argument("--recall", type=float, default=0.95, help="held-back recall each layer must reach")
    p.add_argument("--max-rank", type=common.positive_int, default=256, help="largest predictor rank tried")
    p.add_argument("--epochs", type=common.positive_int, default=12, help="passes over the profile")

    p = command("solve", cmd_solve, "place neurons on the accelerator or the CPU with an integer linear program (pulp/CBC)")
    p.add_argument("--bundle", required=True)
    p.add_argument("--device-memory", required=True, help="accelerator memory for the model, e.g. 2GiB or 400MB")
    p.add_argument("--kv-tokens", type=common.positive_int, default=2048, help="KV cache reserved on the accelerator")
    p.add_argument("--batch", type=common.positive_int, default=64, help="neurons per ILP variable (similar frequency)")
    p.add_argument("--cpu-bandwidth", type=float, default=12e9, help="bytes/s of the CPU's cold-neuron kernels")
    p.add_argument("--device-bandwidth", type=float, default=2e12, help="bytes/s of the accelerator's memory")
    p.add_argument("--sync-us", type=float, default=20.0, help="one host-accelerator synchronisation, microseconds")

    p = command("import-powerinfer", cmd_import_powerinfer,
                "a PowerInfer GGUF's own predictors (and its neuron placement, when it has one) as a bundle's "
                "predictors and placement stages")
    p.add_argument("--bundle", required=True, help="bundle directory (created if absent)")
    p.add_argument("--gpu-index", help="PowerInfer's GPU index (gpu_idx / gpu_bucket tensors) to take the placement "
                                       "from (default: MODEL.generated.gpuidx beside the model when it exists, else "
                                       "the model file's own gpu_idx tensors)")


def cmd_profile(args):
    from cpu_offload.activation import EXACT_ZERO
    from pjinfer.offline import stages
    from pjinfer.progress import Progress

    if args.text_file:
        data.read_text(args.text_file)  # a missing or empty file fails before the model loads
    engine = common.load(args)
    sparsity = None if engine.config.activation in EXACT_ZERO else args.sparsity
    stages.run_profile(engine, args.bundle, text_file=args.text_file, tokens=args.tokens, sparsity=sparsity,
                        train_tokens=args.train_tokens, progress=Progress("profiling", 0, " tok"))


def cmd_calibrate(args):
    from pjinfer.offline import stages
    from pjinfer.offline import teal
    from pjinfer.progress import Progress

    if not 0.0 <= args.target <= teal.MAX_TARGET:  # before the model loads
        raise ConfigError(f"--target must be in [0, {teal.MAX_TARGET}], got {args.target}")
    stages.run_calibrate(common.load(args, weights="float32"), args.bundle, target=args.target,
                          text_file=args.text_file, progress=Progress("calibrating", 0, " passes"))


def cmd_train_predictors(args):
    from pjinfer.offline import stages
    from pjinfer.progress import Progress

    if not 0 < args.recall < 1:
        raise ConfigError(f"--recall must be in (0, 1), got {args.recall}")
    common.plan(args, args.bundle)   # the bundle is made for this model, with the stages it needs
    stages.run_train(common.load(args), args.bundle, recall=args.recall, max_rank=args.max_rank, epochs=args.epochs,
                      progress=Progress("training predictors", 0, " layers"))


def cmd_solve(args):
    from pjinfer.offline import policy
    from pjinfer.offline import stages

    device_memory = policy.parse_bytes(args.device_memory)
    for name in ("cpu_bandwidth", "device_bandwidth"):
        if not getattr(args, name) > 0:
            raise ConfigError(f"--{name.replace('_', '-')} must be positive")
    if not args.sync_us >= 0:
        raise ConfigError("--sync-us must be >= 0")
    hardware = policy.Hardware(args.cpu_bandwidth, args.device_bandwidth, args.sync_us * 1e-6)
    common.plan(args, args.bundle)   # the bundle is made for this model, with the stages it needs
    stages.run_solve(common.load(args), args.bundle, device_memory=device_memory, kv_tokens=args.kv_tokens,
                      batch=args.batch, hardware=hardware)


def cmd_import_powerinfer(args):
    from pjinfer.load.loader import default_model_path
    from pjinfer.offline import powerinfer

    powerinfer.run_import(Path(args.model) if args.model else default_model_path(), args.bundle,
                          gpu_index=args.gpu_index)
