# dlshare: `make demo` runs the whole stack on this machine; `make test` runs the test suite.
# Both install what they need first: Debian packages (when missing), a virtualenv and the package.

PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
SUDO    := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
# mosquitto: the production broker, tested for real. redis-server: a benchmark baseline.
# chromium: the status-page browser test. iproute2: network namespaces for multi-host tests.
# slurm-wlm + munge: the real Slurm (slurmctld, several slurmd on one host) that `dlshare slurm` is tested
# and benchmarked against; its basic plugins carry job_submit/lua (liblua5.1), gres/shard and `squeue --json`.
# prometheus (with promtool): deploy/prometheus's rules and the Grafana dashboard's queries are checked against
# a real Prometheus scraping a live stack (tests/deploy/test_prometheus.py).
APT_PKGS := mosquitto mosquitto-clients redis-server iproute2 procps util-linux slurm-wlm munge prometheus openssl
PYTEST_ARGS ?=
TEST_WORKERS ?= 3

.PHONY: all demo test test-stress sanitize lint deps sysdeps ext bench bench-quick clean k8s-testbed

all: deps

# Also: a C compiler and Python headers (the cffi extension), venv support, and chromium where the
# distribution packages it (Debian does; Ubuntu ships it as a snap, and the browser test then says so).
sysdeps:
	@missing=""; for p in $(APT_PKGS); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	command -v cc >/dev/null 2>&1 || missing="$$missing gcc"; \
	$(PY) -c 'import sysconfig,os,sys; sys.exit(not os.path.exists(os.path.join(sysconfig.get_paths()["include"],"Python.h")))' || missing="$$missing python3-dev"; \
	$(PY) -c 'import ensurepip, venv' 2>/dev/null || missing="$$missing python3-venv"; \
	command -v chromium >/dev/null 2>&1 || missing="$$missing chromium"; \
	if [ -n "$$missing" ]; then \
	  echo "installing Debian packages:$$missing"; \
	  $(SUDO) apt-get update -qq; \
	  case "$$missing" in *chromium*) apt-cache show chromium >/dev/null 2>&1 || { echo "no chromium package here; skipping it"; missing=$$(echo "$$missing" | sed 's/ chromium//'); };; esac; \
	  $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing >/dev/null; \
	fi

$(BIN)/python:
	$(PY) -m venv $(VENV)

# torch==2.13.0 first: on these machines it is a local CPU build; any other version pulls CUDA wheels.
$(VENV)/.installed: pyproject.toml setup.py | $(BIN)/python
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev,torch]'
	touch $@

deps: sysdeps $(VENV)/.installed ext

# Rebuild the C extension in place (cheap when nothing changed).
ext: | $(VENV)/.installed
	@$(BIN)/python setup.py -q build_ext --inplace >/dev/null

# The Kubernetes test control plane (tests/k8s, `dlshare bench k8s`): kube-apiserver and kube-scheduler
# built from Debian's kubernetes 1.20 source package, and etcd, into K8S_CACHE (outside the checkout,
# keyed by version, reused: about 4 minutes at 2 cores the first time, a second after).
K8S_CACHE ?= /var/cache/dlshare/k8s
export DLSHARE_K8S_CACHE := $(K8S_CACHE)
k8s-testbed: | $(VENV)/.installed
	PYTHON=$(BIN)/python deploy/kubernetes/testbed/build.sh >/dev/null

# lint-imports: the floors of the import graph (pyproject.toml, [tool.importlinter]); a back-arrow fails.
# The control plane is built before pytest starts (its build is not test time); if it fails, the rest of
# the suite still runs and every test in tests/k8s fails naming the build (DLSHARE_K8S_REQUIRED).
test: deps
	@$(MAKE) --no-print-directory k8s-testbed || echo "make k8s-testbed FAILED: the tests in tests/k8s will fail"
	$(BIN)/lint-imports --no-cache
	# Bytecode is cached (whatever the caller's PYTHONDONTWRITEBYTECODE says): the suite starts hundreds of
	# Python processes, and each would otherwise compile every project module it imports again.
	# Two passes (tests/suite.py): the suite on TEST_WORKERS isolated pytest-xdist workers, then the files
	# that must run alone (tests/conftest.py, ALONE).  TEST_WORKERS=1: one pytest process, as before.
	env -u PYTHONDONTWRITEBYTECODE DLSHARE_K8S_REQUIRED=1 $(BIN)/python -m tests.suite --workers $(TEST_WORKERS) \
	  -q -ra --durations=15 $(PYTEST_ARGS)

# The C core under AddressSanitizer and UndefinedBehaviorSanitizer: built apart (build/sanitize; the
# in-place extension is untouched), then the tests that run the C in-process, with the sanitized
# build loaded in every Python process of the run (tests/sanitize/sitecustomize.py).  Any finding
# aborts the run.  detect_leaks=0: the interpreter itself keeps memory until exit.  handle_segv=0,
# handle_sigbus=0: the tests that expect a SIGSEGV or SIGBUS (a lost unit, a closed region) see the
# signal itself.  Left out: the test that measures RSS falling after the server frees a buffer
# (ASan's quarantine keeps freed memory on purpose).
SANITIZE_TESTS ?= tests/test_c_layout.py tests/rdma/test_wire.py tests/rdma/test_crc32c.py \
	tests/rdma/test_native_mem.py tests/rdma/test_tcp_server.py tests/rdma/test_buffer.py \
	tests/rdma/test_pager.py tests/rdma/test_pager_rebuild.py tests/rdma/test_pager_errors.py \
	tests/adversarial/test_slab_server.py \
	tests/aggregator/test_agg_kernel.py tests/aggregator/test_agg_sockio.py
sanitize: | $(VENV)/.installed
	rm -rf build/sanitize
	DLSHARE_SANITIZE=1 $(BIN)/python setup.py -q build_ext --build-lib build/sanitize/lib \
	  --build-temp build/sanitize/tmp >/dev/null
	ext=$$(ls build/sanitize/lib/rdma/_dlshare_c*.so) && \
	env DLSHARE_SANITIZED_EXT=$$PWD/$$ext PYTHONPATH=$$PWD/tests/sanitize PYTHONMALLOC=malloc \
	  LD_PRELOAD=$$($(CC) -print-file-name=libasan.so) \
	  ASAN_OPTIONS=detect_leaks=0:abort_on_error=1:handle_segv=0:handle_sigbus=0 \
	  UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
	  $(BIN)/python -m pytest -q -p no:cacheprovider $(PYTEST_ARGS) $(SANITIZE_TESTS) \
	  --deselect tests/adversarial/test_slab_server.py::test_a_token_holder_gives_big_buffers_back_when_it_idles

# The flake hunt: the suite (or PYTEST_ARGS, a selection) with one core held busy by a pinned busy
# loop, each test STRESS_COUNT times (tests/stress.py starts the loop and stops it by pid).
STRESS_COUNT ?= 1
test-stress: deps
	$(BIN)/python -m tests.stress --count $(STRESS_COUNT) $(PYTEST_ARGS)

demo: deps
	$(BIN)/dlshare up --tour

bench: deps
	$(BIN)/dlshare bench all --json bench/out/all.json

bench-quick: deps
	$(BIN)/dlshare bench all --quick --json bench/out/all.json

clean:
	rm -rf build *.egg-info rdma/_dlshare_c.* bench/out
