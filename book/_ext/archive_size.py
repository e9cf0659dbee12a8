"""Sphinx extension: the pages state the source archive's size as measured, not as typed.

``make book`` writes the archive (``scripts/make_source_archive.py``) before the build; this
extension reads the file's size when the build starts and gives it to the pages as the MyST
substitution ``{{ archive_size }}`` ("10 MB"), which book/intro.md uses. A build without the
archive stops with an error that says how to make it (the page's download link needs it too).
"""

from __future__ import annotations

from pathlib import Path

from sphinx.errors import ExtensionError

ARCHIVE = Path("_build") / "source" / "attention-and-transformers.zip"  # from the book's root


def size_in_words(size_bytes: int) -> str:
    """A file size as a reader reads it: "10 MB", "7.4 MB", "850 kB" (decimal units)."""
    if size_bytes < 0:
        raise ValueError(f"size_bytes must be >= 0, got {size_bytes}")
    if size_bytes < 1_000_000:
        return f"{max(1 if size_bytes else 0, round(size_bytes / 1000))} kB"
    megabytes = size_bytes / 1e6
    return f"{megabytes:.0f} MB" if megabytes >= 9.95 else f"{megabytes:.1f} MB"


def add_archive_size(app, config) -> None:
    archive = Path(app.confdir) / ARCHIVE
    if not archive.is_file():
        raise ExtensionError(
            f"{archive} is missing: run `python scripts/make_source_archive.py` before the build "
            "(`make book` does)"
        )
    substitutions = dict(config.myst_substitutions or {})
    substitutions["archive_size"] = size_in_words(archive.stat().st_size)
    config.myst_substitutions = substitutions


def setup(app):
    app.connect("config-inited", add_archive_size)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
