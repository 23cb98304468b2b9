"""A mkdocs hook: the docstrings' reST cross-reference roles shown as plain code on the site.

The code's docstrings write ``:class:`PlanError``` and ``:func:`~planner.spec_plan.plan_spec```
for Sphinx; mkdocstrings renders docstrings as markdown, where the role stays as literal text
before the code span (":class:PlanError"). Rewriting every docstring would touch files across
the project for the site's sake alone, so the roles are dropped from the rendered pages instead,
and a ``~`` keeps only the last dotted name, as Sphinx shows it.
"""

from __future__ import annotations

import re
from typing import Any

ROLE = re.compile(r":(?:py:)?(?:class|func|meth|data|attr|exc|mod|obj|const):<code>(~?)([^<]*)</code>")


def _code(match: re.Match[str]) -> str:
    tilde, name = match.groups()
    return f"<code>{name.rsplit('.', 1)[-1] if tilde else name}</code>"


def on_page_content(html: str, **kwargs: Any) -> str:
    return ROLE.sub(_code, html)
