"""Sphinx extension: launch buttons (Colab, Binder) only for a book whose ``repository.url`` is set.

Jupyter Book 1 builds the buttons from ``repository.url`` in ``_config.yml``; left unset, it would
point them at its own default repository, and an empty url makes the theme fail. This extension
removes the buttons unless the url names the book's own repository.
"""

JUPYTER_BOOK_DEFAULT = "https://github.com/executablebooks/jupyter-book"


def repository_url(theme_options: dict) -> str:
    """The book's repository url, or "" when ``_config.yml`` does not set one."""
    url = str(theme_options.get("repository_url") or "").strip().rstrip("/")
    return "" if url == JUPYTER_BOOK_DEFAULT else url


def drop_launch_buttons_without_repository(app, config) -> None:
    options = config.html_theme_options
    if not repository_url(options):
        options["launch_buttons"] = {}


def setup(app):
    app.connect("config-inited", drop_launch_buttons_without_repository)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
