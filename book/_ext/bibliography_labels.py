"""Author-year labels for the bibliography, "Goyal et al. 2017", with a, b, ... when one
author has two entries in a year ("NVIDIA 2023a", "NVIDIA 2023b"), so that every citation
points to one entry. pybtex's own alpha labels turn LaTeX accents into noise
("GDollarG+17"); these are decoded first.

In _config.yml: bibtex_default_style: authoryear, bibtex_reference_style: label.
"""

import string
from collections import Counter

from pybtex.plugin import find_plugin, register_plugin
from pybtex.richtext import Text
from pybtex.style.formatting.unsrt import Style as UnsrtStyle
from pybtex.style.labels import BaseLabelStyle


def plain(latex):
    """'Doll{\\'a}r' -> 'Dollár', '{NVIDIA}' -> 'NVIDIA'."""
    return Text.from_latex(latex).render_as("text")


def suffix(index):
    """a, b, ..., z, then aa, ab, ...: one author's 27th entry of a year still gets a label."""
    letters = string.ascii_lowercase
    return letters[index] if index < 26 else suffix(index // 26 - 1) + letters[index % 26]


class AuthorYearLabels(BaseLabelStyle):
    def format_labels(self, sorted_entries):
        labels = [self.format_label(entry) for entry in sorted_entries]
        repeated, seen = Counter(labels), Counter()
        for label in labels:
            if repeated[label] > 1:
                yield label + suffix(seen[label])
                seen[label] += 1
            else:
                yield label

    def format_label(self, entry):
        authors = entry.persons.get("author", [])
        names = [plain(" ".join(person.last_names)) for person in authors]
        who = (names[0] if len(names) == 1 else f"{names[0]} and {names[1]}"
               if len(names) == 2 else f"{names[0]} et al.") if names else entry.key
        return f"{who} {entry.fields.get('year', '')}".strip()


class AuthorYearStyle(UnsrtStyle):
    default_label_style = "authoryear"
    default_sorting_style = "author_year_title"


def setup(app):
    # pybtex finds a plugin by scanning every installed package's entry points, on every
    # lookup, unless it was registered at run time: the labels above and sphinxcontrib-
    # bibtex's citations look up the text back end some 780 times a build, which took 9 of
    # the 15 s Sphinx spends. Found once here and registered, they cost nothing after.
    for name in ("text", "plaintext"):
        register_plugin("pybtex.backends", name, find_plugin("pybtex.backends", name),
                        force=True)
    register_plugin("pybtex.style.labels", "authoryear", AuthorYearLabels)
    register_plugin("pybtex.style.formatting", "authoryear", AuthorYearStyle)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
