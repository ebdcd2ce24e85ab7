"""Run the rendered gateway under a private, non-daemon nginx master (tests, bench, demo).

``vllm-fleet render`` writes ``OUT/HOST/etc/nginx/conf.d/vllm-fleet.conf`` (+ ``vllm-fleet/``). Production
includes it from Debian's /etc/nginx/nginx.conf; here a small top-level config next to it does the same with
every writable path under a private prefix, so the rendered files are used unchanged.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

NGINX = shutil.which("nginx") or "/usr/sbin/nginx"
JS_MODULE = "/usr/lib/nginx/modules/ngx_http_js_module.so"
# nginx and its JavaScript module (Debian's libnginx-mod-http-js) are installed: the gateway tests that run the
# rendered nginx skip without them
HAVE_NGINX = shutil.which("nginx") is not None and Path(JS_MODULE).exists()

MAIN_CONF = """\
load_module {js_module};
{user}worker_processes {workers};
{rlimit}pid {prefix}/nginx.pid;
error_log {prefix}/error.log warn;
daemon off;
events {{ worker_connections {worker_connections}; }}
http {{
    client_body_temp_path {prefix}/tmp/body;
    proxy_temp_path {prefix}/tmp/proxy;
    fastcgi_temp_path {prefix}/tmp/fastcgi;
    uwsgi_temp_path {prefix}/tmp/uwsgi;
    scgi_temp_path {prefix}/tmp/scgi;
    access_log off;
    include conf.d/vllm-fleet.conf;
}}
"""


class NginxGateway:
    """nginx -p PREFIX -c ETC_NGINX/vf-local-nginx.conf, in the foreground of its own process group."""

    def __init__(
        self,
        etc_nginx: Path,
        prefix: Path,
        workers: int = 2,
        worker_connections: int = 4096,
        rlimit_nofile: int | None = None,
    ) -> None:
        """``worker_connections``: each worker's connections, clients and upstreams (engines, the admission
        service) together; ``rlimit_nofile``: the workers' open-file limit (``worker_rlimit_nofile``), which
        must cover them (None: the limit nginx inherits)."""
        self.etc_nginx = Path(etc_nginx)
        self.prefix = Path(prefix)
        self.conf = self.etc_nginx / "vf-local-nginx.conf"
        self.proc: subprocess.Popen[bytes] | None = None
        (self.prefix / "tmp").mkdir(parents=True, exist_ok=True)
        # as root, workers would run as nobody and could not read the drained-set file in a private (0700)
        # test folder; production workers (www-data) read /etc/vllm-fleet/gateway/drained.json (0644)
        user = "user root;\n" if os.geteuid() == 0 else ""
        self.conf.write_text(
            MAIN_CONF.format(
                js_module=JS_MODULE,
                workers=workers,
                prefix=self.prefix,
                user=user,
                worker_connections=worker_connections,
                rlimit=f"worker_rlimit_nofile {rlimit_nofile};\n" if rlimit_nofile else "",
            )
        )

    @property
    def upstreams_file(self) -> Path:
        return self.etc_nginx / "vllm-fleet" / "upstreams.conf"

    def argv(self, *extra: str) -> list[str]:
        return [NGINX, "-p", str(self.prefix), "-c", str(self.conf), *extra]

    def check(self) -> subprocess.CompletedProcess[str]:
        """``nginx -t`` of the rendered config."""
        return subprocess.run(self.argv("-t", "-q"), capture_output=True, text=True, timeout=30)

    def start(self, health_url: str | None = None, timeout: float = 10) -> NginxGateway:
        log = (self.prefix / "nginx.out").open("ab")
        self.proc = subprocess.Popen(
            self.argv(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"nginx exited with {self.proc.returncode}: {self.log_tail()}")
            if health_url is None:
                if (self.prefix / "nginx.pid").exists():
                    return self
            else:
                try:
                    with urllib.request.urlopen(health_url, timeout=1):
                        return self
                except OSError:
                    pass
            time.sleep(0.05)
        raise TimeoutError(f"nginx not up after {timeout}s: {self.log_tail()}")

    def reload(self) -> None:
        """Graceful reload (HUP to the master): new workers, old ones finish their requests."""
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGHUP)

    def log_tail(self, n: int = 20) -> str:
        lines: list[str] = []
        for name in ("nginx.out", "error.log"):
            p = self.prefix / name
            if p.exists():
                lines += p.read_text(errors="replace").splitlines()[-n:]
        return "\n".join(lines)

    def stop(self, timeout: float = 10) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGQUIT)  # graceful
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(5)

    def __enter__(self) -> NginxGateway:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
