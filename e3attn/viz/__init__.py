r"""Attention as a directed graph: export, inspection and plots.

An edge ``src -> dst`` of an ``edge_index [2, E]`` carries the weight
:math:`\alpha_e` (``[E]`` or ``[E, H]``, one column per head) with which node ``dst``
(the query) attends to node ``src`` (the key). The functions here turn such weights,
from one layer or from every layer of a model (:func:`record_attention`), into
networkx graphs, dense matrices, rollouts, centralities and figures.

networkx and matplotlib are optional and only imported by the functions that need
them: ``pip install matplotlib networkx``, or ``pip install -e ".[viz]"`` in a clone of
e3attn (it is installed from its repository, so ``pip install e3attn[viz]`` does not work).
"""
from e3attn.viz.graph import attention_centrality, attention_graph
from e3attn.viz.matrix import attention_matrix, attention_rollout
from e3attn.viz.plots import plot_attention_graph, plot_attention_heatmap, plot_rollout
from e3attn.viz.record import AttentionRecord, record_attention
from e3attn.viz.sparsify import sparsify

__all__ = [
    "attention_graph",
    "attention_matrix",
    "attention_rollout",
    "attention_centrality",
    "sparsify",
    "record_attention",
    "AttentionRecord",
    "plot_attention_heatmap",
    "plot_attention_graph",
    "plot_rollout",
]
