"""The listings the pages show: each chapter's idea in its own short code (issue 60). Every
`show_source` listing of chapters 1-8 is under 100 lines, and the early chapters' classes do not
carry the later chapters' options. The listings are read from the notebooks' stored outputs, which
nbval holds equal to the library's source (the listing cells are tagged nbval-check-output)."""

import inspect
import json
import re
from pathlib import Path

import attnbook
import pytest

BOOK = Path(__file__).resolve().parents[1] / "book"
EARLY = sorted(p for p in BOOK.glob("0[1-8]_*.ipynb"))


def listings(path):
    """``(code, listing text)`` of each cell of ``path`` that shows a library listing."""
    for cell in json.loads(path.read_text())["cells"]:
        code = "".join(cell["source"])
        if cell["cell_type"] != "code" or "show_source(" not in code:
            continue
        for output in cell.get("outputs", []):
            text = "".join(output.get("data", {}).get("text/plain", ""))
            if text:
                yield code, text


@pytest.mark.parametrize("path", EARLY, ids=lambda p: p.stem)
def test_every_early_listing_is_under_100_lines(path):
    shown = list(listings(path))
    too_long = [(code, text.count("\n") + 1) for code, text in shown if text.count("\n") + 1 >= 100]
    assert not too_long, too_long


@pytest.mark.parametrize("obj, later", [
    (attnbook.MultiHeadAttention, ("num_kv_heads", "qk_norm", "repeat_kv", "rope")),
    (attnbook.blocks.Block, ("rms", "swiglu", "experts", "num_kv_heads")),
    (attnbook.EncoderBlock, ("rms", "swiglu", "experts", "num_kv_heads")),
    (attnbook.GPT, ("mla", "experts", "num_kv_heads=", "qk_norm", "latent")),
])
def test_early_classes_carry_no_later_chapters_options(obj, later):
    source = inspect.getsource(obj)
    assert len(source.splitlines()) < 100
    found = [word for word in later if re.search(rf"\b{re.escape(word)}", source)]
    assert not found, found


def _namespace():
    """``attnbook`` and its submodules by their short names, as the notebooks import them."""
    import importlib
    import pkgutil

    names = {"attnbook": attnbook}
    for module in pkgutil.iter_modules(attnbook.__path__):
        names[module.name] = importlib.import_module(f"attnbook.{module.name}")
    return names


def test_every_stored_listing_is_the_library_as_it_is():
    """A page's stored `show_source` output equals the source it names today, so a library change
    that leaves a page's listing behind fails here in seconds rather than in nbval."""
    namespace, checked, stale = _namespace(), 0, []
    for path in sorted(BOOK.glob("[0-9][0-9]_*.ipynb")):
        for cell in json.loads(path.read_text())["cells"]:
            code = "".join(cell["source"]).strip()
            call = re.fullmatch(r"attnbook\.show_source\(([\w.]+)\)", code)
            if cell["cell_type"] != "code" or not call:
                continue
            try:
                obj = eval(call.group(1), dict(namespace))  # a name such as vit.ViT.resize
            except (NameError, AttributeError):
                continue  # an object the notebook made itself
            if inspect.ismodule(obj) and hasattr(obj, call.group(1)):
                obj = getattr(obj, call.group(1))  # `from attnbook.train import train`
            shown = [
                "".join(output["data"]["text/markdown"])
                for output in cell.get("outputs", [])
                if "text/markdown" in output.get("data", {})
            ]
            checked += 1
            if shown != [attnbook.show_source(obj)._repr_markdown_()]:
                stale.append(f"{path.name}: {call.group(1)}")
    assert checked > 50, checked
    assert not stale, f"listings older than the library (re-execute these pages): {stale}"
