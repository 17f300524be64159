"""Command line: `pjinfer generate | perplexity | bench`. Every subcommand defaults to the embedded model."""
from __future__ import annotations

import argparse
import json
import sys
import time

from pjinfer.config import WEIGHT_FORMATS, ConfigError


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, not usage plus a message
        self.exit(2, f"pjinfer: error: {message} (see --help)\n")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="pjinfer", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    def command(name, help):
        p = sub.add_parser(name, help=help, description=help)
        p.add_argument("--model", help="GGUF file or Hugging Face directory (default: the embedded SmolLM2-135M)")
        p.add_argument("--json", action="store_true", help="print one JSON object")
        return p

    def sparse_options(p):
        p.add_argument("--bundle", help="sparse bundle (`make bundle`): run the hybrid sparse engine")
        p.add_argument("--hot-backend", default="xla", choices=("xla", "pallas", "pallas-interpret"),
                       help="hot neurons: XLA gather (CPU default), compiled Pallas (GPU), Pallas interpret mode")
        p.add_argument("--cold-weights", default="float32", choices=("float32", "int8"),
                       help="cold rows in host memory as float32, or int8 with a scale per block of 64 (17/64 the bytes)")

    def weight_options(p, many=False):
        p.add_argument("--weights", default="float32", type=_weight_list if many else None,
                       choices=None if many else WEIGHT_FORMATS,
                       help=("comma-separated dense engines to run side by side, e.g. float32,q4_1; " if many else "")
                       + "int8 (a scale per block of 64) or q4_1 (the GGUF's 4-bit blocks, head int8): one-token "
                       "steps on the host's Numba kernels (cpu_offload.host_decode), prefill through XLA on the "
                       "same values")

    p = command("generate", "generate text from a prompt, streamed as it comes")
    sparse_options(p)
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-new-tokens", type=_positive_int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default)")
    p.add_argument("--top-k", type=int, default=0, help="0 keeps every token")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    weight_options(p)

    p = command("perplexity", "perplexity of a text file (no BOS; consecutive windows from the start)")
    p.add_argument("--text-file", required=True)
    p.add_argument("--windows", type=_positive_int, default=4)
    p.add_argument("--window-len", type=_positive_int, default=256, help="tokens scored per window")
    sparse_options(p)
    weight_options(p)

    p = command("bench", "prefill and decode tokens per second of the jitted generate")
    p.add_argument("--prompt-len", type=_positive_int, default=16)
    p.add_argument("--new-tokens", type=_positive_int, default=128)
    p.add_argument("--runs", type=_positive_int, default=5)
    sparse_options(p)
    weight_options(p, many=True)
    p.add_argument("--breakdown", action="store_true", help="also time attention, FFN and head of one decode step")
    p.add_argument("--peer", choices=["llama-cpp"],
                   help="also run llama.cpp (llama-cpp-python, `make bench-peer`) on the same GGUF, alternating")

    p = command("eval", "downstream task accuracy (lm-evaluation-harness protocol), dense or with --bundle")
    p.add_argument("--tasks", help="comma-separated, e.g. piqa,hellaswag,winogrande,arc_easy,arc_challenge")
    p.add_argument("--limit", type=int, help="first N items of each task (MMLU: per subject)")
    p.add_argument("--num-fewshot", type=int, help="shots (MMLU: 5 from its dev split by default)")
    p.add_argument("--output", help="write the results JSON here")
    weight_options(p)
    p.add_argument("--compare", nargs=2, metavar=("A.json", "B.json"), help="print two result files side by side")
    sparse_options(p)

    p = command("profile", "measure how often each FFN neuron fires; starts (or refreshes) a sparse bundle")
    p.add_argument("--bundle", required=True, help="bundle directory (created if absent)")
    p.add_argument("--text-file", help="calibration text (default: the exllamav2 calibration set)")
    p.add_argument("--tokens", type=_positive_int, default=32768, help="tokens to profile (whole 1024-token calls)")
    p.add_argument("--sparsity", type=float, default=0.5,
                   help="target share of inactive neurons per layer for smooth activations (SwiGLU, GeGLU); "
                        "ignored for the ReLU family, where inactive means exactly zero")
    p.add_argument("--train-tokens", type=_positive_int, default=12288,
                   help="tokens kept for predictor training (memory: layers x tokens x d_model x 2 bytes)")

    p = command("calibrate", "fit input-sparsity thresholds (TEAL) into a bundle, for --weights q4_1 --bundle")
    p.add_argument("--bundle", required=True, help="bundle directory (created if absent)")
    p.add_argument("--target", type=float, default=0.4,
                   help="share of the layers' weights left unread per token, weighted by size (0 to 0.9)")
    p.add_argument("--text-file", help="calibration text (default: the exllamav2 calibration set, wiki's "
                                       "evaluation slice left out)")

    p = command("train-predictors", "train one low-rank activation predictor per layer (optax) on the profile")
    p.add_argument("--bundle", required=True)
    p.add_argument("--recall", type=float, default=0.95, help="held-back recall each layer must reach")
    p.add_argument("--max-rank", type=_positive_int, default=256, help="largest predictor rank tried")
    p.add_argument("--epochs", type=_positive_int, default=12)

    p = command("solve", "place neurons on the accelerator or the CPU with an integer linear program (pulp/CBC)")
    p.add_argument("--bundle", required=True)
    p.add_argument("--device-memory", required=True, help="accelerator memory for the model, e.g. 2GiB or 400MB")
    p.add_argument("--kv-tokens", type=_positive_int, default=2048, help="KV cache reserved on the accelerator")
    p.add_argument("--batch", type=_positive_int, default=64, help="neurons per ILP variable (similar frequency)")
    p.add_argument("--cpu-bandwidth", type=float, default=12e9, help="bytes/s of the CPU's cold-neuron kernels")
    p.add_argument("--device-bandwidth", type=float, default=2e12, help="bytes/s of the accelerator's memory")
    p.add_argument("--sync-us", type=float, default=20.0, help="one host-accelerator synchronisation, microseconds")
    return parser


