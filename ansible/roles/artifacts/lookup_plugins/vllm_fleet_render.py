"""Lookup ``vllm_fleet_render``: render artifact items on the controller, as ``ansible.builtin.template`` does.

The artifacts role used to run one ``ansible.builtin.template`` task item per file: a remote round trip per
file even when nothing changed. This lookup renders every item of a component in-process on the controller
with the template action's own code path and settings (the templar, ``trim_blocks``/``lstrip_blocks``, the
``ansible_managed``/``template_*`` variables, the template's folder on the search path) so the role can
compare all checksums in one round trip and write only what differs.

Terms: artifact items of ``vf.artifacts`` (``vllm-fleet context``): ``src`` (template path, or empty for a
generated item that carries its ``content``), ``dest``, ``mode``, ``instance`` (the template variable
``instance``), ... Keyword ``root``: a prefix of every destination (a staging tree). Returns, per item, the
item without ``instance`` plus ``content`` (the rendered text), ``checksum`` (its sha1, as the copy module
computes it) and ``path`` (root + dest).
"""

from __future__ import annotations

import hashlib
import os
from typing import Any

from ansible.errors import AnsibleError
from ansible.module_utils.common.text.converters import to_bytes
from ansible.plugins.lookup import LookupBase
from ansible.template import trust_as_template

try:  # the builtin template action and lookup add these variables (ansible_managed, template_path, ...)
    from ansible._internal._templating._template_vars import generate_ansible_template_vars
except ImportError:  # pragma: no cover - older ansible-core
    from ansible.template import generate_ansible_template_vars  # type: ignore[attr-defined,no-redef]

DOCUMENTATION = """
name: vllm_fleet_render
short_description: render vllm-fleet artifact items on the controller (as ansible.builtin.template does)
description:
  - Renders each item's template with trim_blocks and lstrip_blocks (the settings of vllm-fleet render) and
    returns the items with their content and sha1 checksum.
options:
  _terms:
    description: artifact items (dicts with src, dest, mode, instance, content)
    required: true
  root:
    description: prefix of every destination path
    type: str
    default: ""
"""


class LookupModule(LookupBase):
    def run(self, terms: list[Any], variables: dict[str, Any] | None = None, **kwargs: Any) -> list[Any]:
        variables = variables or {}
        self.set_options(var_options=variables, direct=kwargs)
        root = self.get_option("root") or ""
        items: list[dict[str, Any]] = []
        for term in terms:
            items.extend(term if isinstance(term, list) else [term])
        out = []
        for item in items:
            if item.get("src"):
                content = self._render(item["src"], item.get("dest", ""), item.get("instance"), variables)
            else:
                content = item.get("content", "")
            rendered = {k: v for k, v in item.items() if k != "instance"}
            rendered["content"] = content
            rendered["checksum"] = hashlib.sha1(to_bytes(content, errors="surrogate_or_strict")).hexdigest()
            rendered["path"] = root + item.get("dest", "")
            out.append(rendered)
        return out

    def _render(self, src: str, dest: str, instance: Any, variables: dict[str, Any]) -> str:
        if not os.path.isfile(src):
            raise AnsibleError(f"vllm_fleet_render: template {src} not found")
        data = trust_as_template(self._loader.get_text_file_contents(src))
        # the template action's search path: the play's, the loader's base folder, the template's folder,
        # each also with a templates/ subfolder
        searchpath = [*variables.get("ansible_search_path", []), self._loader._basedir, os.path.dirname(src)]
        searchpath = [q for p in searchpath for q in (os.path.join(p, "templates"), p)]
        local = dict(variables)
        local.update(
            generate_ansible_template_vars(
                path=src, fullpath=src, dest_path=dest, include_ansible_managed="ansible_managed" not in local
            )
        )
        local["instance"] = instance
        templar = self._templar.copy_with_new_env(searchpath=searchpath, available_variables=local)
        overrides = {"trim_blocks": True, "lstrip_blocks": True, "newline_sequence": "\n"}
        result = templar.template(data, escape_backslashes=False, overrides=overrides)
        return "" if result is None else str(result)
