"""scripts/make_source_archive.py: the zip a reader of the site downloads to run the book."""

import importlib.util
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("make_source_archive", ROOT / "scripts" / "make_source_archive.py")
archive_script = importlib.util.module_from_spec(spec)
spec.loader.exec_module(archive_script)


def make_tree(root: Path) -> None:
    for name in archive_script.INCLUDE:
        path = root / name
        if "." in Path(name).name or name in ("Makefile", "LICENSE", ".ci/run"):
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(f"{name}\n")
        else:
            (path / "sub").mkdir(parents=True)
            (path / "sub" / "a.py").write_text("x = 1\n")
    (root / "lib" / "__pycache__").mkdir()
    (root / "lib" / "__pycache__" / "a.cpython-311.pyc").write_bytes(b"\0")
    (root / "book" / ".ipynb_checkpoints").mkdir()
    (root / "book" / ".ipynb_checkpoints" / "x.ipynb").write_text("{}")
    (root / "lib" / "attnbook.egg-info").mkdir()
    (root / "lib" / "attnbook.egg-info" / "PKG-INFO").write_text("x")


def test_archive_holds_the_source_and_no_caches_and_is_reproducible(tmp_path):
    root = tmp_path / "repo"
    make_tree(root)
    first = archive_script.write_archive(tmp_path / "a.zip", root)
    second = archive_script.write_archive(tmp_path / "b.zip", root)
    assert first.read_bytes() == second.read_bytes()  # fixed timestamps: same files, same bytes
    names = zipfile.ZipFile(first).namelist()
    assert "attention-and-transformers/Makefile" in names
    assert "attention-and-transformers/lib/sub/a.py" in names
    assert all(name.startswith("attention-and-transformers/") for name in names)
    assert not [n for n in names if "__pycache__" in n or "checkpoints" in n or "egg-info" in n]


def test_archive_of_the_repository_has_what_make_lab_needs():
    names = {path.as_posix() for path in archive_script.source_files()}
    for needed in ("Makefile", "requirements.txt", "pyproject.toml", "LICENSE", "lib/attnbook/__init__.py",
                   "README.md", "CONTRIBUTING.md", "book/_ext/archive_size.py", "_static/book.css",
                   "book/01_attention.ipynb", "book/data/shakespeare.txt.gz", "scripts/execute_notebooks.py"):
        assert needed in names


def test_a_missing_file_is_an_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="the source archive needs it"):
        archive_script.source_files(tmp_path)


size_spec = importlib.util.spec_from_file_location("archive_size", ROOT / "book" / "_ext" / "archive_size.py")
archive_size = importlib.util.module_from_spec(size_spec)
size_spec.loader.exec_module(archive_size)


@pytest.mark.parametrize(
    ("size_bytes", "words"),
    [(0, "0 kB"), (400, "1 kB"), (850_000, "850 kB"), (999_499, "999 kB"), (1_000_000, "1.0 MB"), (7_400_000, "7.4 MB"),
     (9_940_000, "9.9 MB"), (9_960_000, "10 MB"), (10_078_154, "10 MB"), (123_456_789, "123 MB")],
)
def test_archive_size_in_words(size_bytes, words):
    assert archive_size.size_in_words(size_bytes) == words


def test_archive_size_is_given_to_the_pages_as_a_substitution(tmp_path):
    """book/intro.md writes {{ archive_size }}; the extension fills it from the built archive, and a
    build without the archive stops with an error saying how to make it."""
    from types import SimpleNamespace

    from sphinx.errors import ExtensionError

    config = SimpleNamespace(myst_substitutions={"other": "kept"})
    app = SimpleNamespace(confdir=str(tmp_path))
    with pytest.raises(ExtensionError, match="make_source_archive.py"):
        archive_size.add_archive_size(app, config)
    archive = tmp_path / archive_size.ARCHIVE
    archive.parent.mkdir(parents=True)
    archive.write_bytes(b"\0" * 2_345_678)
    archive_size.add_archive_size(app, config)
    assert config.myst_substitutions == {"other": "kept", "archive_size": "2.3 MB"}
    intro = (ROOT / "book" / "intro.md").read_text()
    assert "{{ archive_size }}" in intro
    config_yml = (ROOT / "_config.yml").read_text()
    assert "archive_size: book/_ext" in config_yml and "- archive_size" in config_yml
