"""The prose check (scripts/check_prose_numbers.py): a number typed in a notebook's prose must be glued,
printed by the page, written in its code, cited, or marked literal with a reason; and today's book has
none left."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import check_prose_numbers as check  # noqa: E402


def page(tmp_path, prose, *, literal=None, code="x = 1", output=""):
    import json

    markdown = {"cell_type": "markdown", "metadata": {}, "source": prose}
    if literal is not None:
        markdown["metadata"]["literal_numbers"] = literal
    cell = {"cell_type": "code", "metadata": {}, "source": code, "outputs": []}
    if output:
        cell["outputs"] = [{"output_type": "stream", "name": "stdout", "text": output}]
    path = tmp_path / "page.ipynb"
    path.write_text(json.dumps({"cells": [markdown, cell]}))
    return [number for _, number, _ in check.unbacked(path)]


def test_a_typed_measurement_is_found_and_each_way_of_backing_it_passes(tmp_path):
    assert page(tmp_path, "The model reached 93.4 % after 700 steps.") == ["93.4", "700"]
    assert page(tmp_path, "It reached 93.4 %.", output="accuracy 93.4 %\n") == []
    assert page(tmp_path, "It reached 93 %.", output="accuracy 0.93\n") == []  # a share printed
    assert page(tmp_path, "It trains for 700 steps.", code="steps = 700") == []
    assert page(tmp_path, "It reached {glue:text}`acc:.1%` after 7 steps.") == []
    assert page(tmp_path, "Their model reached 28.4 BLEU {cite:p}`vaswani2017`.") == []
    assert page(tmp_path, "Small numbers (3 heads), years (2017) and $x^{512}$ pass.") == []


def test_a_literal_mark_needs_a_reason_and_a_number_the_cell_still_holds(tmp_path):
    prose = "The paper warms up for 4,000 steps."
    assert page(tmp_path, prose, literal={"4000": "the paper's setting"}) == []
    assert page(tmp_path, prose, literal={"4000": " "}) == ["4000"]
    assert page(tmp_path, prose, literal={"4000": "why", "512": "gone"}) == ["512"]


def test_no_number_in_the_book_s_prose_is_unbacked():
    found = [
        f"{path.name} cell {index}: {number}: {context}"
        for path in sorted((ROOT / "book").glob("[0-9][0-9]_*.ipynb"))
        for index, number, context in check.unbacked(path)
    ]
    assert not found, "numbers in the prose that nothing backs:\n" + "\n".join(found)
