"""gateway.tls.self_signed: the certificate the gateway role makes on the controller (vllm_fleet/fleet/tls.py)."""

from __future__ import annotations

import datetime as dt
import ipaddress
import json
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from cryptography import x509

from vllm_fleet.fleet.spec import SpecError, load_spec, parse_spec
from vllm_fleet.fleet.tls import RENEW_DAYS, VALID_DAYS, self_signed

REPO = Path(__file__).resolve().parents[2]


def _sans(path: Path) -> tuple[list[str], list[str]]:
    cert = x509.load_pem_x509_certificate(path.read_bytes())
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    return san.get_values_for_type(x509.DNSName), [str(a) for a in san.get_values_for_type(x509.IPAddress)]


def test_made_once_for_the_host_and_kept_while_valid(tmp_path: Path) -> None:
    first = self_signed(tmp_path / "s", ["gw1"], ["10.77.0.61", "gw1.internal"])
    assert first.changed
    assert _sans(first.certificate) == (["gw1", "gw1.internal"], ["10.77.0.61"])  # a DNS "address" is a name
    assert stat.S_IMODE(first.key.stat().st_mode) == 0o600
    again = self_signed(tmp_path / "s", ["gw1"], ["10.77.0.61", "gw1.internal"])
    assert not again.changed and again.certificate.read_bytes() == first.certificate.read_bytes()
    # another address: a new certificate (and key)
    key_before = first.key.read_bytes()
    moved = self_signed(tmp_path / "s", ["gw1"], ["10.77.0.99"])
    assert moved.changed and moved.key.read_bytes() != key_before
    assert _sans(moved.certificate) == (["gw1"], ["10.77.0.99"])


def test_renewed_when_it_nears_expiry_and_replaced_when_the_key_does_not_match(tmp_path: Path) -> None:
    made = self_signed(tmp_path, ["gw"], ["10.0.0.1"])
    later = made.not_after.replace(tzinfo=dt.UTC) - dt.timedelta(days=RENEW_DAYS - 1)
    assert self_signed(tmp_path, ["gw"], ["10.0.0.1"], now=later).changed
    other = self_signed(tmp_path / "other", ["gw"], ["10.0.0.1"])
    (tmp_path / "gateway.key").write_bytes(other.key.read_bytes())  # a key of another certificate
    assert self_signed(tmp_path, ["gw"], ["10.0.0.1"]).changed


def test_it_verifies_as_its_own_trust_anchor(tmp_path: Path) -> None:
    """What clients do with it: trust the file and check the name (the role's clients and the tests)."""
    import ssl

    made = self_signed(tmp_path, ["gw"], ["10.0.0.1"])
    ctx = ssl.create_default_context(cafile=str(made.certificate))
    assert ctx.get_ca_certs()[0]["subjectAltName"] == (("DNS", "gw"), ("IP Address", "10.0.0.1"))
    cert = x509.load_pem_x509_certificate(made.certificate.read_bytes())
    life = cert.not_valid_after_utc - cert.not_valid_before_utc
    assert dt.timedelta(days=VALID_DAYS) <= life <= dt.timedelta(days=VALID_DAYS, minutes=6)
    assert ipaddress.ip_address("10.0.0.1") in cert.extensions.get_extension_for_class(
        x509.SubjectAlternativeName
    ).value.get_values_for_type(x509.IPAddress)


def test_the_command_prints_what_it_did(tmp_path: Path) -> None:
    run = [sys.executable, "-m", "vllm_fleet.cli", "tls", "self-signed", "--dest", str(tmp_path)]
    r = subprocess.run([*run, "--name", "gw", "--address", "10.0.0.1"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["changed"] is True
    r = subprocess.run([*run, "--name", "gw", "--address", "10.0.0.1"], capture_output=True, text=True)
    assert json.loads(r.stdout)["changed"] is False
    r = subprocess.run(run, capture_output=True, text=True)
    assert r.returncode == 2 and "at least one host name or address" in r.stdout


def test_spec_needs_paths_or_self_signed() -> None:
    data = load_spec(REPO / "examples/tiny-cpu.yml").model_dump(mode="json")
    data["gateway"]["tls"] = {"port": 8443}
    with pytest.raises(SpecError, match=r"gateway\.tls.*self_signed: true"):
        parse_spec(data)
    data["gateway"]["tls"] = {"self_signed": True}
    tls = parse_spec(data).gateway.tls
    assert tls is not None
    assert tls.certificate == "/etc/nginx/vllm-fleet-tls/gateway.crt"
    assert tls.certificate_key == "/etc/nginx/vllm-fleet-tls/gateway.key"
