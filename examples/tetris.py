r"""Tetris: tell the 8 tetracubes apart from randomly rotated copies, chiral pair included.

The 8 free tetracubes (four unit cubes joined face to face) are the I, O, T, L and
S pieces, the tripod and two screws that are mirror images of each other. A model that
only sees invariant features cannot tell the screws apart: they have the same
distances. The model here is an :class:`e3attn.models.EquivariantTransformer` whose
hidden features include odd irreps (``0o``, ``1e``) and whose output is 7 even
scalars and one odd scalar :math:`o` per shape (summed over the four cubes). The
logits are the 6 first even scalars for the achiral shapes and :math:`s \pm o` for
the two screws, so a mirror image swaps exactly the two chiral logits.

Training and test shapes are randomly rotated (proper rotations) and translated; the
script prints the test accuracy, the measured O(3) equivariance error of the trained
model (float32 and float64) and saves the learning curve.

    python examples/tetris.py [--steps 100] [--device cuda] [--out tetris.png] [--smoke]
"""
import time

import torch
from e3nn import o3

from e3attn.models import EquivariantTransformer
from e3attn.testing import equivariance_error

import _common  # examples/_common.py: the script's folder is on sys.path

SHAPES = {
    "I": [(0, 0, 0), (0, 0, 1), (0, 0, 2), (0, 0, 3)],
    "O": [(0, 0, 0), (1, 0, 0), (0, 1, 0), (1, 1, 0)],
    "T": [(0, 0, 0), (1, 0, 0), (2, 0, 0), (1, 1, 0)],
    "L": [(0, 0, 0), (0, 0, 1), (0, 0, 2), (0, 1, 0)],
    "S": [(0, 0, 0), (1, 0, 0), (1, 1, 0), (2, 1, 0)],
    "tripod": [(0, 0, 0), (1, 0, 0), (0, 1, 0), (0, 0, 1)],
    "screw_left": [(0, 0, 0), (1, 0, 0), (1, 1, 0), (1, 1, 1)],
    "screw_right": [(0, 0, 0), (1, 0, 0), (1, 1, 0), (1, 1, -1)],
}
IRREPS_OUT = "7x0e + 1x0o"


def build_model(seed: int = 0) -> EquivariantTransformer:
    """The classifier: ones on every cube, 3 attention blocks, summed over the cubes."""
    torch.manual_seed(seed)
    return EquivariantTransformer(
        "1x0e", "16x0e + 8x0o + 8x1o + 8x1e", IRREPS_OUT, max_radius=2.5,
        num_layers=3, num_heads=2, lmax=1, reduce="sum",
    )


def logits_from(out: torch.Tensor) -> torch.Tensor:
    """8 logits from the ``7x0e + 1x0o`` outputs: ``s_0..s_5`` and ``s_6 +- o`` for the screws."""
    s, o = out[:, :7], out[:, 7:]
    return torch.cat([s[:, :6], s[:, 6:] + o, s[:, 6:] - o], dim=1)


def rotated_shapes(copies: int, generator: torch.Generator, device="cpu"):
    """``copies`` randomly rotated and translated copies of every shape: ``(pos, batch, labels)``."""
    base = torch.tensor(list(SHAPES.values()), dtype=torch.get_default_dtype())  # [8, 4, 3]
    base = base - base.mean(dim=1, keepdim=True)
    shapes = base.repeat(copies, 1, 1)
    quaternion = torch.randn(shapes.shape[0], 4, generator=generator, dtype=shapes.dtype)  # uniform on SO(3)
    rot = o3.quaternion_to_matrix(quaternion / quaternion.norm(dim=1, keepdim=True))
    shift = torch.randn(shapes.shape[0], 1, 3, generator=generator, dtype=shapes.dtype)
    pos = (shapes @ rot.transpose(1, 2) + shift).reshape(-1, 3)
    batch = torch.arange(shapes.shape[0]).repeat_interleave(4)
    labels = torch.arange(len(SHAPES)).repeat(copies)
    return pos.to(device), batch.to(device), labels.to(device)


def first_shapes(data, n: int):
    """The first ``n`` shapes of ``(pos, batch, labels)`` (4 cubes each)."""
    pos, batch, labels = data
    return pos[: 4 * n], batch[: 4 * n], labels[:n]


