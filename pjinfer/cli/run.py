"""`pjinfer generate`, `chat` and `serve`: text from the model, to a terminal or over HTTP."""
from __future__ import annotations

import json
import logging
import sys
import time

from pjinfer.cli import common
from pjinfer.config import ConfigError


def add_commands(command) -> None:
    """Register this module's subcommands: command(name, function, help) -> their parser."""
    p = command("generate", cmd_generate, "generate text from a prompt, streamed as it comes", json=True)
    common.sparse_options(p)
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", help="the prompt text")
    source.add_argument("--prompt-file", help="read the prompt from this file (UTF-8); - reads standard input")
    p.add_argument("--max-new-tokens", type=common.positive_int, default=64, help="the most tokens generated")
    p.add_argument("--stop", action="append", default=[], metavar="STR",
                   help="stop before this text (repeatable); the model's end-of-text tokens always stop")
    common.sampling_options(p)
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    common.weight_options(p)
    common.parallel_options(p)

    p = command("chat", cmd_chat, "talk with the model: multi-turn, replies streamed (/reset, /exit, Ctrl-C stops a reply)")
    p.add_argument("--system", help="system message that opens the conversation")
    p.add_argument("--max-new-tokens", type=common.positive_int, default=256, help="the longest reply")
    common.sampling_options(p)
    common.weight_options(p)
    common.parallel_options(p)

    p = command("serve", cmd_serve, "an OpenAI-compatible HTTP server (completions, chat completions, streaming)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=common.port, default=8080, help="port to listen on")
    p.add_argument("--api-key", help="require `Authorization: Bearer KEY` on /v1 requests")
    p.add_argument("--max-batch", type=common.positive_int, default=8, help="requests decoding at once; more wait")
    p.add_argument("--max-queue", type=common.positive_int, default=32,
                   help="requests that may wait for a place in the batch; more get 429 with Retry-After")
    common.weight_options(p)
    common.parallel_options(p)


def cmd_generate(args):
    from pjinfer.load.tokenizer import StreamDecoder
    from pjinfer.runtime.compile_cache import CompileStats, kernel_notice

    sampling = common.sampling(args)
    prompt = _prompt_text(args)
    if any(not stop for stop in args.stop):
        raise ConfigError("--stop needs a non-empty string")
    common.join(args)
    engine = common.load(args, args.bundle, until_first_token=True)
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
    compiled = 0.0                                # compile seconds up to the first token
    try:
        for token in engine.stream(ids, max_new_tokens=args.max_new_tokens, sampling=sampling):
            out.append(token)
            piece = decoder.push(token)
            marks.append(time.perf_counter())
            if len(out) == 1:
                kernel_notice.finish()     # the kernels the first prompt needed are compiled by now
                compiled = stats.seconds
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
        sys.stdout.flush()          # the text ends before the summary line on stderr
    reason = finish_reason(interrupted, decoder.stop, len(out), args.max_new_tokens)
    timing = _generate_timing(engine, stats, marks, len(ids), len(out), stats.seconds - compiled)
    seed = None if sampling.greedy else sampling.seed
    if args.json:
        print(json.dumps({"text": decoder.text, "token_ids": decoder.text_ids(), "finish_reason": reason,
                          "stop": decoder.stop, "interrupted": interrupted, "seed": seed,
                          "weights": engine.weights_format, "sparse": engine.backend.rule is not None, **timing}))
    else:
        rate = timing["decode_tok_s"]
        decode = "n/a" if rate is None else f"{rate:.1f} tok/s"
        sampled = "" if seed is None else f", seed {seed}"
        common.say(f"load {timing['load_s']:.1f} s, compile {timing['compile_s']:.1f} s "
                   f"({stats.executables} executables, {stats.cache_hits} from the disk cache), "
                   f"prefill {len(ids)} tokens {timing['prefill_s']:.2f} s, {len(out)} tokens, decode {decode}"
                   f"{sampled} [{engine.path}]")
    if interrupted:
        raise KeyboardInterrupt


def finish_reason(interrupted: bool, stop: str | None, new_tokens: int, max_new_tokens: int) -> str:
    """Why generation ended: "interrupted" (Ctrl-C), "stop" (a stop string, or an end-of-text token: the stream
    ended before max_new_tokens), or "length" (max_new_tokens reached)."""
    if interrupted:
        return "interrupted"
    if stop is not None or new_tokens < max_new_tokens:
        return "stop"
    return "length"


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


def _generate_timing(engine, stats, marks, prompt_tokens, new_tokens, decode_compile_s) -> dict:
    """prefill_s: start to the first token (prefill and, on a cold cache, its compilation); decode_tok_s:
    decode_rate(marks, decode_compile_s), decode_compile_s the compilation after the first token (the decode loop's
    executable, built or read from the disk cache during the first chunk)."""
    decode = decode_rate(marks, decode_compile_s)
    return {"load_s": round(engine.load_seconds, 3), "compile_s": round(stats.seconds, 3),
            "executables": stats.executables, "from_disk_cache": stats.cache_hits,
            "prefill_s": round(marks[1] - marks[0], 3) if new_tokens else None,
            "decode_tok_s": None if decode is None else round(decode, 2),
            "generate_s": round(marks[-1] - marks[0], 3), "prompt_tokens": prompt_tokens, "new_tokens": new_tokens}


def decode_rate(marks, compile_s: float = 0.0) -> float | None:
    """Tokens per second of the decode steps alone. marks: clock readings at the start and after each token. The
    first token comes from the prefill, so the rate counts the tokens after it over the time since it arrived, less
    compile_s, the compilation in that time (tokens come in chunks: two marks can be equal). None with fewer than 2
    decode steps (nothing to time)."""
    steps = len(marks) - 2
    if steps < 2:
        return None
    seconds = marks[-1] - marks[1] - compile_s
    return steps / seconds if seconds > 0 else None


def cmd_chat(args):
    from pjinfer.cli.chat import Conversation, repl, terminal_input
    from pjinfer.runtime.followers import LeaderBatch, follow

    sampling = common.sampling(args)
    if common.join(args):   # process I > 0 of a tensor-parallel chat: make process 0's calls until it stops
        follow(common.load(args), 1)
        return
    engine = common.load(args)
    if not sampling.greedy:
        common.say(f"pjinfer: sampling with seed {sampling.seed}")
    batch = LeaderBatch(engine, 1) if engine.backend.parallel else None
    terminal = terminal_input()
    try:
        repl(Conversation(engine, system=args.system, max_new_tokens=args.max_new_tokens, sampling=sampling,
                          batch=batch), quiet_input=terminal.quiet if terminal else None)
    finally:
        if batch is not None:
            batch.close()


def cmd_serve(args):
    from pjinfer.serve.server import Server, bind, serve

    if common.join(args):   # process I > 0 of a tensor-parallel server: make process 0's calls until it stops
        from pjinfer.runtime.followers import follow

        follow(common.load(args), args.max_batch)
        return
    sock = bind(args.host, args.port)      # a busy port is one line and exit 2, before the model loads
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s", stream=sys.stderr)
    logging.getLogger("pjinfer").setLevel(logging.INFO)     # one line per request
    server = Server(common.load(args), api_key=args.api_key, max_active=args.max_batch, max_queue=args.max_queue)
    common.say(f"pjinfer: serving {server.name} on http://{args.host}:{args.port}/v1 [{server.engine.path}]")
    serve(server, sock)
    if server.scheduler.fatal:   # a process of a tensor-parallel run was lost: main says so and exits
        from pjinfer.runtime.tensor_parallel import Lost

        raise Lost(server.scheduler.fatal)
