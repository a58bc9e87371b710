"""The documentation says what the code does: the generated reference pages are current, the README's links hold.

The reference pages (docs/reference/*.md) are made by tools/gen_docs.py from the rule registry, the config
dataclasses and the records' to_json; here they are made again in memory and compared with the committed ones.
Nothing is run: the generator only imports the package and reads its source.
"""

from __future__ import annotations

import difflib
import importlib.util
import re
import sys
from types import ModuleType

import pytest
from conftest import ROOT


def generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gen_docs", ROOT / "tools" / "gen_docs.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up while they are made
    spec.loader.exec_module(module)
    return module


GEN = generator()


@pytest.mark.parametrize("name", sorted(GEN.PAGES))
def test_the_reference_page_is_what_the_code_says(name):
    path = GEN.REFERENCE / name
    made = GEN.PAGES[name]()
    committed = path.read_text(encoding="utf-8") if path.exists() else ""
    if committed != made:
        diff = difflib.unified_diff(
            committed.splitlines(), made.splitlines(), "committed", "from the code", lineterm="", n=1
        )
        shown = "\n".join(list(diff)[:40])
        pytest.fail(f"{path.relative_to(ROOT)} is out of date: run python tools/gen_docs.py\n{shown}")


def test_every_cause_and_config_key_is_in_the_reference():
    from fp16doctor.config import explain
    from fp16doctor.diagnosis.rules import rules_by_code

    causes = (GEN.REFERENCE / "causes.md").read_text(encoding="utf-8")
    config = (GEN.REFERENCE / "config.md").read_text(encoding="utf-8")
    assert all(f"{{#{code}}}" in causes for code in rules_by_code())
    assert all(f"`{key}`" in config for key, _, _ in explain())


def test_the_readme_shows_a_generated_diagnosis_and_links_to_pages_that_exist():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    block = re.search(r"<!-- output:start -->\n(.*?)<!-- output:end -->", readme, re.S)
    assert block and "fp16doctor diagnose" in block.group(1), "run python tools/readme_output.py"
    links = re.findall(r"\]\((docs/[^)#]+)", readme)
    assert links and all((ROOT / link).is_file() for link in links), [
        link for link in links if not (ROOT / link).is_file()
    ]
