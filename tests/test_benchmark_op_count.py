"""benchmarks/op_count.py: what it counts (no views; backward operations put down to the forward code that caused
them) and a small run of its cases."""
import json

import pytest
import torch

from script_loader import load_script

pytest.importorskip("ase")


@pytest.fixture(scope="module")
def bench():
    return load_script("benchmarks/op_count.py")


def test_views_do_not_count_and_backward_operations_go_to_their_forward_site(bench):
    from e3attn.radial import cutoff_weight

    r = torch.tensor([0.5, 1.5, 2.5], requires_grad=True)
    counter = bench.OperationCounter()
    with torch.autograd.set_detect_anomaly(True, check_nan=False), counter:
        r.view(3, 1).reshape(3)  # views launch nothing
        assert sum(counter.by_phase.values()) == 0
        w = cutoff_weight(r, 2.0)
        forward = sum(counter.by_phase.values())
        counter.phase = "backward"
        (g,) = torch.autograd.grad(w.sum(), r, create_graph=True)
        torch.autograd.grad(g.sum(), r)
    sites = set(counter.by_site)
    assert forward > 0 and counter.by_phase["backward"] > 0  # first and second derivatives
    inside = {site for site in sites if site.split(":")[0] in ("radial", "_jet")}
    assert sites == inside | {"(outside e3attn)"} and "radial:cutoff_weight" in sites, sites
    # only the test's own sums and products (and their gradients) are outside e3attn
    assert sum(counter.by_site[site] for site in inside) > counter.by_site["(outside e3attn)"]


def test_saved_bytes_count_each_storage_once(bench):
    x, y = torch.randn(10, requires_grad=True), torch.randn(10, requires_grad=True)
    with bench.SavedBytes() as saved:
        z = x * y  # saves x and y
        (z * x).sum()  # saves z and x again
    assert sorted(saved.storages.values()) == [40, 40, 40] and saved.mib == 120 / 2**20


def test_a_small_run_of_every_case(bench, tmp_path, capsys):
    out = tmp_path / "ops.json"
    report = bench.main(["--cases", "train", "md", "layer:guide:12", "--batch-size", "2", "--atoms", "32",
                         "--top", "3", "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    for name in ("train", "md", "layer:guide:12"):
        case = report[name]
        assert case["total"] == sum(case["by_phase"].values()) == sum(case["by_site"].values()) > 0
        assert case["saved_mib"] > 0
        assert any(site.startswith("kernels.") for site in case["by_site"])  # the layer's own operators count
    assert set(report["train"]["by_phase"]) == {"forward", "loss", "backward"}
    assert "operations (forward" in capsys.readouterr().out
    with pytest.raises(SystemExit) as stop:
        bench.main(["--cases", "layer:nope"])
    assert stop.value.code == 2 and "--cases: expected train, md or layer" in capsys.readouterr().err
