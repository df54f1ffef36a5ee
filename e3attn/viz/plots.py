r"""Figures of attention: heatmaps, graphs (2-D layout or real 3-D positions) and rollout.

Every function returns a :class:`matplotlib.figure.Figure` built without pyplot, so
nothing is shown and no global figure state is touched; save it with
``fig.savefig(path)``. Works headless.
"""
from __future__ import annotations

import math
from types import ModuleType
from typing import TYPE_CHECKING, List, NamedTuple, Optional, Sequence, Tuple, Union

import numpy as np
import torch

from e3attn._checks import check_int
from e3attn.viz._inputs import require
from e3attn.viz.graph import attention_graph
from e3attn.viz.matrix import rollout_steps

if TYPE_CHECKING:
    import networkx
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

__all__ = ["plot_attention_heatmap", "plot_attention_graph", "plot_rollout"]

ArrayLike = Union[torch.Tensor, np.ndarray]


def _numpy(value: ArrayLike, name: str) -> np.ndarray:
    """A finite numpy copy of a tensor or array."""
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu().numpy()
    if not isinstance(value, np.ndarray):
        raise TypeError(f"{name} must be a torch.Tensor or numpy.ndarray, got {type(value).__name__}")
    if not np.isfinite(value).all():
        raise ValueError(f"{name} contains NaN or infinite values")
    return value


def _check_labels(labels: Optional[Sequence[object]], num_nodes: int) -> None:
    """``labels`` must be ``None`` or hold one label per node."""
    if labels is not None and len(labels) != num_nodes:
        raise ValueError(f"labels must have one label per node ({num_nodes}), got {len(labels)}")


def _matrix_panels(
    caller: str, matrices: List[np.ndarray], titles: List[str], labels: Optional[Sequence[object]], cmap: str
) -> "Figure":
    """One image per matrix on a shared colour scale, rows = query (dst), columns = key (src)."""
    figure_module = require("matplotlib.figure", caller)
    columns = min(len(matrices), 4)
    rows = math.ceil(len(matrices) / columns)
    fig = figure_module.Figure(figsize=(3.8 * columns + 1.0, 3.6 * rows), layout="constrained")
    vmax = max(float(m.max()) for m in matrices) or 1.0
    axes = fig.subplots(rows, columns, squeeze=False).ravel()
    for ax, matrix, title in zip(axes, matrices, titles):
        image = ax.imshow(matrix, cmap=cmap, vmin=0.0, vmax=vmax, interpolation="nearest")
        ax.set_title(title)
        ax.set_xlabel("key (src)")
        ax.set_ylabel("query (dst)")
        if labels is not None:
            ticks = np.arange(len(labels))
            fontsize = max(4.0, min(9.0, 240.0 / max(len(labels), 1)))
            ax.set_xticks(ticks, [str(label) for label in labels], rotation=90, fontsize=fontsize)
            ax.set_yticks(ticks, [str(label) for label in labels], fontsize=fontsize)
    for ax in axes[len(matrices):]:
        ax.set_axis_off()
    fig.colorbar(image, ax=axes.tolist(), shrink=0.8, label="attention")
    return fig


def plot_attention_heatmap(
    matrix: ArrayLike, labels: Optional[Sequence[object]] = None, *, cmap: str = "viridis"
) -> "Figure":
    r"""Heatmap of a dense attention matrix, one panel per head.

    Pixel :math:`(i, j)` of panel :math:`h` shows the weight with which query
    (destination) node :math:`i` attends to key (source) node :math:`j`, as returned
    by :func:`attention_matrix`; all panels share one colour scale:

    .. math:: \mathrm{pixel}^{(h)}_{ij} = A^{(h)}_{ij} \in \big[0, \max_{h', i', j'} A^{(h')}_{i'j'}\big]

    Args:
        matrix: ``[N, N]`` or ``[H, N, N]`` non-negative weights (tensor or array).
        labels: optional ``N`` tick labels (e.g. atom symbols).
        cmap: matplotlib colormap name.

    Returns:
        figure with one image per head and a colour bar.

    Example::

        >>> A = torch.softmax(torch.randn(2, 3, 3), dim=-1)  # or attention_matrix(edge_index, alpha, 3)
        >>> fig = plot_attention_heatmap(A, labels=["O", "H", "H"])  # then fig.savefig("heatmap.png")
        >>> sum(len(ax.images) for ax in fig.axes)
        2
    """
    values = _numpy(matrix, "matrix")
    if values.ndim not in (2, 3) or values.shape[-1] != values.shape[-2] or 0 in values.shape:
        raise ValueError(f"matrix must have shape [N, N] or [H, N, N] with N, H >= 1, got {list(values.shape)}")
    if values.min() < 0:
        raise ValueError(f"matrix must be non-negative (attention weights), got a minimum of {values.min()}")
    _check_labels(labels, values.shape[-1])
    heads = [values] if values.ndim == 2 else list(values)
    titles = ["attention"] if values.ndim == 2 else [f"head {h}" for h in range(len(heads))]
    return _matrix_panels("plot_attention_heatmap", heads, titles, labels, cmap)


