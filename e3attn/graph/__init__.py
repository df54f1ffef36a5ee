r"""Neighbour graphs for point clouds: radius graphs (open and periodic) and complete graphs.

Edges are ``edge_index = (src, dst)``, ``[2, E]`` int64; messages flow ``src -> dst``
(the torch_cluster / PyG convention) and every graph here is sorted by ``dst``, then
``src`` (then the periodic shift), so each node's incoming edges form one contiguous,
ordered block (CSR order).

Two points are neighbours when their squared distance, evaluated in the dtype of
``pos``, is strictly below ``r_max**2``. The search never builds an ``N x N`` matrix: on
CPU it runs the compiled cell list of `vesin <https://luthaf.fr/vesin>`_, on other
devices ``torch_cluster`` when installed and otherwise a cell list written in PyTorch; a
final exact test makes every backend return the same edges.

The searches are the custom operators ``e3attn::radius_graph`` and
``e3attn::radius_graph_pbc``, whose number of edges is data-dependent: a function that
builds its graph compiles with ``torch.compile(fullgraph=True)``, and the value checks
(finite positions, graph indices) run inside the operators, also when compiled.

The modules of the package, in the order a call runs through them: ``radius`` (the public radius graphs and
their custom operators) checks the arguments with ``checks``, finds candidate pairs with a backend of ``search``
(vesin, torch_cluster, or the PyTorch cell list of ``cells``), and keeps the pairs closer than the cutoff and
sorts them into edges with ``edges`` (on the host with the compiled blockwise sort of ``csr``); ``complete``
builds complete graphs.
"""
from e3attn.graph.complete import complete_graph
from e3attn.graph.radius import radius_graph, radius_graph_pbc

__all__ = ["radius_graph", "radius_graph_pbc", "complete_graph"]

for _function in (radius_graph, radius_graph_pbc, complete_graph):
    _function.__module__ = __name__  # pickles, reprs and the docs name the public path, e3attn.graph.<name>
del _function
