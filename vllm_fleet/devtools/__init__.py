"""The test and demo harness, kept apart from the product: systemd-nspawn sandbox hosts (``sandbox``,
``sandbox_image``, ``sandbox_net``), real engine processes and HTTP helpers for tests (``testing``), the
launcher run by a test with a notify socket of its own (``launched``), a private nginx runner and the rendered
gateway for tests, the bench and the demo (``gateway_nginx``, ``gateway_testing``), the local bench lab
(``bench_lab``) and the tiny offline test model and its adapters (``tinymodel``).
Modules here may import anything of vllm_fleet; nothing of the product (``fleet``, ``host``, ``bench``)
imports them, and ``vllm_fleet.cli`` names the ``sandbox``, ``tiny-model`` and ``tiny-adapter`` commands here
only as strings (an installation without this package lacks those commands).
"""
