"""The layout of the package: no import circle among the modules of e3attn, the public import paths of the
neighbour graphs that moved into ``e3attn/graph/`` still work (pickles included), and the page that describes
the layout names every module."""
import pickle
import re
import textwrap

import torch

import e3attn
from e3attn.graph import complete_graph, radius_graph, radius_graph_pbc
from import_graph import ROOT, Import, broken_circles, cycles, module_files, package_imports

LAYOUT_PAGE = ROOT / "docs" / "guide" / "layout.rst"


def write_package(root, files):
    for name, source in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(source))


def test_import_graph_finds_circles_through_packages_and_leaves_out_deferred_and_type_checking_imports(tmp_path):
    write_package(tmp_path, {
        "pkg/__init__.py": "from pkg.a import f\n",
        "pkg/a.py": """\
            from . import b, e

            def f():
                from pkg import c  # deferred: closes pkg.a -> pkg.c -> pkg.a only when called
            """,
        "pkg/b.py": "import pkg.sub.d  # runs pkg/sub/__init__.py first\n",
        "pkg/sub/__init__.py": "from ..a import f\n",
        "pkg/sub/d.py": "import math\n",
        "pkg/c.py": "from pkg.a import f\n",
        "pkg/e.py": """\
            from typing import TYPE_CHECKING

            if TYPE_CHECKING:
                from pkg.a import f
            """,
    })
    found = package_imports(tmp_path / "pkg")
    assert set(module_files(tmp_path / "pkg")) == {"pkg", "pkg.a", "pkg.b", "pkg.c", "pkg.e", "pkg.sub", "pkg.sub.d"}
    assert Import("pkg.b", "pkg.sub", 1, False) in found  # the package above pkg.sub.d: its __init__ runs
    assert Import("pkg.a", "pkg.c", 4, True) in found
    assert not [item for item in found if item.importer == "pkg.e"]  # only under a type checker
    assert cycles(found) == [["pkg.a", "pkg.b", "pkg.sub", "pkg.a"]]
    assert broken_circles(found) == ["pkg.a ~> pkg.c -> pkg.a"]


def test_no_import_circle_among_the_modules_of_e3attn():
    found = package_imports(ROOT / "e3attn")
    eager = {(item.importer, item.target) for item in found if not item.deferred}
    assert ("e3attn.attention", "e3attn.graph") in eager and ("e3attn.graph.radius", "e3attn.graph.search") in eager
    assert cycles(found) == [], "import circles: " + "; ".join(" -> ".join(circle) for circle in cycles(found))


def test_graph_functions_keep_their_public_paths():
    assert e3attn.graph.__all__ == ["radius_graph", "radius_graph_pbc", "complete_graph"]
    assert (e3attn.radius_graph, e3attn.radius_graph_pbc, e3attn.complete_graph) == (
        radius_graph, radius_graph_pbc, complete_graph)
    for function in (radius_graph, radius_graph_pbc, complete_graph):
        assert function.__module__ == "e3attn.graph"
        assert pickle.loads(pickle.dumps(function)) is function
        # protocol 2 spells the global out: module, newline, name (the pickles written before the package)
        assert pickle.dumps(function, protocol=2) == b"\x80\x02ce3attn.graph\n" + function.__name__.encode() + b"\nq\x00."


def test_graph_operators_keep_their_names():
    pos = torch.tensor([[0.0, 0.0, 0.0], [1.0, 0.0, 0.0], [0.0, 1.5, 0.0]])
    # points 0 and 1 are 1 apart, point 2 is 1.5 and 1.8 away: one pair, both directions, sorted by dst
    expected = torch.tensor([[1, 0], [0, 1]])
    assert torch.equal(torch.ops.e3attn.radius_graph(pos, 1.2, None, False, None), expected)
    # one point in a unit cell periodic along x: its images at x = -1 and x = +1
    edge_index, shifts = torch.ops.e3attn.radius_graph_pbc(
        pos[:1], torch.eye(3)[None], torch.tensor([[True, False, False]]), 1.5, None)
    assert torch.equal(edge_index, torch.zeros(2, 2, dtype=torch.long))
    assert torch.equal(shifts, torch.tensor([[-1.0, 0.0, 0.0], [1.0, 0.0, 0.0]]))


def test_layout_page_names_every_module():
    page = LAYOUT_PAGE.read_text()
    named = set(re.findall(r"``(e3attn(?:\.\w+)*)``", page))
    missing = sorted(set(module_files(ROOT / "e3attn")) - named)
    assert not missing, f"docs/guide/layout.rst does not name {missing}"
    assert not sorted(named - set(module_files(ROOT / "e3attn"))), "the layout page names modules that do not exist"
