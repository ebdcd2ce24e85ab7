# The README's main command: boot a sandbox host, deploy with ansible-playbook site.yml, chat through the gateway.
# KEEP=1 leaves the host running.
.PHONY: demo
demo:
	@if [ "$$(id -u)" = 0 ]; then bash tools/demo.sh; else sudo -E bash tools/demo.sh; fi
