"""Sphinx extension: the references page labels each entry as the text cites it, "Vaswani et al., 2017".

The chapters cite author-year (``bibtex_reference_style: author_year`` in ``_config.yml``), while
pybtex's built-in bibliography styles label the list with numbers or alpha keys ("[VSP+17]"), so a
reader would see two names for one paper. This registers a pybtex label style with the same form as
the citations, and a formatting style (pybtex's "plain", sorted by author and year) that uses it;
``bibtex_default_style: author_year_plain`` selects it.
"""

from pybtex.plugin import register_plugin
from pybtex.style.formatting.plain import Style as PlainStyle
from pybtex.style.labels import BaseLabelStyle


def author_year_label(entry) -> str:
    """"Vaswani et al., 2017", "Graves and Jaitly, 2014", "Bahdanau, 2015": the authors' last names
    (et al. beyond two; the editors, or the title, when there are no authors) and the year."""
    people = entry.persons.get("author") or entry.persons.get("editor") or []
    names = [" ".join(person.prelast_names + person.last_names) or " ".join(person.first_names)
             for person in people]  # "van den Oord": the von part belongs to the name
    if not names:
        who = entry.fields.get("title", entry.key)
    elif len(names) == 1:
        who = names[0]
    elif len(names) == 2:
        who = f"{names[0]} and {names[1]}"
    else:
        who = f"{names[0]} et al."
    who = who.replace("{", "").replace("}", "")
    return f"{who}, {entry.fields.get('year', 'n.d.')}"


class AuthorYearLabelStyle(BaseLabelStyle):
    def format_labels(self, sorted_entries):
        seen: dict[str, int] = {}
        for entry in sorted_entries:
            label = author_year_label(entry)
            seen[label] = seen.get(label, 0) + 1
            # two papers with one label (same first author and year) get 2017a, 2017b
            yield label if seen[label] == 1 else f"{label}{chr(ord('a') + seen[label] - 1)}"


class AuthorYearPlainStyle(PlainStyle):
    default_label_style = "author_year"


def setup(app):
    register_plugin("pybtex.style.labels", "author_year", AuthorYearLabelStyle)
    register_plugin("pybtex.style.formatting", "author_year_plain", AuthorYearPlainStyle)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
