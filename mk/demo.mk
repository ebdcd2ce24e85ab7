# The README's main command: boot a sandbox host, deploy with ansible-playbook site.yml, chat through the gateway.
# Runs setup (Debian packages, .venv) and the sandbox images first, like `make test`. KEEP=1 leaves the host
# running; DEMO_SPEC=examples/tiny-cpu-2hosts.yml deploys the two-host fleet.
.PHONY: demo
demo: setup images
	@if [ "$$(id -u)" = 0 ]; then bash tools/demo.sh; else sudo -E bash tools/demo.sh; fi
