"""Sphinx configuration of the e3attn documentation.

Build (warnings are errors, code cells executed, figures generated)::

    sphinx-build -W --keep-going -b html docs docs/_build/html
"""
import functools
import importlib
import inspect
import os
import sys

import e3attn

DOCS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(DOCS)
sys.path.insert(0, os.path.join(DOCS, "_ext"))

project = "e3attn"
author = "the e3attn developers"
copyright = "2026, the e3attn developers"
version = release = e3attn.__version__

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.mathjax",
    "sphinx-mathjax-offline",  # MathJax 3 served from the build itself: the site works offline
    "sphinx.ext.viewcode",
    "jupyter_sphinx",
    "benchmark_table",
]

exclude_patterns = ["_build"]
html_theme = "furo"
html_title = f"e3attn {release}"
html_static_path = ["_static"]
html_css_files = ["e3attn.css"]

# Every cross-reference must resolve (internal links are checked at build time). Objects of other
# projects are not indexed here (no intersphinx: the build runs offline), so their names are exempt.
nitpicky = True
nitpick_ignore_regex = [
    (r"py:.*", r"(torch|e3nn|o3|numpy|np|networkx|matplotlib|Figure|Axes|argparse|pathlib|os|typing)(\..*)?"),
    (r"py:.*", r"(Tensor|ArrayLike|IrrepsLike|IrrepsSpec|AttentionHook|optional)"),
]

autodoc_member_order = "bysource"
autodoc_inherit_docstrings = False  # else forward() without a docstring shows torch.nn.Module.forward's
autodoc_typehints = "signature"
napoleon_google_docstring = True
napoleon_numpy_docstring = True
napoleon_custom_sections = ["Shapes"]

# Code cells: one Jupyter kernel per page; an exception or output on stderr fails the build.
# Cells run from the repository root, like the commands of the README.
jupyter_execute_kwargs = {"timeout": 600, "allow_errors": True, "store_widget_state": False, "cwd": ROOT}
jupyter_sphinx_require_url = ""  # no widgets: no require.js from a CDN


def _local_asset(name: str) -> bool:
    return not name.startswith(("http:", "https:")) and "thebelab" not in name


def _drop_remote_assets(app, pagename, templatename, context, doctree):
    """No page loads scripts or styles from the network (the site is read offline) or files never copied."""
    for key in ("script_files", "css_files"):
        if key in context:
            context[key] = [asset for asset in context[key] if _local_asset(str(getattr(asset, "filename", asset)))]


def _skip_namedtuple_fields(app, what, name, obj, skip, options):
    """NamedTuple fields are described by their class's ``Attributes:`` section; skip the generated duplicates."""
    if (getattr(obj, "__doc__", None) or "").startswith("Alias for field number"):
        return True
    return None


def _resolve_top_level_alias(app, env, node, contnode):
    """``e3attn.X`` (the top-level re-export users type) resolves to where ``X`` is documented."""
    target = node.get("reftarget", "")
    if node.get("refdomain") != "py" or not target.startswith("e3attn.") or target.count(".") != 1:
        return None
    obj = getattr(e3attn, target.split(".")[1], None)
    module = getattr(obj, "__module__", None)
    if module is None or module == "e3attn":
        return None
    node["reftarget"] = f"{module}.{obj.__name__}"
    domain = env.get_domain("py")
    return domain.resolve_xref(env, node["refdoc"], app.builder, node["reftype"], node["reftarget"], node, contnode)


def _defining_module(app, modname, attribute):
    """viewcode: the module that defines a function whose ``__module__`` is the package exporting it
    (:func:`e3attn.graph.radius_graph` is written in ``e3attn/graph/radius.py``)."""
    try:
        obj = functools.reduce(getattr, attribute.split("."), importlib.import_module(modname))
    except (ImportError, AttributeError):
        return None
    code = getattr(obj, "__code__", None)
    module = inspect.getmodule(code) if code is not None else None
    return module.__name__ if module is not None else None


def setup(app):
    app.connect("html-page-context", _drop_remote_assets)
    app.connect("autodoc-skip-member", _skip_namedtuple_fields)
    app.connect("missing-reference", _resolve_top_level_alias)
    app.connect("viewcode-follow-imported", _defining_module)
