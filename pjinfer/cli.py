"""Command line: `pjinfer generate | chat | serve | perplexity | bench | eval | profile | train-predictors | solve`.

Every subcommand defaults to the embedded model (SmolLM2-135M-Instruct)."""
from __future__ import annotations

import argparse
import json
import sys
import time

from pjinfer.config import WEIGHT_CHOICES, ConfigError


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


def _port(text: str) -> int:
    value = _positive_int(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"a port is at most 65535, got {value}")
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
        p.add_argument("--weights", default="auto", type=_weight_list if many else None,
                       choices=None if many else WEIGHT_CHOICES,
                       help=("comma-separated dense engines to run side by side, e.g. float32,q4_1; " if many else "")
                       + "auto (default): the file's own quantization where the host decode runs it (q4_1 for the "
                       "default model, gguf for Q8_0, Q4_0, Q5_x and K-quant files), float32 otherwise; float32: "
                       "every matrix in XLA (the exact reference); int8 (a scale per block of 64), q4_1 (the GGUF's "
                       "4-bit blocks, head int8) or gguf (every matrix in the file's own block type): one-token steps "
                       "on the host's Numba kernels (cpu_offload.host_decode), prefill through XLA on the same values")

    def sampling_options(p):
        p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default)")
        p.add_argument("--top-k", type=int, default=0, help="0 keeps every token")
        p.add_argument("--top-p", type=float, default=1.0)
        p.add_argument("--min-p", type=float, default=0.0, help="keep tokens at least this share as likely as the "
                       "most likely one (0 keeps every token)")
        p.add_argument("--repeat-penalty", type=float, default=1.0, help="penalty on the last 64 tokens' ids "
                       "(1 is none; llama.cpp's --repeat-penalty)")
        p.add_argument("--seed", type=int, default=0, help="in [0, 2**32)")
        p.add_argument("--threads", type=_positive_int, help="host threads of the CPU kernels (default: every CPU)")

    p = command("generate", "generate text from a prompt, streamed as it comes")
    sparse_options(p)
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", help="the prompt text")
    source.add_argument("--prompt-file", help="read the prompt from this file (UTF-8); - reads standard input")
    p.add_argument("--max-new-tokens", type=_positive_int, default=64)
    p.add_argument("--stop", action="append", default=[], metavar="STR",
                   help="stop before this text (repeatable); the model's end-of-text tokens always stop")
    sampling_options(p)
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    weight_options(p)

    p = command("chat", "talk with the model: multi-turn, replies streamed (/reset, /exit, Ctrl-C stops a reply)")
    p.add_argument("--system", help="system message that opens the conversation")
    p.add_argument("--max-new-tokens", type=_positive_int, default=256, help="the longest reply")
    sampling_options(p)
    weight_options(p)

    p = command("serve", "an OpenAI-compatible HTTP server (completions, chat completions, streaming)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=_port, default=8080)
    p.add_argument("--api-key", help="require `Authorization: Bearer KEY` on /v1 requests")
    p.add_argument("--max-batch", type=_positive_int, default=8, help="requests decoding at once; more wait")
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
    bad = [f for f in formats if f not in WEIGHT_CHOICES]
    if not formats or bad or len(set(formats)) != len(formats):
        raise argparse.ArgumentTypeError(f"expected distinct {' / '.join(WEIGHT_CHOICES)}, comma-separated, "
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


def _sampling(args):
    """The sampling settings of generate and chat, checked before the model loads; --threads applied."""
    import os

    from pjinfer.sampling import Sampling

    if args.threads:
        os.environ["PJINFER_HOST_THREADS"] = os.environ["PJINFER_COLD_THREADS"] = str(args.threads)
    return Sampling(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                    min_p=args.min_p, repeat_penalty=args.repeat_penalty)


def _prompt_text(args) -> str:
    """--prompt, or --prompt-file (- for standard input), as text; refuses what is not UTF-8 or is empty."""
    if args.prompt is not None:
        text = args.prompt
        try:
            text.encode("utf-8")    # argv that was not UTF-8 arrives with surrogate escapes
        except UnicodeEncodeError:
            raise ConfigError("the prompt is not valid UTF-8") from None
    else:
        name = "standard input" if args.prompt_file == "-" else args.prompt_file
        try:
            data = sys.stdin.buffer.read() if args.prompt_file == "-" else open(args.prompt_file, "rb").read()
            text = data.decode("utf-8")
        except FileNotFoundError:
            raise ConfigError(f"prompt file not found: {args.prompt_file}") from None
        except IsADirectoryError:
            raise ConfigError(f"prompt file {args.prompt_file} is a directory") from None
        except UnicodeDecodeError:
            raise ConfigError(f"the prompt in {name} is not valid UTF-8") from None
    if not text.strip():
        raise ConfigError("the prompt is empty")
    return text


def _check_bundle(args, path) -> None:
    """Before any weights load: the model file exists and the bundle at `path` is a pjinfer bundle made for it
    (manifest and model hash; the stages themselves are read when the engine takes the bundle)."""
    from pathlib import Path

    from pjinfer.bundle import Bundle
    from pjinfer.engine import check_bundle_weights
    from pjinfer.loader import default_model_path, model_identity

    weights = getattr(args, "weights", "float32")
    if isinstance(weights, str):
        check_bundle_weights(weights, path)
    model = Path(args.model) if args.model else default_model_path()
    if not model.exists():
        raise ConfigError(f"model not found: {model}")
    Bundle.open(path).check_model(model_identity(model))


def cmd_generate(args):
    from pjinfer.runtime import CompileStats
    from pjinfer.tokenizer import StreamDecoder

    sampling = _sampling(args)
    prompt = _prompt_text(args)
    if any(not stop for stop in args.stop):
        raise ConfigError("--stop needs a non-empty string")
    if args.bundle:
        _check_bundle(args, args.bundle)
    engine = _load(args, args.bundle)
    tok = engine.tokenizer
    if args.chat:
        ids = tok.encode(tok.apply_chat([{"role": "user", "content": prompt}]), add_special=False)
    else:
        ids = tok.encode(prompt)
    engine.plan(len(ids), args.max_new_tokens)  # refuse an over-long prompt before compiling anything

    # Streamed token by token, --json too: stop strings are checked between tokens, Ctrl-C keeps what was made.
    stats = CompileStats()
    out, interrupted = [], False
    decoder = StreamDecoder(tok, args.stop)
    marks = [time.perf_counter()]                 # start, then after each token
    try:
        for token in engine.stream(ids, max_new_tokens=args.max_new_tokens, sampling=sampling):
            out.append(token)
            piece = decoder.push(token)
            marks.append(time.perf_counter())
            if not args.json:
                sys.stdout.write(piece)
                sys.stdout.flush()
            if decoder.stop is not None:
                break
    except KeyboardInterrupt:
        interrupted = True
    rest = decoder.flush()
    if not args.json:
        sys.stdout.write(rest + "\n")
    text, stopped_by = decoder.text, decoder.stop
    timing = _generate_timing(engine, stats, marks, len(ids), len(out))
    if args.json:
        print(json.dumps({"text": text, "token_ids": out, "stop": stopped_by, "interrupted": interrupted,
                          "weights": engine.weights_format, "sparse": engine.bundle is not None, **timing}))
    else:
        decode = f", decode {timing['decode_tok_s']:.1f} tok/s" if timing["decode_tok_s"] else ""
        _say(f"load {timing['load_s']:.1f} s, compile {timing['compile_s']:.1f} s "
             f"({stats.executables} executables, {stats.cache_hits} from the disk cache), "
             f"prefill {len(ids)} tokens {timing['prefill_s']:.2f} s, {len(out)} tokens{decode} [{engine.path}]")
    if interrupted:
        raise KeyboardInterrupt


def _generate_timing(engine, stats, marks, prompt_tokens, new_tokens) -> dict:
    """prefill_s: start to the first token (prefill and, on a cold cache, its compilation); decode_tok_s: from the
    second token on, past the decode step's compilation (None with fewer than three tokens)."""
    decode = (new_tokens - 2) / (marks[-1] - marks[2]) if new_tokens > 2 and marks[-1] > marks[2] else None
    return {"load_s": round(engine.load_seconds, 3), "compile_s": round(stats.seconds, 3),
            "executables": stats.executables, "from_disk_cache": stats.cache_hits,
            "prefill_s": round(marks[1] - marks[0], 3) if new_tokens else None,
            "decode_tok_s": round(decode, 2) if decode else None,
            "generate_s": round(marks[-1] - marks[0], 3), "prompt_tokens": prompt_tokens, "new_tokens": new_tokens}


def cmd_chat(args):
    from pjinfer.chat import Conversation, repl

    sampling = _sampling(args)
    engine = _load(args)
    repl(Conversation(engine, system=args.system, max_new_tokens=args.max_new_tokens, sampling=sampling))


def cmd_serve(args):
    import logging

    from pjinfer.server import Server, serve

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s", stream=sys.stderr)
    logging.getLogger("pjinfer").setLevel(logging.INFO)     # one line per request
    server = Server(_load(args), api_key=args.api_key, max_active=args.max_batch)
    _say(f"pjinfer: serving {server.name} on http://{args.host}:{args.port}/v1 [{server.engine.path}]")
    serve(server, host=args.host, port=args.port)


def cmd_perplexity(args):
    from pjinfer import data

    text = data.read_text(args.text_file)
    if args.bundle:
        _check_bundle(args, args.bundle)
    engine = _load(args, args.bundle)
    ids = engine.tokenizer.encode(text, add_special=False)
    start = time.perf_counter()
    ppl, n = engine.perplexity(ids, windows=args.windows, window_len=args.window_len)
    seconds = time.perf_counter() - start
    result = {"perplexity": ppl, "tokens": n, "weights": engine.weights_format, "load_s": round(engine.load_seconds, 3),
              "seconds": round(seconds, 3), "tok_s": round(n / seconds, 1)}
    _say(f"load {engine.load_seconds:.1f} s; scored {n} tokens in {seconds:.1f} s ({n / seconds:.0f} tok/s, "
         f"compilation included) [{engine.path}]")
    if engine.bundle is not None and engine.thresholds is None:   # the predictors' share; thresholds: manifest
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
    if args.bundle:
        _check_bundle(args, args.bundle)
    from pjinfer.engine import resolve_weights

    def engine_name(weights):
        return "dense" if weights == "float32" else f"dense-{weights}"

    formats = [resolve_weights(w, args.model) for w in args.weights]
    if len(set(formats)) != len(formats):
        raise ConfigError(f"--weights {','.join(args.weights)} runs the same engine twice ({', '.join(formats)})")
    sparse_weights = resolve_weights("auto", args.model, args.bundle) if args.bundle else None
    if sparse_weights and sparse_weights not in formats:
        formats.append(sparse_weights)   # sparse is measured against the dense engine of its own weights
    engines = {engine_name(w): _load(args, weights=w) for w in formats}
    if args.bundle:  # sparse against dense, measured in the same run: thresholds with q4_1, else predictors
        engines["sparse"] = _load(args, args.bundle, weights=sparse_weights)
    result = bench.run(engines, prompt_len=args.prompt_len, new_tokens=args.new_tokens, runs=args.runs,
                       peer=args.peer, progress=Progress("bench runs", args.runs))
    if args.breakdown:
        for name, engine in engines.items():
            result["engines"][name]["breakdown"] = bench.breakdown(engine)
    if args.bundle:
        result["sparse_over_dense"] = result["engines"]["sparse"]["decode_over"][engine_name(sparse_weights)]
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
        print(f"sparse decode / {engine_name(sparse_weights)} decode: {result['sparse_over_dense']:.2f}x "
              "(median of the runs' ratios)")


def cmd_eval(args):
    from pjinfer import evaluate

    if args.compare:
        a, b = (evaluate.check_results(_read_json(f), f) for f in args.compare)
        for line in evaluate.count_mismatches(a, b):
            _say(f"pjinfer: warning: {line}")
        print(evaluate.compare_table(a, b))
        return
    if not args.tasks:
        raise ConfigError("give --tasks (or --compare A.json B.json)")
    if args.limit is not None and args.limit < 1:
        raise ConfigError(f"--limit must be >= 1, got {args.limit}")
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    evaluate.check_tasks(tasks)  # before the model loads
    if args.output:
        _check_writable(args.output)  # before the evaluation runs, not after
    if args.bundle:
        _check_bundle(args, args.bundle)
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


def _check_writable(path) -> None:
    """Refuses, in one line, an output path that a later write would fail on."""
    import os
    import tempfile
    from pathlib import Path

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


def _write_json(path, obj) -> None:
    """Atomic: a temporary file beside `path`, renamed over it; never a half-written results file or a stray temp."""
    import os
    import tempfile
    from pathlib import Path

    target = Path(path)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(obj, f, indent=1)
        os.replace(tmp, target)
    except BaseException:
        os.unlink(tmp)
        raise


def cmd_profile(args):
    from pjinfer import offline
    from pjinfer.activations import EXACT_ZERO
    from pjinfer import data
    from pjinfer.progress import Progress

    if args.text_file:
        data.read_text(args.text_file)  # a missing or empty file fails before the model loads
    engine = _load(args)
    sparsity = None if engine.config.activation in EXACT_ZERO else args.sparsity
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

    if not 0 < args.recall < 1:
        raise ConfigError(f"--recall must be in (0, 1), got {args.recall}")
    _check_bundle(args, args.bundle)
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
    _check_bundle(args, args.bundle)
    offline.run_solve(_load(args), args.bundle, device_memory=device_memory, kv_tokens=args.kv_tokens,
                      batch=args.batch, hardware=hardware)


COMMANDS = {"generate": cmd_generate, "chat": cmd_chat, "serve": cmd_serve, "perplexity": cmd_perplexity,
            "bench": cmd_bench, "eval": cmd_eval, "profile": cmd_profile, "calibrate": cmd_calibrate,
            "train-predictors": cmd_train_predictors, "solve": cmd_solve}


def main(argv=None) -> int:
    """Run one subcommand; returns the exit status. Bad arguments exit 2 from the parser. An expected failure (a
    ConfigError, or any OSError or ValueError: a missing or unreadable file, a malformed checkpoint) prints one
    line `pjinfer: error: ...` on stderr and returns 2; any other exception propagates with its traceback, so
    bugs stay visible."""
    args = build_parser().parse_args(argv)
    try:
        COMMANDS[args.command](args)
    except (OSError, ValueError) as e:  # ConfigError is a ValueError
        message = " ".join(str(e).split()) or type(e).__name__
        _say(f"pjinfer: error: {message}")
        return 2
    except KeyboardInterrupt:
        _say("pjinfer: interrupted")
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
