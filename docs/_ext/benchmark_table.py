"""Sphinx directive ``benchmark-results``: the dense-vs-sparse benchmark, rendered from its JSON at build time.

Usage in a page::

    .. benchmark-results:: _static/dense_vs_sparse.json

renders the JSON written by ``benchmarks/dense_vs_sparse.py`` (path relative to the docs source folder): a line
on the machine and the settings, one table per mechanism (time of the forward and forward + backward passes and
peak memory of the dense and the sparse form, for every graph density and size), the crossover points, and the
figure of the same name with ``.png`` when it exists. Without the file, a note says how to produce it. The page
is rebuilt when the file changes.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from docutils import nodes
from sphinx.util.docutils import SphinxDirective

FORMS = ("dense", "sparse")
PASSES = (("fwd_s", "fwd"), ("fwdbwd_s", "fwd+bwd"))


def _cell(text: str) -> nodes.entry:
    entry = nodes.entry()
    entry += nodes.paragraph(text=text)
    return entry


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> nodes.table:
    """A docutils table with one header row."""
    table = nodes.table(classes=["benchmark-table"])
    group = nodes.tgroup(cols=len(header))
    table += group
    group.extend(nodes.colspec(colwidth=1) for _ in header)
    head, body = nodes.thead(), nodes.tbody()
    for target, cells in [(head, [header]), (body, rows)]:
        for cells_of_row in cells:
            row = nodes.row()
            row.extend(_cell(text) for text in cells_of_row)
            target += row
    group += head
    group += body
    return table


def _threads(count: Optional[int]) -> str:
    return "default threads" if count is None else f"{count} thread{'s' if count != 1 else ''}"


def _number(value: float) -> str:
    return f"{value:.0f}" if value >= 100 else f"{value:.3g}"


def _entry(row: Optional[dict], key: str, scale: float) -> str:
    """A measurement, ``skipped`` when the benchmark left the size out, empty when it was not measured."""
    if row is None or (row.get(key) is None and not row["skipped"]):
        return ""
    return "skipped" if row["skipped"] else _number(row[key] * scale)


def _kind_table(results: List[dict], kind: str) -> nodes.table:
    """Rows (density, N); columns: edges, then per pass and form the time in ms, then memory per form.

    Sizes skipped in both forms are left out.
    """
    header = ["graph", "N", "edges"]
    header += [f"{name} {form} [ms]" for _, name in PASSES for form in FORMS]
    header += [f"memory {form} [MiB]" for form in FORMS]
    by_key: Dict[tuple, dict] = {(r["density"], r["n"], r["form"]): r for r in results if r["kind"] == kind}
    rows = []
    for density, n in sorted({(d, n) for d, n, _ in by_key}):
        forms = [by_key.get((density, n, form)) for form in FORMS]
        measured = [r for r in forms if r is not None]
        if all(r["skipped"] for r in measured):
            continue
        row = [density, str(n), str(measured[0]["edges"])]
        row += [_entry(r, key, 1e3) for key, _ in PASSES for r in forms]
        row += [_entry(r, "fwdbwd_mb", 1.0) for r in forms]
        rows.append(row)
    return _table(header, rows)


def _crossover_text(name: str, c: dict) -> str:
    kind, density, what = name.split("/")
    label = f"{kind} attention, {density} graph, {'forward + backward' if what == 'fwdbwd' else 'forward'}: "
    if not c["sizes"]:
        return label + "no size measured in both forms"
    if c["n"] is None:
        return label + f"dense faster up to the largest size measured in both forms (N = {c['sizes'][-1]})"
    if c["interpolated"] is None:
        return label + f"sparse faster from the smallest size measured (N = {c['n']})"
    return label + f"sparse faster from N = {c['n']} (equal times near N = {c['interpolated']:.0f})"


def _settings(meta: dict, source: str) -> str:
    plain, equivariant = meta["plain"], meta["equivariant"]
    return (
        f"Measured on {meta['device_type']} ({meta['device']}, {_threads(meta.get('threads'))}), "
        f"torch {meta['torch']}, {meta['dtype'].replace('torch.', '')}, {meta['date']}; radius graphs with about "
        f"{meta['neighbours']:g} neighbours; plain attention: {plain['heads']} heads of size {plain['head_dim']}; "
        f"equivariant layer: {equivariant['irreps']}, lmax {equivariant['lmax']}, {equivariant['heads']} heads. "
        f"Times are the best of repeated calls in milliseconds, memory the peak of a forward + backward pass "
        f"({meta['memory_method']}); 'skipped': the benchmark left out a size whose estimated time or memory was "
        f"over its limits. Source: {source}."
    )


class BenchmarkResults(SphinxDirective):
    """Render a benchmark JSON (and its figure)."""

    required_arguments = 1

    def run(self) -> List[nodes.Node]:
        source = self.arguments[0]
        path = Path(self.env.srcdir) / source
        self.env.note_dependency(str(path.resolve()))
        if not path.is_file():
            note = nodes.note()
            note += nodes.paragraph(
                text=f"No benchmark results in {source}: python benchmarks/dense_vs_sparse.py writes them."
            )
            return [note]
        report = json.loads(path.read_text())
        results = report["results"]
        out: List[nodes.Node] = [nodes.paragraph(text=_settings(report["meta"], source))]
        for kind in dict.fromkeys(r["kind"] for r in results):
            out += [nodes.rubric(text=f"{kind} attention"), _kind_table(results, kind)]
        crossovers = report.get("crossover", {})
        if crossovers:
            out.append(nodes.rubric(text="crossover (sparse faster than dense)"))
            items = nodes.bullet_list()
            for name, c in crossovers.items():
                item = nodes.list_item()
                item += nodes.paragraph(text=_crossover_text(name, c))
                items += item
            out.append(items)
        if path.with_suffix(".png").is_file():
            figure = nodes.figure()
            figure += nodes.image(uri="/" + str(Path(source).with_suffix(".png")), alt="dense vs sparse benchmark")
            figure += nodes.caption(text="Time and peak memory against the number of nodes, dense and sparse forms.")
            out.append(figure)
        return out


def setup(app):
    app.add_directive("benchmark-results", BenchmarkResults)
    return {"version": "1.0", "parallel_read_safe": True, "parallel_write_safe": True}
