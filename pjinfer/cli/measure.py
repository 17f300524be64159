"""`pjinfer perplexity`, `bench` and `eval`: measuring the model, dense or sparse."""
from __future__ import annotations

import json
import time

from pjinfer.cli import common
from pjinfer.config import ConfigError
from pjinfer.load import data


def add_commands(command) -> None:
    """Register this module's subcommands: command(name, function, help) -> their parser."""
    p = command("perplexity", cmd_perplexity, "perplexity of a text file (no BOS; consecutive windows from the start)",
                json=True)
    p.add_argument("--text-file", required=True)
    p.add_argument("--windows", type=common.positive_int, default=4, help="windows scored")
    p.add_argument("--window-len", type=common.positive_int, default=256, help="tokens scored per window")
    common.sparse_options(p)
    common.weight_options(p)
    common.parallel_options(p)

    p = command("bench", cmd_bench, "prefill and decode tokens per second of the jitted generate", json=True)
    p.add_argument("--prompt-len", type=common.positive_int, default=16, help="prompt tokens")
    p.add_argument("--new-tokens", type=common.positive_int, default=128, help="tokens generated per run")
    p.add_argument("--runs", type=common.positive_int, default=5, help="timed runs of each engine")
    common.sparse_options(p)
    common.weight_options(p, many=True)
    p.add_argument("--breakdown", action="store_true",
                   help="also time one decode step part by part (the host decode stage by stage)")
    p.add_argument("--peer", choices=["llama-bench", "powerinfer", "llama-cpp"],
                   help="also run a peer on the same GGUF, alternating: llama.cpp's llama-bench or PowerInfer's main "
                        "(native, `make peers`), or llama-cpp-python's token loop (`make bench-peer`)")
    common.sampling_options(p)   # how pjinfer's engines choose each token (the peer chooses its own way)

    p = command("eval", cmd_eval, "downstream task accuracy (lm-evaluation-harness protocol), dense or with --bundle",
                json=True)
    p.add_argument("--tasks", help="comma-separated, e.g. piqa,hellaswag,winogrande,arc_easy,arc_challenge")
    p.add_argument("--limit", type=int, help="first N items of each task (MMLU: per subject)")
    p.add_argument("--num-fewshot", type=int, help="shots (MMLU: 5 from its dev split by default)")
    p.add_argument("--output", help="write the results JSON here")
    common.weight_options(p)
    p.add_argument("--compare", nargs=2, metavar=("A.json", "B.json"), help="print two result files side by side")
    common.sparse_options(p)
    common.parallel_options(p)


def cmd_perplexity(args):
    text = data.read_text(args.text_file)
    common.join(args)
    engine = common.load(args, args.bundle)
    ids = engine.tokenizer.encode(text, add_special=False)
    start = time.perf_counter()
    ppl, n = engine.perplexity(ids, windows=args.windows, window_len=args.window_len)
    seconds = time.perf_counter() - start
    result = {"perplexity": ppl, "tokens": n, "weights": engine.weights_format, "load_s": round(engine.load_seconds, 3),
              "seconds": round(seconds, 3), "tok_s": round(n / seconds, 1)}
    common.say(f"load {engine.load_seconds:.1f} s; scored {n} tokens in {seconds:.1f} s ({n / seconds:.0f} tok/s, "
         f"compilation included) [{engine.path}]")
    if engine.bundle is not None and engine.thresholds is None:   # the predictors' share; thresholds: manifest
        from pjinfer.runtime.sparse import skipped_share

        result["skipped"] = skipped_share(engine, ids[:args.window_len + 1])
    if args.json:
        print(json.dumps(result))
        return
    print(f"perplexity {ppl:.4f} over {n} tokens ({args.windows} windows of {args.window_len + 1})")
    if "skipped" in result:
        print(f"sparse: predictors skipped {100 * result['skipped']:.1f}% of FFN neurons (first window, all layers)")