def _say(*parts):
    print(*parts, file=sys.stderr, flush=True)


def _weight_list(text: str) -> list[str]:
    formats = [f.strip() for f in text.split(",") if f.strip()]
    bad = [f for f in formats if f not in WEIGHT_FORMATS]
    if not formats or bad or len(set(formats)) != len(formats):
        raise argparse.ArgumentTypeError(f"expected distinct {' / '.join(WEIGHT_FORMATS)}, comma-separated, "
                                         f"got {text!r}")
    return formats


def _load(args, bundle=None, weights=None):
    """The model of --model; sparse when `bundle` names a bundle to run with."""
    from pjinfer.engine import Engine
    from pjinfer.progress import Progress
    from pjinfer.runtime import enable_compilation_cache

    enable_compilation_cache()
    return Engine.load(args.model, bundle=bundle, hot_backend=getattr(args, "hot_backend", "xla"),
                       cold_weights=getattr(args, "cold_weights", "float32"),
                       weights=weights or getattr(args, "weights", "float32"),
                       progress=Progress("loading tensors", 0))


def cmd_generate(args):
    from pjinfer.runtime import CompileStats
    from pjinfer.sampling import Sampling
    from pjinfer.tokenizer import StreamDecoder

    sampling = Sampling(args.temperature, args.top_k, args.top_p, args.seed)
    engine = _load(args, args.bundle)
    tok = engine.tokenizer
    if args.chat:
        ids = tok.encode(tok.apply_chat([{"role": "user", "content": args.prompt}]), add_special=False)
    else:
        ids = tok.encode(args.prompt)
    engine.plan(len(ids), args.max_new_tokens)  # refuse an over-long prompt before compiling anything

    stats = CompileStats()
    start = time.perf_counter()
    if args.json:
        out = engine.generate(ids, max_new_tokens=args.max_new_tokens, sampling=sampling)
    else:
        out, decoder = [], StreamDecoder(tok)
        for token in engine.stream(ids, max_new_tokens=args.max_new_tokens, sampling=sampling):
            if len(out) == 1:  # the second token has paid for the decode step's compilation
                second = time.perf_counter()
            out.append(token)
            sys.stdout.write(decoder.push(token))
            sys.stdout.flush()
        sys.stdout.write("\n")
    elapsed = time.perf_counter() - start
    timing = {"load_s": round(engine.load_seconds, 3), "compile_s": round(stats.seconds, 3),
              "executables": stats.executables, "from_disk_cache": stats.cache_hits,
              "generate_s": round(elapsed, 3), "prompt_tokens": len(ids), "new_tokens": len(out)}
    if args.json:
        print(json.dumps({"text": tok.decode(out), "token_ids": out, **timing}))
    else:
        rate = f", {(len(out) - 2) / (time.perf_counter() - second):.1f} tok/s" if len(out) > 2 else ""
        _say(f"load {timing['load_s']:.1f} s, compile {timing['compile_s']:.1f} s "
             f"({stats.executables} executables, {stats.cache_hits} from the disk cache), "
             f"{len(out)} tokens in {elapsed:.1f} s{rate}")


