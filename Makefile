# Two commands do all set-up on a fresh clone: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
DJANGO ?= Django>=5.2,<6
export PYTHON VENV DJANGO
PY := $(VENV)/bin/python

.PHONY: demo test matrix bench serve setup dist clean

## Run the demo: 4 instances of a locked command start at once; exactly one does the work.
demo:
	scripts/setup.sh
	DJANGO_SETTINGS_MODULE=testproject.settings $(PY) -m testproject.demo

## Serve the demo's admin at http://127.0.0.1:8000/admin/ (login admin / admin).
serve:
	scripts/setup.sh
	$(PY) manage.py migrate --verbosity 0
	DJANGO_SUPERUSER_PASSWORD=admin $(PY) manage.py createsuperuser --noinput \
		--username admin --email admin@example.com >/dev/null 2>&1 || true
	DJANGO_DEBUG=1 $(PY) manage.py runserver 127.0.0.1:8000

## Run the whole test suite against SQLite, PostgreSQL and MariaDB (starts them if needed):
## first in TEST_WORKERS processes at once (pytest-xdist, databases of their own each), then
## the tests that need the servers to themselves, alone: those that restart a database server
## (marker restarts_servers; RESTART_SERVERS=no skips them), the one that fills PostgreSQL's
## lock table (fills_lock_table), and the failover tests, which run a Patroni cluster of their
## own and leave the machine's servers alone (patroni; with RESTART_SERVERS=no too).
## PYTEST_ARGS (paths, -k, -x; not -m) go to both runs; a run that selects none of its tests
## (pytest's status 5) is no failure.
TEST_WORKERS ?= 2
RESTART_SERVERS ?= yes
ifeq ($(RESTART_SERVERS),no)
ALONE = fills_lock_table or patroni
else
ALONE = restarts_servers or fills_lock_table or patroni
endif
test:
	scripts/setup.sh --servers
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy --cache-dir $(VENV)/mypy_cache advisory_lock
	$(VENV)/bin/pytest -n $(TEST_WORKERS) --dist loadfile \
		-m "not restarts_servers and not fills_lock_table and not patroni" $(PYTEST_ARGS) \
		|| [ $$? -eq 5 ]
	$(VENV)/bin/pytest -m "$(ALONE)" $(PYTEST_ARGS) || [ $$? -eq 5 ]

## Every supported Python x Django pair: install the wheel, migrate, the quickstart, smoke tests.
matrix:
	scripts/setup.sh --servers
	$(PY) scripts/matrix.py $(MATRIX_ARGS)

## Build the docs site into build/docs (Sphinx, docs/conf.py); a warning, such as a broken link,
## fails the build. Read the Docs builds the same (.readthedocs.yaml).
.PHONY: docs
docs:
	scripts/setup.sh
	$(PY) -m pip install -q --group docs
	$(VENV)/bin/sphinx-build -W --keep-going -E -q -b html docs build/docs

## Measure lock throughput against the raw drivers (figures and method: bench/README.md).
bench:
	DEPENDENCY_GROUPS=test,bench scripts/setup.sh --servers
	$(PY) bench/locks.py

setup:
	scripts/setup.sh --servers

## Build the sdist and the wheel into dist/ and check them (docs/releasing.md); the release
## workflow (.github/workflows/release.yml) runs this target and publishes what it built.
dist:
	scripts/setup.sh
	rm -rf dist
	$(PY) -m build --outdir dist .
	$(VENV)/bin/twine check --strict dist/*
	$(PY) tests/test_packaging.py dist/*

clean:
	rm -rf .venv .venv-* testproject/demo.sqlite3 testproject/demo.sqlite3.locks
	rm -rf dist build *.egg-info
