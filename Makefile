# One place for the set-up: a virtual environment outside the clone, reused while its recipe is unchanged.
VENV ?= $(HOME)/.cache/xkv/venv-vllm-0.29.0
PY := $(VENV)/bin/python
STAMP := $(VENV)/.xkv-stamp

.PHONY: install demo test lint matrix

$(STAMP): pyproject.toml scripts/install.sh scripts/install_mooncake.sh
	bash scripts/install.sh "$(VENV)"
	touch $(STAMP)

install: $(STAMP)  # then make the venv import THIS checkout (cheap when it already does)
	bash scripts/relink.sh "$(VENV)" "$(CURDIR)"

# THIS checkout first on the path too, so a run is not redirected by another clone re-pointing
# the shared venv meanwhile
HERE := PYTHONPATH=$(CURDIR)$${PYTHONPATH:+:$$PYTHONPATH}

demo: install
	$(HERE) PYTHONHASHSEED=0 $(PY) examples/store_and_restore.py

test: install
	$(HERE) bash scripts/test.sh "$(PY)"

lint: install  # ruff, then the import layering (also a test: tests/test_structure.py)
	$(VENV)/bin/ruff check xkv xkv_vllm_connector tests bench
	cd $(CURDIR) && PYTHONPATH=$(CURDIR) $(VENV)/bin/lint-imports --no-cache

matrix:  # vLLM 0.28/0.32/0.26/0.33, venvs in ~/.cache/xkv (stamped); `make test` covers 0.29
	bash scripts/matrix.sh