def plot_rollout(
    attentions: Sequence[object],
    num_nodes: int,
    *,
    labels: Optional[Sequence[object]] = None,
    residual: bool = True,
    cmap: str = "viridis",
) -> "Figure":
    r"""Attention rollout after each layer, as a row of heatmaps.

    Panel :math:`l` shows the rollout of the first :math:`l` layers (see
    :func:`attention_rollout`),

    .. math:: R_l = A'_l A'_{l-1} \cdots A'_1, \qquad l = 1, \dots, L,

    so the last panel is the full rollout and the panels show how attention spreads
    with depth.

    Args:
        attentions: per layer, an ``(edge_index, alpha)`` pair or a record of
            :func:`record_attention` (whose ``name`` then titles the panel); at least one.
        num_nodes: number of nodes ``N``.
        labels: optional ``N`` tick labels.
        residual: mix each layer with the identity (see :func:`attention_rollout`).
        cmap: matplotlib colormap name.

    Returns:
        figure with one image per layer and a colour bar.

    Example::

        >>> layer = (torch.tensor([[1, 2, 0, 0], [0, 0, 1, 2]]), torch.tensor([0.5, 0.5, 1.0, 1.0]))
        >>> fig = plot_rollout([layer, layer], 3)  # then fig.savefig("rollout.png")
        >>> [ax.get_title() for ax in fig.axes if ax.images]
        ['rollout to layer 1', 'rollout to layer 2']
    """
    if len(attentions) == 0:
        raise ValueError("attentions must hold at least one layer, got an empty sequence")
    if num_nodes == 0:
        raise ValueError("num_nodes must be at least 1 to plot a rollout, got 0")
    _check_labels(labels, num_nodes)
    steps = [step.cpu().numpy() for step in rollout_steps(attentions, num_nodes, residual)]
    names = [getattr(item, "name", None) or f"layer {position + 1}" for position, item in enumerate(attentions)]
    titles = [f"rollout to {name}" for name in names]
    return _matrix_panels("plot_rollout", steps, titles, labels, cmap)


def _node_positions(pos: ArrayLike, graph: "networkx.DiGraph") -> np.ndarray:
    """``pos`` as a numpy ``[N, 2]`` or ``[N, 3]`` array matching the nodes ``0 .. N-1`` of ``graph``."""
    values = _numpy(pos, "pos")
    if values.ndim != 2 or values.shape[1] not in (2, 3) or values.shape[0] != graph.number_of_nodes():
        raise ValueError(
            f"pos must have shape [{graph.number_of_nodes()}, 2] or [{graph.number_of_nodes()}, 3] "
            f"(one point per node), got {list(values.shape)}"
        )
    if set(graph.nodes) != set(range(len(values))):
        raise ValueError("pos can only be used with a graph whose nodes are 0 .. N-1 (as made by attention_graph)")
    return values


class _EdgeStyle(NamedTuple):
    """Edges ``(src, dst, weight)`` with their RGBA colours ``[E, 4]`` and line widths ``[E]``."""

    edges: List[Tuple[int, int, float]]
    colors: np.ndarray
    widths: np.ndarray


def _draw_2d(
    nx: ModuleType, ax: "Axes", graph: "networkx.DiGraph", layout: dict, style: _EdgeStyle, labels: dict
) -> None:
    """Nodes at ``layout``, one curved arrow per edge pointing from key to query."""
    nx.draw_networkx_nodes(graph, layout, ax=ax, node_color="whitesmoke", edgecolors="black", node_size=420)
    nx.draw_networkx_edges(
        graph, layout, ax=ax, edgelist=[(u, v) for u, v, _ in style.edges], width=style.widths,
        edge_color=style.colors, arrows=True, arrowstyle="-|>", connectionstyle="arc3,rad=0.12", node_size=420,
    )
    nx.draw_networkx_labels(graph, layout, labels=labels, ax=ax, font_size=8)
    ax.set_axis_off()


def _draw_3d(ax: "Axes", points: np.ndarray, style: _EdgeStyle, labels: dict) -> None:
    """Points in 3-D; every edge except self-loops as the half segment from the pair's midpoint to its query."""
    from mpl_toolkits.mplot3d.art3d import Line3DCollection

    drawn = [i for i, (src, dst, _) in enumerate(style.edges) if src != dst]
    ends = [(points[style.edges[i][0]], points[style.edges[i][1]]) for i in drawn]
    segments = [((start + end) / 2, end) for start, end in ends]
    if segments:
        ax.add_collection3d(Line3DCollection(segments, colors=style.colors[drawn], linewidths=style.widths[drawn]))
    ax.scatter(*points.T, s=90, c="whitesmoke", edgecolors="black", depthshade=False)
    for node, point in enumerate(points):
        ax.text(*point, f" {labels[node]}", fontsize=8)
    if len(points):
        ax.set_box_aspect(np.ptp(points, axis=0) + 1e-3 * max(float(np.ptp(points)), 1.0))
    ax.set_xlabel("x")
    ax.set_ylabel("y")
    ax.set_zlabel("z")


