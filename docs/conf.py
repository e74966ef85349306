"""Sphinx configuration of the docs site: `make docs` builds it into build/docs with warnings
as errors; Read the Docs builds it with .readthedocs.yaml.

The pages are the Markdown files of this folder (MyST). The home page is README.md and the
benchmarks page bench/README.md, read from where they live when the site is built (index.md and
benchmarks.md here only point to them), with their links made relative to the site. The API
reference's signatures and docstrings come from the code (autodoc), which needs Django set up.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

import django
from django.conf import settings
from sphinx.application import Sphinx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

settings.configure(
    INSTALLED_APPS=["django.contrib.contenttypes", "django.contrib.auth", "advisory_lock"],
    DATABASES={"default": {"ENGINE": "django.db.backends.sqlite3", "NAME": ":memory:"}},
)
django.setup()

project = "django-advisory-lock"
author = "django-advisory-lock contributors"
copyright = "django-advisory-lock contributors"

extensions = ["myst_parser", "sphinx.ext.autodoc"]
source_suffix = {".md": "markdown"}
root_doc = "index"

# GitHub's anchors, so that `page.md#a-heading` links work on GitHub and on the site alike.
myst_heading_anchors = 4

autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_preserve_defaults = True
# A module attribute's value is an object's repr (a Signal, a helper instance): left out (an
# autodata directive's; automodule's members keep theirs).
autodoc_default_options = {"no-value": True}

html_theme = "furo"
html_title = "django-advisory-lock"
html_copy_source = False

# Site page -> the file it is read from, relative to the repository's root.
GENERATED = {"index": "README.md", "benchmarks": "bench/README.md"}

# The site's navigation: the README's order, then any other page of this folder.
NAV = [
    "semantics",
    "deployment",
    "jobs",
    "scheduler",
    "operations",
    "testing",
    "inspection",
    "signals",
    "settings",
    "api",
    "guarantees",
    "benchmarks",
]
NAV += sorted(p.stem for p in Path(__file__).parent.glob("*.md") if p.stem not in [*NAV, "index"])

# Links to a page, from the README (relative, or absolute to the repository on GitHub, as PyPI
# needs them), from bench/README.md and from the docs pages, made links within the site:
# ``docs/x.md`` becomes ``x.md``, ``bench/README.md`` becomes ``benchmarks.md``.
REPOSITORY = "https://github.com/django-advisory-lock/django-advisory-lock"
_FROM = r"\]\((?:" + re.escape(REPOSITORY) + r"/blob/[^/)]+/|\.\./)?"
_TO_DOCS = re.compile(_FROM + "docs/")
_TO_BENCH = re.compile(_FROM + r"bench/README\.md")

# Classes that the library makes, not its users: no constructor signature.
NO_SIGNATURE = {"advisory_lock.LockHandle", "advisory_lock.HeldLock", "advisory_lock.JobRun"}


def site_links(markdown: str) -> str:
    """The Markdown with its links to the docs pages and the benchmarks made site links."""
    return _TO_BENCH.sub("](benchmarks.md", _TO_DOCS.sub("](", markdown))


def read_source(app: Sphinx, docname: str, source: list[str]) -> None:
    if docname in GENERATED:
        path = ROOT / GENERATED[docname]
        app.env.note_dependency(str(path))
        source[0] = path.read_text(encoding="utf-8")
    if docname == root_doc:
        source[0] += "\n```{toctree}\n:hidden:\n\n" + "\n".join(NAV) + "\n```\n"
    source[0] = site_links(source[0])


def hide_signature(
    app: Sphinx,
    what: str,
    name: str,
    obj: Any,
    options: Any,
    signature: str | None,
    return_annotation: str | None,
) -> tuple[str, str | None] | None:
    return ("", return_annotation) if name in NO_SIGNATURE else None


def setup(app: Sphinx) -> None:
    app.connect("source-read", read_source)
    app.connect("autodoc-process-signature", hide_signature)