def cmd_bench(args):
    from pjinfer.measure import bench, machine
    from pjinfer.progress import Progress

    sampling = common.sampling(args)
    if args.peer:
        check_peer(args.peer, args.model)
    from pjinfer.load.powerinfer import file_layout
    from pjinfer.runtime import backends

    # A PowerInfer file runs sparse on its own predictors unless --dense: then that is the sparse engine, measured
    # against the same file dense, as a bundle's is against the dense engine of its weights.
    own_predictors = args.bundle is None and not args.dense and file_layout(args.model) == (True, True)

    def dense_plan(weights):   # the sparse options are the sparse engine's (refused without --bundle)
        if args.bundle is None and not own_predictors:
            return common.plan(args, weights=weights)
        return backends.resolve(backends.Request(args.model, weights=weights, dense=own_predictors))

    dense = [dense_plan(w) for w in args.weights]
    formats = [p.weights for p in dense]
    if len(set(formats)) != len(formats):
        raise ConfigError(f"--weights {','.join(args.weights)} runs the same engine twice ({', '.join(formats)})")
    sparse = common.plan(args, args.bundle, weights="auto") if args.bundle or own_predictors else None
    if sparse and sparse.weights not in formats:
        dense.append(dense_plan(sparse.weights))   # sparse is measured against the dense engine of its own weights
    engines = {bench.engine_name(p.weights, p.layers): common.load(args, plan_made=p) for p in dense}
    if sparse:
        engines["sparse"] = common.load(args, plan_made=sparse)
    result = bench.run(engines, prompt_len=args.prompt_len, new_tokens=args.new_tokens, runs=args.runs,
                       peer=args.peer, progress=Progress("bench runs", args.runs), sampling=sampling)
    if args.breakdown:
        for name, engine in engines.items():
            result["engines"][name]["breakdown"] = bench.breakdown(
                engine, result["engines"][name]["decode_ms_per_token"], prompt_len=args.prompt_len,
                new_tokens=args.new_tokens, sampling=sampling)
    if sparse:
        result["sparse_over_dense"] = result["engines"]["sparse"]["decode_over"][bench.engine_name(sparse.weights)]
    if args.json:
        print(json.dumps(result))
        return
    bandwidth = result["read_bandwidth_gb_s"]
    how = "greedy" if sampling.greedy else (f"sampled at temperature {sampling.temperature}, top-k {sampling.top_k}, "
                                            f"top-p {sampling.top_p}, min-p {sampling.min_p}, seed {sampling.seed}")
    print(f"prompt {args.prompt_len} tokens, {args.new_tokens} new tokens ({how}), median of {args.runs} runs; "
          f"measured read bandwidth {bandwidth:.1f} GB/s")
    if args.peer:
        print(describe_peer(result["peer"], args.prompt_len))
    vs = f"decode vs {result['peer']['name']}" if args.peer else ""
    print(f"{'engine':11} {'prefill tok/s':>13} {'decode tok/s':>12} {'ms/token':>8} {'MB/token':>8} "
          f"{'of bandwidth':>12}" + (f" {vs:>22}" if args.peer else ""))
    for name, r in result["engines"].items():
        mb = r["bytes_per_token"] / 1e6
        ratio = f" {r['decode_over_peer']:21.2f}x" if "decode_over_peer" in r else (" " * 23 if args.peer else "")
        prefill = f"{r['prefill_tok_s']:13.1f}" if r["prefill_tok_s"] else f"{'-':>13}"
        print(f"{name:11} {prefill} {r['decode_tok_s']:12.1f} {r['decode_ms_per_token']:8.1f} "
              f"{mb:8.1f} {100 * mb * r['decode_tok_s'] / 1e3 / bandwidth:11.0f}%" + ratio)
        if "breakdown" in r:
            print_breakdown(name, r["breakdown"])
    cached = [name for name, r in result["engines"].items() if r.get("fits_in_cache")]
    if cached:
        print(f"{', '.join(cached)}: a step's bytes fit in the {result['last_level_cache_mb']:.0f} MB last-level cache "
              "this CPU reports, so the step may read them from there: its share of the memory bandwidth is no bound")
    densities = [f"{name} {100 * r['density']:.1f}%" for name, r in result["engines"].items() if r.get("density")]
    if densities:
        print("FFN neurons computed per decode step (the file's predictors, every layer): " + ", ".join(densities)
              + (f"; {result['peer']['name']} prints no density" if args.peer == "powerinfer" else ""))
    if sparse:
        print(f"sparse decode / {bench.engine_name(sparse.weights)} decode: {result['sparse_over_dense']:.2f}x "
              "(median of the runs' ratios)")
    busy = machine.describe(result["machine"])
    if busy:
        print(busy)


def print_breakdown(name: str, rows: list[dict]) -> None:
    """bench.breakdown's rows as a table: ms a token, share of the step, MB read and its rate."""
    step = rows[-1]["ms"]
    print(f"  {name}, one decode step part by part:")
    print(f"  {'part':64} {'ms':>6} {'of step':>7} {'MB':>6} {'GB/s':>6}")
    for r in rows:
        mb = f"{r['mb']:6.1f} {r['mb'] / r['ms']:6.1f}" if r["mb"] else f"{'':6} {'':6}"
        print(f"  {r['part']:64} {r['ms']:6.2f} {100 * r['ms'] / step:6.0f}% {mb}")


def check_peer(peer: str, model) -> None:
    """Refuse, before any model loads, a peer that is not built or installed, or a model it cannot run."""
    from pjinfer.load.loader import default_model_path

    model = model or default_model_path()
    if peer == "llama-cpp":
        from pjinfer.measure.peer import check_llama_cpp

        check_llama_cpp(model)
    else:
        from pjinfer.measure.native_peer import check_native

        check_native(peer, model)


def describe_peer(info: dict, prompt_len: int) -> str:
    """One line (two where its prompt tokenized to another length) saying what ran as the peer."""
    line = f"peer {info['name']}: {info['binary']}"
    if info.get("build"):
        line += f" [{info['build']}]"
    line += f" on {info['model']}"
    if info.get("untied_copy"):
        line += " (an untied copy: the embedding also written as output.weight)"
    if "sparse" in info:
        line += ", its sparse operators with the file's predictors" if info["sparse"] else ", dense"
    if info.get("prompt_tokens") not in (None, prompt_len):
        line += (f"\npeer's prompt: the same text tokenized by the peer into {info['prompt_tokens']} tokens "
                 f"(pjinfer's: {prompt_len})")
    return line


def cmd_eval(args):
    from pjinfer.measure import evaluate

    if args.compare:
        a, b = (evaluate.check_results(common.read_json(f), f) for f in args.compare)
        for line in evaluate.count_mismatches(a, b):
            common.say(f"pjinfer: warning: {line}")
        print(evaluate.compare_table(a, b))
        return
    if not args.tasks:
        raise ConfigError("give --tasks (or --compare A.json B.json)")
    if args.limit is not None and args.limit < 1:
        raise ConfigError(f"--limit must be >= 1, got {args.limit}")
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    evaluate.check_tasks(tasks)  # before the model loads
    follower = common.join(args)
    writes = args.output and not follower   # a tensor-parallel run's process 0 writes it
    if writes:
        common.check_writable(args.output)  # before the evaluation runs, not after
    engine = common.load(args, args.bundle)
    results = evaluate.evaluate(engine, tasks, limit=args.limit, num_fewshot=args.num_fewshot)
    if writes:
        common.write_json(args.output, results)
    print(json.dumps(results) if args.json else evaluate.format_table(results))
