"""scripts/link_glossary_terms.py: each glossary term linked at its first use on a page."""

import importlib.util
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("link_glossary_terms", ROOT / "scripts" / "link_glossary_terms.py")
linker = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = linker  # dataclasses look their module up
spec.loader.exec_module(linker)

GLOSSARY = """# Glossary

```{glossary}
:sorted:

KV cache
  The keys and values kept between steps.

grouped-query attention
GQA
  Query heads share key/value heads.

linear attention
  Attention with features.

attention
  A soft lookup.

CTC
  A loss.
```
"""


def terms(tmp_path):
    path = tmp_path / "glossary.md"
    path.write_text(GLOSSARY)
    return linker.glossary_terms(path)


def test_glossary_terms_keep_aliases_together(tmp_path):
    found = {term.name: term.aliases for term in terms(tmp_path)}
    assert found["grouped-query attention"] == ("grouped-query attention", "GQA")
    assert found["KV cache"] == ("KV cache",) and set(found) == {
        "KV cache", "grouped-query attention", "linear attention", "attention", "CTC"}


def test_first_use_in_prose_is_linked_once(tmp_path):
    sources = [
        "# KV caches\n\nWe keep `KV cache` in code, $KV cache$ in math and {cite:p}`x` here.",
        "",  # a code cell
        "The KV caches grow. A KV cache again. GQA shares heads; grouped-query attention too.",
        "Linear attention is not plain attention; the ctc loss is lower case, CTC is not.",
    ]
    links = linker.find_links(sources, terms(tmp_path))
    roles = [(link.cell, link.role) for link in links]
    assert roles == [
        (2, "{term}`KV caches <KV cache>`"),  # plural, first use outside heading, code, math
        (2, "{term}`GQA <grouped-query attention>`"),  # an alias stands for its term
        (3, "{term}`Linear attention <linear attention>`"),  # any case for a lower-case term
        (3, "{term}`CTC`"),  # a capitalised term only as written
    ]  # "attention" is a common word, and inside "linear attention" anyway
    assert linker.apply_links(sources[2], [x for x in links if x.cell == 2]).startswith(
        "The {term}`KV caches <KV cache>` grow. A KV cache again. {term}`GQA <grouped-query attention>`")


def test_a_page_that_links_a_term_already_gets_no_second_link(tmp_path):
    sources = ["The {term}`KV cache` grows; the KV cache again.", "A {term}`GQA` model: grouped-query attention."]
    assert linker.find_links(sources, terms(tmp_path)) == []


def test_write_changes_only_markdown_sources(tmp_path, monkeypatch):
    notebook = {"cells": [
        {"cell_type": "markdown", "id": "a", "metadata": {"literal_numbers": {"4": "why"}},
         "source": ["A KV cache of 4 layers.\n", "Next line."]},
        {"cell_type": "code", "execution_count": 1, "id": "b", "metadata": {}, "outputs": [],
         "source": ["kv_cache = 1  # KV cache"]},
    ], "metadata": {}, "nbformat": 4, "nbformat_minor": 5}
    page = tmp_path / "page.ipynb"
    page.write_text(json.dumps(notebook, indent=1, ensure_ascii=False) + "\n")
    links = linker.find_links(linker.page_sources(page), terms(tmp_path))
    linker.write_links(page, links)
    written = json.loads(page.read_text())
    assert written["cells"][0]["source"] == ["A {term}`KV cache` of 4 layers.\n", "Next line."]
    assert written["cells"][0]["metadata"] == notebook["cells"][0]["metadata"]
    assert written["cells"][1] == notebook["cells"][1]


def test_markdown_page_keeps_its_front_matter(tmp_path):
    page = tmp_path / "intro.md"
    page.write_text("---\ntitle: KV cache\n---\n# Intro\n\nThe KV cache.\n")
    links = linker.find_links(linker.page_sources(page), terms(tmp_path))
    linker.write_links(page, links)
    assert page.read_text() == "---\ntitle: KV cache\n---\n# Intro\n\nThe {term}`KV cache`.\n"


def test_every_glossary_term_of_the_book_is_found():
    names = {term.name for term in linker.glossary_terms()}
    for needed in ("RMSNorm", "grouped-query attention", "attention sink", "capacity factor", "FlashAttention"):
        assert needed in names
