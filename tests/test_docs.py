"""Fast checks of the documentation sources (the full build is ``sphinx-build -W --keep-going -b html docs docs/_build/html``).

* every public name (``__all__`` of e3attn, e3attn.testing, e3attn.viz, e3attn.models and the modules they come
  from) appears in the API reference and has a docstring (autodoc silently drops members without one);
* every cross-reference to e3attn in the hand-written pages names an object that exists;
* the README markers the getting-started page includes the two set-up commands from are in place.
"""
import importlib
import pathlib
import re

import pytest

import e3attn

DOCS = pathlib.Path(__file__).resolve().parent.parent / "docs"
README = DOCS.parent / "README.md"
PACKAGES = ["e3attn", "e3attn.testing", "e3attn.viz", "e3attn.models", "e3attn.calculator", "e3attn.train",
            "e3attn.train.cli", "e3attn.train.options", "e3attn.train.config"]


def documented_modules() -> set:
    """Modules rendered with ``.. automodule:: name`` and ``:members:`` in the API pages."""
    modules = set()
    for page in (DOCS / "api").glob("*.rst"):
        blocks = re.findall(r"^\.\. automodule:: (\S+)\n((?:[ \t]+:.*\n)*)", page.read_text(), flags=re.M)
        modules |= {name for name, options in blocks if ":members:" in options}
    return modules


def public_names():
    """``(package, name)`` for every name exported by the public packages."""
    for package in PACKAGES:
        module = importlib.import_module(package)
        for name in module.__all__:
            yield package, name


def resolve(target: str):
    """The object named by a dotted path, importing modules along the way."""
    parts = target.split(".")
    for split in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:split]))
        except ImportError:
            continue
        for attribute in parts[split:]:
            obj = getattr(obj, attribute)
        return obj
    raise ImportError(target)


@pytest.mark.parametrize("package, name", list(public_names()))
def test_public_name_in_api_reference(package, name):
    obj = getattr(importlib.import_module(package), name)
    modules = documented_modules()
    if isinstance(obj, type(e3attn)):  # a subpackage: documented as a module of its own
        assert obj.__name__ in modules, f"{package}.{name}: no '.. automodule:: {obj.__name__}' with :members:"
        return
    home = obj.__module__
    via_package = package in modules and package != "e3attn"  # e3attn itself is documented module by module
    via_home = home in modules and name in getattr(importlib.import_module(home), "__all__", [])
    assert via_package or via_home, f"{package}.{name} (defined in {home}) is in no API page"
    assert (obj.__doc__ or "").strip(), f"{package}.{name} has no docstring: autodoc would leave it out"


def test_cross_references_exist():
    pages = [*DOCS.glob("*.rst"), *DOCS.glob("guide/*.rst")]
    targets = set()
    for page in pages:
        targets |= set(re.findall(r":(?:func|class|meth|mod|attr):`~?(e3attn[\w.]*)`", page.read_text()))
    assert targets, "no cross-references found"
    missing = []
    for target in sorted(targets):
        try:
            resolve(target)
        except (ImportError, AttributeError):
            missing.append(target)
    assert not missing, f"references to objects that do not exist: {missing}"


@pytest.mark.parametrize("marker", ["<!-- main-command -->", "<!-- test-command -->"])
def test_readme_commands_included_by_getting_started(marker):
    # getting_started.rst includes the second line after each marker (the line inside the ```bash fence)
    lines = README.read_text().splitlines()
    assert marker in lines, f"README.md lost the marker {marker}"
    after = lines[lines.index(marker) + 1 : lines.index(marker) + 3]
    assert after[0].startswith("```") and after[1].startswith("pip install"), after
    assert marker in (DOCS / "getting_started.rst").read_text()


def test_getting_started_names_the_main_job_the_readme_runs():
    """The page includes the README's main command: the script it names must be that command's script."""
    lines = README.read_text().splitlines()
    command = lines[lines.index("<!-- main-command -->") + 2]
    (script,) = re.findall(r"examples/\w+\.py", command)
    page = re.sub(r"\s+", " ", (DOCS / "getting_started.rst").read_text())
    named = re.findall(r"runs the main job, ``(examples/\w+\.py)``", page)
    assert named == [script], f"getting_started.rst says the main job is {named}, the README command runs {script}"
