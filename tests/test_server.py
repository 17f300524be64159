"""`pjinfer serve` over a real socket on 127.0.0.1, driven by the real `openai` client and raw HTTP (httpx)."""
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest
import uvicorn

from pjinfer.measure.bench_serve import free_port, wait_healthy
from pjinfer.runtime.sampling import Sampling
from pjinfer.serve.bodies import DEFAULT_SAMPLING
from pjinfer.serve.server import Server

pytestmark = pytest.mark.real_model

KEY = "test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
MAX_QUEUE = 4


@pytest.fixture(scope="module")
def served(q4_engine):
    """The session's real model on the Q4_1 host decode (batched) behind a server in a thread of this process."""
    yield from _serve(q4_engine)


@pytest.fixture(scope="module")
def served_float32(engine):
    """The same model's float32 weights (batched in XLA) behind a second server."""
    yield from _serve(engine)


@pytest.fixture(scope="module")
def split_engine():
    """The same file with layers 0-6 in XLA and the rest on the host decode (--offload-layers 7)."""
    from pjinfer.runtime.engine import Engine

    return Engine.load(offload_layers=7)


@pytest.fixture(scope="module")
def served_split(split_engine):
    """The layer split behind a third server (batched: XLA's layers and the host's in one step)."""
    yield from _serve(split_engine)


