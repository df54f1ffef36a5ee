"""The benchmark scripts' options: a bad value, a device this machine lacks, an output that is a folder (or in a
file) or a figure matplotlib cannot write stop the script while parsing, with one line and exit status 2."""
import pytest
import torch

from script_loader import load_script

NO_CUDA = "cuda" if not torch.cuda.is_available() else "cuda:99"


@pytest.mark.parametrize("script, argv, fragment", [
    ("layer", ["--degree", "-3"], "argument --degree: expected a positive number, got '-3'"),
    ("layer", ["--device", NO_CUDA], f"argument --device: '{NO_CUDA}' is not available on this machine"),
    ("layer", ["--threads", "0"], "argument --threads: expected a positive integer, got '0'"),
    ("kernels", ["--degree", "nan"], "argument --degree: expected a positive number, got 'nan'"),
    ("compile", ["--sizes"], "argument --sizes: expected at least one argument"),
    ("dense_vs_sparse", ["--neighbours", "-1"], "argument --neighbours: expected a positive number"),
    ("dense_vs_sparse", ["--fig", "{tmp}/figure.txt"], "argument --fig: matplotlib cannot write .txt figures"),
    ("radius_graph", ["--sizes", "0"], "argument --sizes: expected a positive integer, got '0'"),
    ("op_count", ["--batch-size", "-1"], "argument --batch-size: expected a positive integer, got '-1'"),
    ("train_step", ["--threads", "0"], "argument --threads: expected a positive integer, got '0'"),
    ("train_step", ["--molecule", "nope"], "argument --molecule: 'nope' is not a molecule that ase.build.molecule"),
    ("train_step", ["--", "--heads", "3"], "the model options after -- do not build a model: irreps_hidden"),
    ("accuracy", ["--threads", "0"], "argument --threads: expected a positive integer, got '0'"),
    ("md_speed", ["--out", "{tmp}/a_file/report.json"], "argument --out: '{tmp}/a_file' is a file, not a folder"),
    ("layer", ["--out", "{tmp}"], "argument --out: '{tmp}' is a folder"),
])
def test_bad_options_stop_the_benchmarks_with_one_line(tmp_path, capsys, script, argv, fragment):
    (tmp_path / "a_file").write_text("KEEP")
    module = load_script(f"benchmarks/{script}.py")
    with pytest.raises(SystemExit) as stop:
        module.parse_args([a.format(tmp=tmp_path) for a in argv])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and len(err.strip().splitlines()) == 1, err
    assert fragment.format(tmp=tmp_path) in err and "Traceback" not in err, err
    assert (tmp_path / "a_file").read_text() == "KEEP"