def cmd_perplexity(args):
    from pjinfer import data

    text = data.read_text(args.text_file)
    engine = _load(args, args.bundle)
    ids = engine.tokenizer.encode(text, add_special=False)
    ppl, n = engine.perplexity(ids, windows=args.windows, window_len=args.window_len)
    result = {"perplexity": ppl, "tokens": n}
    if engine.bundle is not None:
        from pjinfer.sparse import skipped_share

        result["skipped"] = skipped_share(engine, ids[:args.window_len + 1])
    if args.json:
        print(json.dumps(result))
        return
    print(f"perplexity {ppl:.4f} over {n} tokens ({args.windows} windows of {args.window_len + 1})")
    if "skipped" in result:
        print(f"sparse: predictors skipped {100 * result['skipped']:.1f}% of FFN neurons (first window, all layers)")


def cmd_bench(args):
    from pjinfer import bench
    from pjinfer.progress import Progress

    if args.peer:
        from pjinfer.loader import default_model_path
        from pjinfer.peer import check_llama_cpp

        check_llama_cpp(args.model or default_model_path())
    engines = {("dense" if w == "float32" else f"dense-{w}"): _load(args, weights=w) for w in args.weights}
    if args.bundle:  # sparse against dense, measured in the same run: thresholds with q4_1, else predictors
        sparse_weights = "q4_1" if "q4_1" in args.weights else "float32"
        engines["sparse"] = _load(args, args.bundle, weights=sparse_weights)
    result = bench.run(engines, prompt_len=args.prompt_len, new_tokens=args.new_tokens, runs=args.runs,
                       peer=args.peer, progress=Progress("bench runs", args.runs))
    if args.breakdown:
        for name, engine in engines.items():
            result["engines"][name]["breakdown"] = bench.breakdown(engine)
    if args.bundle:
        dense = "dense-q4_1" if sparse_weights == "q4_1" else "dense"
        result["sparse_over_dense"] = result["engines"]["sparse"]["decode_over"][dense]
    if args.json:
        print(json.dumps(result))
        return
    bandwidth = result["read_bandwidth_gb_s"]
    print(f"prompt {args.prompt_len} tokens, {args.new_tokens} new tokens, median of {args.runs} runs; "
          f"measured read bandwidth {bandwidth:.1f} GB/s")
    print(f"{'engine':10} {'prefill tok/s':>13} {'decode tok/s':>12} {'ms/token':>8} {'MB/token':>8} "
          f"{'of bandwidth':>12}" + (f" {'decode vs llama.cpp':>19}" if args.peer else ""))
    for name, r in result["engines"].items():
        mb = r["bytes_per_token"] / 1e6
        ratio = f" {r['decode_over_peer']:18.2f}x" if "decode_over_peer" in r else (" " * 20 if args.peer else "")
        print(f"{name:10} {r['prefill_tok_s']:13.1f} {r['decode_tok_s']:12.1f} {r['decode_ms_per_token']:8.1f} "
              f"{mb:8.1f} {100 * mb * r['decode_tok_s'] / 1e3 / bandwidth:11.0f}%" + ratio)
        if "breakdown" in r:
            b = r["breakdown"]
            print(f"  {name} decode step: " + ", ".join(f"{k[:-3]} {v:.1f} ms ({100 * v / b['step_ms']:.0f}%)"
                                                        for k, v in b.items() if k != "step_ms")
                  + f"; step {b['step_ms']:.1f} ms")
    if args.bundle:
        print(f"sparse decode / {dense} decode: {result['sparse_over_dense']:.2f}x (median of the runs' ratios)")