def _serve(engine):
    server = Server(engine, api_key=KEY, max_active=8, max_queue=MAX_QUEUE, max_body_bytes=64 * 1024)
    port = free_port()
    runner = uvicorn.Server(uvicorn.Config(server.app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=runner.run, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}"
    wait_healthy(base, timeout=30)
    yield server, base, openai.OpenAI(base_url=f"{base}/v1", api_key=KEY, max_retries=0, timeout=300)
    server.scheduler.close()
    runner.should_exit = True
    thread.join(timeout=30)


def expected(engine, prompt: str, n: int, *, chat=False) -> str:
    tok = engine.tokenizer
    ids = tok.encode(tok.apply_chat([{"role": "user", "content": prompt}]), add_special=False) if chat \
        else tok.encode(prompt)
    return tok.decode(engine.generate(ids, max_new_tokens=n))


def test_models_and_health(served):
    server, base, client = served
    assert [m.id for m in client.models.list().data] == [server.name]
    assert httpx.get(f"{base}/health").json()["status"] == "ok"


def test_greedy_completion_equals_generate_streamed_or_not(served, q4_engine):
    server, _, client = served
    want = expected(q4_engine, "The capital of France is", 12)
    whole = client.completions.create(model=server.name, prompt="The capital of France is", max_tokens=12,
                                      temperature=0)
    assert whole.choices[0].text == want and whole.choices[0].finish_reason == "length"
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (5, 12)
    chunks = list(client.completions.create(model=server.name, prompt="The capital of France is", max_tokens=12,
                                            temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == want and chunks[-1].choices[0].finish_reason == "length"


def test_chat_stops_at_end_of_turn_and_streams_the_same_text(served, q4_engine):
    _, _, client = served
    messages = [{"role": "user", "content": "Say hello."}]
    whole = client.chat.completions.create(model="", messages=messages, max_tokens=60, temperature=0)
    assert whole.choices[0].message.content == expected(q4_engine, "Say hello.", 60, chat=True)
    assert whole.choices[0].finish_reason == "stop"             # the end-of-turn token came before 60 tokens
    stream = client.chat.completions.create(model="", messages=messages, max_tokens=60, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_stop_strings(served, q4_engine):
    _, _, client = served
    out = client.completions.create(model="", prompt="The capital of France is", max_tokens=12, temperature=0,
                                    stop=["\n"])
    assert out.choices[0].text == " Paris." and out.choices[0].finish_reason == "stop"


@pytest.mark.real_model
@pytest.mark.parametrize("weights", ["q4_1", "float32", "split"])
def test_eight_concurrent_streams_each_equal_their_single_output(weights, request):
    """Batched on the host (q4_1), in XLA (float32) and split between them (--offload-layers): greedy text
    equals each prompt's own generate."""
    served = request.getfixturevalue({"q4_1": "served", "float32": "served_float32", "split": "served_split"}[weights])
    engine = request.getfixturevalue({"q4_1": "q4_engine", "float32": "engine", "split": "split_engine"}[weights])
    _, _, client = served
    prompts = ["The capital of France is", "Once upon a time", "def fibonacci(n):", "The best way to learn is",
               "Water boils at", "My favourite animal is", "In 1492,", "The opposite of hot is"]
    want = [expected(engine, p, 8) for p in prompts]
    got = [None] * len(prompts)

    def one(i):
        chunks = client.completions.create(model="", prompt=prompts[i], max_tokens=8, temperature=0, stream=True)
        got[i] = "".join(c.choices[0].text for c in chunks)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert got == want
    assert served[0].scheduler.batch.widest >= 2        # requests did share decode steps


@pytest.mark.parametrize("body,status,fragment", [
    (b'{"prompt": "x", "max_tokens": 9000}', 400, "exceed the model's context"),
    (b'{"prompt": "x"', 400, "not valid JSON"),
    (b'{"prompt": 3}', 422, "prompt"),
    (b'{"prompt": "x", "temperature": -1}', 400, "temperature must be >= 0"),
    (b'{"prompt": "x", "model": "gpt-4"}', 404, "model 'gpt-4' not found"),
    (b'{"prompt": "' + b"x" * 70000 + b'"}', 413, "request body over"),
])
def test_errors_are_openai_error_objects(served, body, status, fragment):
    _, base, _ = served
    r = httpx.post(f"{base}/v1/completions", content=body, headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == status and fragment in r.json()["error"]["message"], r.text


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}])
def test_api_key_is_required(served, headers):
    _, base, _ = served
    r = httpx.post(f"{base}/v1/completions", json={"prompt": "x"}, headers=headers)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{base}/v1", api_key="wrong", max_retries=0).models.list()


def test_a_client_that_disconnects_frees_its_slot(served, caplog):
    server, base, _ = served
    caplog.set_level("INFO", logger="pjinfer")
    headers = {"Authorization": f"Bearer {KEY}"}
    with httpx.stream("POST", f"{base}/v1/completions", headers=headers, timeout=60,
                      json={"prompt": "Once upon a time", "max_tokens": 4000, "temperature": 0, "stream": True}) as r:
        lines = r.iter_lines()
        assert next(l for l in lines if l.startswith("data:"))      # streaming has begun
        assert server.scheduler.active == 1
    # 4000 tokens would take minutes; the job must go at its next turn instead.
    deadline = time.monotonic() + 30
    while server.scheduler.active and time.monotonic() < deadline:
        time.sleep(0.1)
    assert server.scheduler.active == 0
    lines = [r.getMessage() for r in caplog.records if "client went away" in r.getMessage()]
    assert len(lines) == 1 and re.search(r"cmpl-\w+ client went away after [1-9]\d* tokens", lines[0]), lines


def test_sigterm_ends_open_streams_cleanly_and_exits_zero():
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, "-m", "pjinfer.cli.main", "serve", "--port", str(port), "--weights", "q4_1"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=os.environ.copy())
    try:
        wait_healthy(base, proc)
        with httpx.stream("POST", f"{base}/v1/completions", timeout=60,
                          json={"prompt": "Once upon a time", "max_tokens": 4000, "stream": True}) as r:
            lines = r.iter_lines()
            first = next(l for l in lines if l.startswith("data:"))   # a token: compiling is over
            proc.send_signal(signal.SIGTERM)
            rest = [l for l in lines if l]
        assert json.loads(first[5:])["object"] == "text_completion"
        assert rest[-1] == "data: [DONE]" and json.loads(rest[-2][5:])["choices"][0]["finish_reason"] == "shutdown"
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 0 and "Traceback" not in err, err
        assert "completion" in err and "first token" in err          # the request's log line
    finally:
        proc.kill()


@pytest.mark.parametrize("flag", ["--requests", "--clients", "--tokens", "--pairs"])
def test_bench_serve_refuses_counts_below_one_before_starting_a_server(capsys, flag):
    from pjinfer.measure import bench_serve

    with pytest.raises(SystemExit) as e:
        bench_serve.main([flag, "0"])
    assert e.value.code == 2 and f"argument {flag}: must be >= 1, got 0" in capsys.readouterr().err


def test_bench_serve_no_http_counts_every_token_of_both_phases(q4_engine):
    """The engine-only measurement decodes every request's tokens (prefill's first one included) in both phases;
    the rates it divides are those counts over wall time."""
    from pjinfer.measure import bench_serve
    from pjinfer.runtime import batch

    made = []
    real_step = batch.Batch.step

    def step(self, states, steps=1):
        real_step(self, states, steps)
        made.append(sum(len(s.new) for s in states))

    with pytest.MonkeyPatch.context() as m:
        m.setattr(batch.Batch, "step", step)
        result = bench_serve.run_direct(q4_engine, requests=3, clients=2, tokens=5, pairs=1)
    # Warm-up (1 + 2 requests), then the pair (2 single + 3 concurrent): 8 requests of 5 tokens, 4 from steps each.
    assert sum(made) == 8 * 4
    assert result["pairs"] == 1 and len(result["ratios"]) == 1 and result["http"] is False
    assert result["single_stream_tok_s"][0] > 0 and result["aggregate_tok_s"][0] > 0


@pytest.mark.parametrize("queued, want", [
    ([("text", "a"), ("text", "b"), ("text", "c"), ("done", "length")], ["abc", "length"]),
    ([("text", "a"), ("done", "stop")], ["a", "stop"]),
    ([("text", "x"), ("text", "y"), ("error", "boom")], ["xy", "boom"]),
])
def test_a_stream_sends_the_pieces_already_queued_as_one_chunk(served, queued, want):
    """A batched call hands a request several tokens at once: the SSE stream sends the text that is already
    waiting in one chunk, then the event after it (the finish, or an error object), then [DONE]."""
    import asyncio

    from pjinfer.runtime.sampling import Sampling
    from pjinfer.serve.scheduler import Job
    from pjinfer.serve.server import _Reply

    server = served[0]
    job = Job([1, 2], 3, Sampling(), emit=lambda event: None)
    job.first_token = job.finished = time.perf_counter()
    job.completion_tokens = 3

    async def collect():
        events = asyncio.Queue()
        for event in queued:
            events.put_nowait(event)
        return [part async for part in server._stream(job, events, _Reply("r", "m", False, 2), False)]

    parts = asyncio.run(collect())
    assert parts[-1] == "data: [DONE]\n\n" and len(parts) == 3
    first, second = (json.loads(p[len("data: "):]) for p in parts[:2])
    assert first["choices"][0]["text"] == want[0] and first["choices"][0]["finish_reason"] is None
    assert (second["choices"][0]["finish_reason"] if "choices" in second else second["error"]["message"]) == want[1]


def _wait(condition, seconds: float) -> bool:
    """Polls `condition` every 20 ms for up to `seconds`; whether it became true."""
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def test_a_non_streaming_client_that_disconnects_frees_its_slot_within_two_steps(served, caplog):
    """3000 tokens would hold the slot for minutes: the job leaves at the next decode step after the disconnect."""
    server, base, _ = served
    host, port = base[len("http://"):].split(":")
    body = json.dumps({"prompt": "Once upon a time", "max_tokens": 3000, "temperature": 0, "ignore_eos": True})
    request = (f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {KEY}\r\n"
               f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n{body}").encode()
    caplog.set_level("INFO", logger="pjinfer")
    with socket.create_connection((host, int(port))) as conn:
        conn.sendall(request)
        assert _wait(lambda: server.scheduler.active == 1, 30)
        time.sleep(1.5)                                  # decoding, not answering yet
    assert _wait(lambda: server.scheduler.active == 0, 2), "the slot stayed taken after the client left"
    lines = [r.getMessage() for r in caplog.records if "client went away" in r.getMessage()]
    assert len(lines) == 1, lines
    got, after = map(int, re.search(r"after (\d+) tokens \((\d+) after it went\)", lines[0]).groups())
    assert 0 < got < 3000 and after <= 2, lines[0]
    assert httpx.get(f"{base}/health").json()["active"] == 0


def test_a_busy_port_is_one_line_and_exit_2_before_loading(capsys):
    from pjinfer.cli.main import main

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        start = time.monotonic()
        assert main(["serve", "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert err == f"pjinfer: error: port {port} is in use\n" and time.monotonic() - start < 5


def test_a_lost_process_is_named_to_the_job_decoding_the_job_waiting_and_a_later_request(q4_engine):
    """A tensor-parallel server that loses a process (Scheduler._lost, called by the Watch or on a collective's
    error) tells every job it will not finish which process stopped: the one decoding, the one still waiting for a
    place, and a request that arrives after. (A waiting job once got a bare "the server is shutting down".)"""
    import queue

    from pjinfer.runtime.tensor_parallel import Lost
    from pjinfer.serve.scheduler import Job, Scheduler, SchedulerClosed

    line = "tensor parallel: process 1 of the 2 in this run stopped (Socket closed)"
    scheduler = Scheduler(q4_engine, max_active=1, max_queue=2)
    scheduler.stop = lambda: None          # the server's SIGTERM to itself: no server here
    events = {name: queue.Queue() for name in ("decoding", "waiting")}
    ids = q4_engine.tokenizer.encode("Once upon a time")
    jobs = {name: Job(ids, 400, Sampling(), events[name].put, stop_ids=(), name=name) for name in events}
    scheduler.submit(jobs["decoding"])
    assert events["decoding"].get(timeout=120)[0] == "text"
    scheduler.submit(jobs["waiting"])
    assert scheduler.waiting == 1
    assert scheduler._lost(Lost(line))
    scheduler.join(timeout=60)
    assert not scheduler._thread.is_alive()
    told = {name: _drain(q) for name, q in events.items()}
    want = ("error", f"the server is shutting down: {line}")
    assert told == {"decoding": [want], "waiting": [want]}
    with pytest.raises(SchedulerClosed, match="process 1 of the 2 in this run stopped"):
        scheduler.submit(Job(ids, 4, Sampling(), lambda event: None))


def _drain(events) -> list[tuple]:
    """The events a job was sent after its text."""
    out = []
    while not events.empty():
        event = events.get_nowait()
        if event[0] != "text":
            out.append(event)
    return out


def test_unset_sampling_fields_take_llama_server_defaults(served, q4_engine):
    """No temperature etc.: the text is what the engine samples with temperature 0.8, top-k 40, top-p 0.95 and
    min-p 0.05 under the same seed, and not what it samples with the bare Sampling (temperature 1, no filters)."""
    _, base, _ = served
    ids = q4_engine.tokenizer.encode("The weather today is")
    r = httpx.post(f"{base}/v1/completions", headers=AUTH, timeout=120,
                   json={"prompt": "The weather today is", "max_tokens": 24, "seed": 7, "ignore_eos": True})
    text = r.json()["choices"][0]["text"]
    want = q4_engine.generate(ids, max_new_tokens=24, stop_ids=[], sampling=Sampling(**DEFAULT_SAMPLING, seed=7))
    bare = q4_engine.generate(ids, max_new_tokens=24, stop_ids=[], sampling=Sampling(temperature=1.0, seed=7))
    assert text == q4_engine.tokenizer.decode(want) != q4_engine.tokenizer.decode(bare)


@pytest.mark.parametrize("field,value", [
    ("logprobs", 2), ("logprobs", True), ("echo", True), ("presence_penalty", 0.5), ("frequency_penalty", -1),
    ("response_format", {"type": "json_object"}), ("tools", [{"type": "function"}]), ("n", 2), ("best_of", 3),
    ("logit_bias", {"50256": -100}), ("suffix", "end"), ("max_token", 5),
])
def test_unimplemented_fields_are_refused_naming_the_field(served, field, value):
    _, base, _ = served
    r = httpx.post(f"{base}/v1/completions", headers=AUTH, json={"prompt": "Hi", "max_tokens": 1, field: value})
    assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text


def test_fields_at_their_neutral_value_and_ignored_fields_are_accepted(served):
    _, base, _ = served
    neutral = {"presence_penalty": 0, "frequency_penalty": 0.0, "response_format": {"type": "text"},
               "logprobs": None, "echo": False, "n": 1, "user": "someone", "metadata": {"a": "b"}}
    r = httpx.post(f"{base}/v1/completions", headers=AUTH, timeout=60,
                   json={"prompt": "Hi", "max_tokens": 1, "temperature": 0, **neutral})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 1, r.text
    r = httpx.post(f"{base}/v1/chat/completions", headers=AUTH, timeout=60,
                   json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1, "logprobs": False})
    assert r.status_code == 200, r.text


def test_chat_content_as_text_parts_equals_the_string(served):
    _, _, client = served
    parts = [{"type": "text", "text": "Name a colour."}, {"type": "text", "text": "One word."}]
    joined = [{"role": "user", "content": "Name a colour.\nOne word."}]
    a = client.chat.completions.create(model="", messages=[{"role": "user", "content": parts}], max_tokens=6,
                                       temperature=0)
    b = client.chat.completions.create(model="", messages=joined, max_tokens=6, temperature=0)
    assert a.choices[0].message.content == b.choices[0].message.content and a.usage == b.usage


def test_seed_minus_one_is_random_and_others_outside_the_range_are_refused(served):
    """-1 (llama-server's "random") samples; -2 and 2**32 are 400 naming the seed."""
    _, base, _ = served
    body = {"prompt": "Hi", "max_tokens": 2, "temperature": 0.8}
    assert httpx.post(f"{base}/v1/completions", headers=AUTH, timeout=60, json={**body, "seed": -1}).status_code == 200
    for seed in (-2, 2**32):
        r = httpx.post(f"{base}/v1/completions", headers=AUTH, json={**body, "seed": seed})
        assert r.status_code == 400 and r.json()["error"]["param"] == "seed", r.text


@pytest.mark.parametrize("path,body,param", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "What is this?"}, {"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages.0.content.1"),
    ("/v1/completions", {"prompt": ""}, "prompt"),
    ("/v1/completions", {"prompt": [""]}, "prompt"),
    ("/v1/completions", {"prompt": "x", "stop": ["\n", ""]}, "stop"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text"}]}]},
     "messages.0.content.0.text"),
])
def test_bad_prompts_name_their_param(served, path, body, param):
    _, base, _ = served
    r = httpx.post(f"{base}{path}", headers=AUTH, json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_requests_past_the_batch_and_the_queue_get_429_with_retry_after(served):
    """8 decoding, MAX_QUEUE waiting (their streams open with status 200), the next one refused; when the
    clients go, the batch and the queue empty."""
    server, base, _ = served
    body = {"prompt": "Once upon a time", "max_tokens": 3000, "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.Client(headers=AUTH, timeout=60) as http:
        streams = [http.stream("POST", f"{base}/v1/completions", json=body) for _ in range(8 + MAX_QUEUE)]
        try:
            assert [s.__enter__().status_code for s in streams] == [200] * (8 + MAX_QUEUE)
            assert _wait(lambda: (server.scheduler.active, server.scheduler.waiting) == (8, MAX_QUEUE), 30)
            r = http.post(f"{base}/v1/completions", json=body)
            assert r.status_code == 429 and r.headers["retry-after"] == "1", r.text
            assert r.json()["error"]["code"] == "server_busy"
        finally:
            for s in streams:
                s.__exit__(None, None, None)
    assert _wait(lambda: (server.scheduler.active, server.scheduler.waiting) == (0, 0), 10)


@pytest.mark.parametrize("chunked", [False, True])
def test_a_whole_body_over_the_limit_gets_413_not_a_reset(served, chunked):
    """The limit is 64 KiB here: a 100 KB body, sent whole (announced or chunked), is read and answered 413."""
    _, base, _ = served
    body = b"x" * 100_000
    content = iter([body[i:i + 16384] for i in range(0, len(body), 16384)]) if chunked else body
    r = httpx.post(f"{base}/v1/completions", content=content, headers=AUTH)
    assert r.status_code == 413 and "request body over" in r.json()["error"]["message"], r.text


def test_soak_refuses_too_few_clients_before_starting_a_server(capsys):
    from pjinfer.measure import soak

    with pytest.raises(SystemExit) as e:
        soak.main(["--clients", "3"])
    assert e.value.code == 2 and "--clients: must be >= 4" in capsys.readouterr().err


def test_soak_bursts_fall_in_the_middle_of_each_slow_client_window():
    from pjinfer.measure.soak import SLOW_WINDOW_S, SlowWindows

    w, half = SlowWindows(100.0), SLOW_WINDOW_S / 2
    for at, middle in [(100, 100 + half), (100 + half, 100 + 3 * half), (100 + 3 * half - 1, 100 + 3 * half)]:
        assert at + w.to_next_middle(at) == pytest.approx(middle)
    assert w.on(100) and not w.on(100 + SLOW_WINDOW_S) and w.on(100 + 2 * SLOW_WINDOW_S)