def plot_attention_graph(
    graph: Union["networkx.DiGraph", torch.Tensor],
    alpha: Optional[torch.Tensor] = None,
    pos: Optional[ArrayLike] = None,
    *,
    num_nodes: Optional[int] = None,
    node_labels: Optional[Sequence[object]] = None,
    head: Optional[int] = None,
    cmap: str = "viridis",
    seed: int = 0,
) -> "Figure":
    r"""Draw the attention graph, edges coloured and thickened by weight.

    An edge :math:`e` (``src -> dst``) of weight :math:`w_e` (attribute ``weight``, or
    ``weight_h{head}``) gets colour ``cmap`` at :math:`w_e / w_{\max}` and line width

    .. math:: \mathrm{width}_e = 0.5 + 3\, \frac{w_e}{w_{\max}}, \qquad w_{\max} = \max_{e'} w_{e'}.

    * ``pos=None``: 2-D spring layout (``networkx.spring_layout``, seeded), arrows
      pointing from key to query; ``pos [N, 2]`` fixes the 2-D positions.
    * ``pos [N, 3]``: 3-D scatter of the real point / atom positions. Each directed
      edge is drawn as the half of the segment that touches its query ``dst``, so the
      two directions of a pair stay apart: the stubs around a node show what it attends
      to. Self-loops are not drawn in 3-D.

    Args:
        graph: a graph made by :func:`attention_graph`, or an ``edge_index [2, E]``
            tensor together with ``alpha``.
        alpha: ``[E]`` or ``[E, H]`` weights, only with an ``edge_index``.
        pos: optional ``[N, 2]`` or ``[N, 3]`` node positions.
        num_nodes: with an ``edge_index``: number of nodes (default ``len(pos)``, else inferred).
        node_labels: with an ``edge_index``: ``N`` node labels (a graph's ``label`` attributes are used otherwise).
        head: draw this head's weights instead of the mean over heads.
        cmap: matplotlib colormap name.
        seed: seed of the 2-D layout.

    Returns:
        figure with the drawing and a colour bar of the edge weights.

    Example::

        >>> edge_index = torch.tensor([[1, 2, 0, 0], [0, 0, 1, 2]])
        >>> alpha = torch.tensor([0.5, 0.5, 1.0, 1.0])
        >>> pos = torch.tensor([[0.0, 0.0, 0.0], [0.96, 0.0, 0.0], [-0.24, 0.93, 0.0]])
        >>> fig = plot_attention_graph(edge_index, alpha, pos, node_labels=["O", "H", "H"])  # 3-D
        >>> fig = plot_attention_graph(attention_graph(edge_index, alpha))  # 2-D spring layout
        >>> fig.savefig("attention_2d.png")  # doctest: +SKIP
    """
    nx = require("networkx", "plot_attention_graph")
    figure_module = require("matplotlib.figure", "plot_attention_graph")
    matplotlib = require("matplotlib", "plot_attention_graph")
    if isinstance(graph, torch.Tensor):
        if alpha is None:
            raise ValueError("alpha is required when graph is an edge_index tensor")
        if num_nodes is None and pos is not None:
            num_nodes = len(pos)
        graph = attention_graph(graph, alpha, num_nodes, node_labels=node_labels)
    elif isinstance(graph, nx.DiGraph):
        if alpha is not None or num_nodes is not None or node_labels is not None:
            raise ValueError("alpha, num_nodes and node_labels are only accepted with an edge_index, not a DiGraph")
    else:
        raise TypeError(f"graph must be a networkx.DiGraph or an edge_index tensor, got {type(graph).__name__}")
    num_heads = graph.graph.get("num_heads")
    head = None if head is None else check_int(head, "head")
    if head is not None and num_heads is not None and not head < num_heads:
        raise ValueError(f"head must be in [0, {num_heads}) for this graph, got {head!r}")
    key = "weight" if head is None else f"weight_h{head}"
    edges = list(graph.edges(data=key))
    if any(weight is None for _, _, weight in edges):
        raise ValueError(f"head={head!r}: some edges of the graph have no {key!r} attribute")
    weights = np.array([weight for _, _, weight in edges], dtype=float)
    norm = matplotlib.colors.Normalize(vmin=0.0, vmax=(float(weights.max()) if len(edges) else 0.0) or 1.0)
    colormap = matplotlib.colormaps[cmap]
    style = _EdgeStyle(edges, colormap(norm(weights)), 0.5 + 3.0 * norm(weights))
    labels = {node: data.get("label", node) for node, data in graph.nodes(data=True)}
    points = None if pos is None else _node_positions(pos, graph)

    fig = figure_module.Figure(figsize=(7.0, 6.0), layout="constrained")
    if points is None or points.shape[1] == 2:
        ax = fig.add_subplot()
        layout = nx.spring_layout(graph, seed=seed) if points is None else dict(enumerate(points))
        _draw_2d(nx, ax, graph, layout, style, labels)
    else:
        ax = fig.add_subplot(projection="3d")
        _draw_3d(ax, points, style, labels)
    fig.colorbar(matplotlib.cm.ScalarMappable(norm=norm, cmap=colormap), ax=ax, shrink=0.7, label=key)
    return fig

