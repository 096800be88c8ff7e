# psymesh: two commands on a fresh machine. Both bootstrap .venv themselves.
#   make demo   run the main job: a home node and a phone node talking over psymesh
#   make test   run the test suite
PY := .venv/bin/python
STAMP := .venv/.psymesh-installed

.PHONY: demo test bench venv clean

$(STAMP): pyproject.toml scripts/bootstrap.sh
	./scripts/bootstrap.sh

venv: $(STAMP)

demo: $(STAMP)
	$(PY) examples/demo.py

test: $(STAMP)
	$(PY) -m pytest $(PYTEST_ARGS)

bench: $(STAMP)
	$(PY) bench/rtt.py
	$(PY) bench/rtt_profile.py
	$(PY) bench/delegate.py
	$(PY) bench/inference.py
	$(PY) bench/split.py
	$(PY) bench/messaging.py
	$(PY) bench/durable.py
	$(PY) bench/denied.py
	$(PY) bench/web.py
	$(PY) bench/web_profile.py
	$(PY) bench/ui.py
	$(PY) bench/cli.py
	$(PY) bench/idle.py
	$(PY) bench/asleep.py

clean:
	rm -rf .venv .pytest_cache .hypothesis build *.egg-info .demo .bench
