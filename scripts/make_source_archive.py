"""Write the book's source as one zip archive, for readers of the site who have no repository.

    python scripts/make_source_archive.py [OUT]   # default _build/source/attention-and-transformers.zip

The archive holds what `make lab` and `make test` need: book/ (the notebooks with their outputs,
data and pages), lib/, tests/, scripts/, _static/ (the site's stylesheet and scripts), the Makefile,
requirements.txt, pyproject.toml, _config.yml, _toc.yml, README.md (for readers), CONTRIBUTING.md
(for contributors), LICENSE and .ci/run, all under one folder `attention-and-transformers/`.
Caches, checkpoints and build output are left out. Every entry gets a fixed timestamp and mode, so
the same files give the same archive, byte for byte.
`make book` runs it before the build, and the book's first page links the archive (Sphinx copies it
into the site) and states its size, read from the file when the build starts
(book/_ext/archive_size.py).
"""

from __future__ import annotations

import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDER = "attention-and-transformers"
DEFAULT_OUT = ROOT / "_build" / "source" / f"{FOLDER}.zip"
INCLUDE = ("book", "lib", "tests", "scripts", "_static", "binder", "Makefile", "requirements.txt", "pyproject.toml",
           "_config.yml", "_toc.yml", "README.md", "CONTRIBUTING.md", "LICENSE", ".ci/run")
SKIP_PARTS = {"__pycache__", ".ipynb_checkpoints", ".pytest_cache", ".ruff_cache", "_build"}
SKIP_SUFFIXES = (".pyc", ".egg-info")
FIXED_TIME = (2026, 1, 1, 0, 0, 0)


def source_files(root: Path = ROOT) -> list[Path]:
    """The files of the archive, relative to ``root``, sorted."""
    files = []
    for name in INCLUDE:
        path = root / name
        if not path.exists():
            raise FileNotFoundError(f"{path} is missing: the source archive needs it")
        candidates = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
        for p in candidates:
            relative = p.relative_to(root)
            if SKIP_PARTS.intersection(relative.parts) or any(part.endswith(SKIP_SUFFIXES) for part in relative.parts):
                continue
            files.append(relative)
    return sorted(files)


def write_archive(out: Path = DEFAULT_OUT, root: Path = ROOT) -> Path:
    out.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(out, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        for relative in source_files(root):
            info = zipfile.ZipInfo(f"{FOLDER}/{relative.as_posix()}", date_time=FIXED_TIME)
            executable = (root / relative).stat().st_mode & 0o111
            info.external_attr = (0o755 if executable else 0o644) << 16
            info.compress_type = zipfile.ZIP_DEFLATED
            archive.writestr(info, (root / relative).read_bytes())
    return out


if __name__ == "__main__":
    path = write_archive(Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT_OUT)
    print(f"{path}: {path.stat().st_size / 1e6:.1f} MB")