def cmd_eval(args):
    from pjinfer import evaluate

    if args.compare:
        a, b = (_read_json(f) for f in args.compare)
        print(evaluate.compare_table(a, b))
        return
    if not args.tasks:
        raise ConfigError("give --tasks (or --compare A.json B.json)")
    if args.limit is not None and args.limit < 1:
        raise ConfigError(f"--limit must be >= 1, got {args.limit}")
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    evaluate.check_tasks(tasks)  # before the model loads
    engine = _load(args, args.bundle)
    results = evaluate.evaluate(engine, tasks, limit=args.limit, num_fewshot=args.num_fewshot)
    if args.output:
        _write_json(args.output, results)
    print(json.dumps(results) if args.json else evaluate.format_table(results))


def _read_json(path) -> dict:
    from pathlib import Path

    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ConfigError(f"results file not found: {path}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path} is not a results JSON file ({e})") from None


def _write_json(path, obj) -> None:
    import os

    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
    os.replace(tmp, path)  # never a half-written results file


def cmd_profile(args):
    from pjinfer import offline
    from pjinfer.profile import EXACT_ACTIVATIONS
    from pjinfer.progress import Progress

    engine = _load(args)
    sparsity = None if engine.config.activation in EXACT_ACTIVATIONS else args.sparsity
    offline.run_profile(engine, args.bundle, text_file=args.text_file, tokens=args.tokens, sparsity=sparsity,
                        train_tokens=args.train_tokens, progress=Progress("profiling", 0, " tok"))


def cmd_calibrate(args):
    from pjinfer import teal
    from pjinfer.progress import Progress

    if not 0.0 <= args.target <= teal.MAX_TARGET:  # before the model loads
        raise ConfigError(f"--target must be in [0, {teal.MAX_TARGET}], got {args.target}")
    teal.run_calibrate(_load(args, weights="float32"), args.bundle, target=args.target, text_file=args.text_file,
                       progress=Progress("calibrating", 0, " layers"))


def cmd_train_predictors(args):
    from pjinfer import offline
    from pjinfer.progress import Progress

    offline.run_train(_load(args), args.bundle, recall=args.recall, max_rank=args.max_rank, epochs=args.epochs,
                      progress=Progress("training predictors", 0, " layers"))


def cmd_solve(args):
    from pjinfer import offline, policy

    device_memory = policy.parse_bytes(args.device_memory)
    for name in ("cpu_bandwidth", "device_bandwidth"):
        if not getattr(args, name) > 0:
            raise ConfigError(f"--{name.replace('_', '-')} must be positive")
    if not args.sync_us >= 0:
        raise ConfigError("--sync-us must be >= 0")
    hardware = policy.Hardware(args.cpu_bandwidth, args.device_bandwidth, args.sync_us * 1e-6)
    offline.run_solve(_load(args), args.bundle, device_memory=device_memory, kv_tokens=args.kv_tokens,
                      batch=args.batch, hardware=hardware)


COMMANDS = {"generate": cmd_generate, "perplexity": cmd_perplexity, "bench": cmd_bench, "eval": cmd_eval,
            "profile": cmd_profile, "calibrate": cmd_calibrate,
            "train-predictors": cmd_train_predictors, "solve": cmd_solve}


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        COMMANDS[args.command](args)
    except ConfigError as e:
        _say(f"pjinfer: error: {e}")
        return 2
    except KeyboardInterrupt:
        _say("pjinfer: interrupted")
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