def accuracy(model, pos, batch, labels) -> float:
    with torch.no_grad():
        return (logits_from(model(pos, batch=batch)).argmax(1) == labels).double().mean().item()


def measured_equivariance(model, pos, batch) -> dict:
    """Largest O(3) + translation error of the pooled outputs, in float32 and in a float64 copy."""
    errors = {}
    for dtype in (torch.float32, torch.float64):
        m = build_model().to(device=pos.device, dtype=dtype)
        m.load_state_dict(model.state_dict())
        err = equivariance_error(lambda p: m(p, batch=batch), [pos.to(dtype)], ["cartesian_points"], [IRREPS_OUT],
                                 ntrials=3)
        errors[str(dtype)[6:]] = max(e for errs in err.values() for e in errs)
    return errors


def plot(curve, path):
    plt = _common.pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.5))
    steps = [c["step"] for c in curve]
    ax.semilogy(steps, [c["loss"] for c in curve], label="training loss (cross entropy)")
    ax.set_xlim(0, steps[-1])
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax2 = ax.twinx()
    ax2.plot(steps, [c["test_accuracy"] for c in curve], color="C1", label="test accuracy (rotated shapes)")
    ax2.set_ylim(0, 1.05)
    ax2.set_ylabel("accuracy")
    fig.legend(loc="center right", bbox_to_anchor=(0.88, 0.5))
    ax.set_title("e3attn tetris: 8 tetracubes, chiral pair included")
    fig.tight_layout()
    _common.save_figure(fig, path)
    plt.close(fig)


def main(argv=None) -> dict:
    p = _common.parser(__doc__)
    p.add_argument("--steps", type=_common.non_negative_int, default=100, help="training steps (default: 100)")
    p.add_argument("--lr", type=_common.positive_float, default=1e-2, help="Adam learning rate (default: 0.01)")
    p.add_argument("--copies", type=_common.positive_int, default=4,
                   help="rotated copies of every shape per training batch (default: 4)")
    p.add_argument("--test-copies", type=_common.positive_int, default=100,
                   help="rotated copies of every shape in the test set (default: 100)")
    args = p.parse_args(argv)
    _common.check_files(p, figures={"--out": _common.figure_name(args.out, "tetris.png")})
    if args.smoke:
        args.steps, args.test_copies = min(args.steps, 5), min(args.test_copies, 4)
    device = torch.device(args.device)
    start = time.perf_counter()

    model = build_model(args.seed).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    gen = torch.Generator().manual_seed(args.seed)
    test = rotated_shapes(args.test_copies, torch.Generator().manual_seed(args.seed + 1), device)
    monitor = first_shapes(test, 200)
    curve = []
    for step in range(args.steps + 1):
        pos, batch, labels = rotated_shapes(args.copies, gen, device)
        loss = torch.nn.functional.cross_entropy(logits_from(model(pos, batch=batch)), labels)
        if step % 5 == 0 or step == args.steps:  # after `step` updates, on the first 200 test shapes
            curve.append({"step": step, "loss": loss.item(), "test_accuracy": accuracy(model, *monitor)})
            print(f"step {step:4d}  loss {loss.item():.2e}  test accuracy {curve[-1]['test_accuracy']:.3f}")
        if step == args.steps:
            break
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    train_time = time.perf_counter() - start

    result = {
        "test_accuracy": accuracy(model, *test),
        "num_test": int(test[2].numel()),
        "final_loss": curve[-1]["loss"],
        "train_time_s": train_time,
        "equivariance_error": measured_equivariance(model, *first_shapes(test, 16)[:2]),
    }
    with torch.no_grad():
        result["largest_output"] = model(test[0], batch=test[1]).abs().max().item()
    path = _common.figure_path(args.out, "tetris.png")
    plot(curve, path)
    result["figure"] = str(path)
    print(f"test accuracy on {result['num_test']} randomly rotated shapes: {result['test_accuracy']:.3f}")
    print("O(3) + translation equivariance error: "
          + ", ".join(f"{k} {v:.1e}" for k, v in result["equivariance_error"].items())
          + f" (outputs up to {result['largest_output']:.1f})")
    print(f"trained in {train_time:.1f} s on {device}; learning curve saved to {path}")
    return result


if __name__ == "__main__":
    main()
