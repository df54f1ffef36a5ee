"""The examples check the files their options name before any work: an output that would overwrite an input or
another output, a folder that does not exist, a figure format matplotlib cannot write, an input that is missing;
one line and exit status 2, and every file the user had is left as it was."""
import pathlib

import pytest

pytest.importorskip("ase")
pytest.importorskip("matplotlib")

EXAMPLES = pathlib.Path(__file__).resolve().parents[1] / "examples"


@pytest.fixture
def examples(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLES))


@pytest.fixture
def kept(tmp_path):
    """Files the user had, and a check that none of them changed."""
    files = {name: tmp_path / name for name in ("keep.png", "keep.pt")}
    for path in files.values():
        path.write_text("KEEP")
    (tmp_path / "adir").mkdir()
    yield files
    assert all(path.read_text() == "KEEP" for path in files.values())


def refused(run, capsys, fragment):
    with pytest.raises(SystemExit) as stop:
        run()
    err = capsys.readouterr().err
    assert stop.value.code == 2 and len(err.strip().splitlines()) == 1 and fragment in err, err


def test_md_checks_its_files_first(examples, kept, tmp_path, capsys):
    import md

    t = str(tmp_path)
    cases = [
        ([f"--checkpoint={t}/ck.pt", f"--json={t}/ck.pt"], "is the file of --json: it would be overwritten"),
        ([f"--checkpoint={t}/ok.pt", f"--out={t}/keep.png", f"--json={t}/nodir/x.json"],
         f"argument --json: the folder '{t}/nodir' does not exist"),
        ([f"--checkpoint={t}/nodir/model.pt"], f"argument --checkpoint: the folder '{t}/nodir' does not exist"),
        ([f"--checkpoint={t}/adir"], f"argument --checkpoint: '{t}/adir' is a folder"),
        ([f"--out={t}/x.pt"], "argument --out: matplotlib cannot write .pt figures"),
    ]
    for argv, fragment in cases:
        refused(lambda: md.parse_args(["--smoke"] + argv), capsys, fragment)
    refused(lambda: md.load_or_train(md.parse_args(["--smoke", f"--checkpoint={t}/keep.pt"])), capsys,
            "--checkpoint: '%s/keep.pt' is not a checkpoint" % t)


def test_molecules_checks_its_files_and_options_first(examples, kept, tmp_path, capsys):
    import molecules

    t = str(tmp_path)
    cases = [
        ([f"--save={t}/nodir/model.pt", f"--out={t}/keep.png"], f"argument --save: the folder '{t}/nodir' does not"),
        ([f"--save={t}/same.png", f"--out={t}/same.png"], "is the file of --save: it would be overwritten"),
        (["--heads", "3"], "the model options do not build a model: irreps_hidden = 16x0e+8x1o cannot be split"),
        ([f"--predict={t}/keep.pt", f"--structures={t}/nope.xyz"], f"argument --structures: no such file '{t}/nope"),
        ([f"--predict={t}/keep.pt", f"--save={t}/m.pt"], "argument --save: --predict loads a checkpoint and trains"),
        ([f"--structures={t}/keep.pt"], "argument --structures: it names the structures that --predict predicts"),
    ]
    for argv, fragment in cases:
        refused(lambda: molecules.parse_args(["--smoke"] + argv), capsys, fragment)


def test_figures_of_tetris_and_attention_graph_are_checked_first(examples, kept, tmp_path, capsys):
    import attention_graph
    import tetris

    refused(lambda: tetris.main(["--smoke", f"--out={tmp_path}/adir"]), capsys, "argument --out: '%s/adir' is a "
            "folder" % tmp_path)
    refused(lambda: tetris.main(["--smoke", f"--out={tmp_path}/tetris.txt"]), capsys,
            "argument --out: matplotlib cannot write .txt figures")
    refused(lambda: attention_graph.parse_args(["--smoke", f"--out={tmp_path}/keep.png"]), capsys,
            "--out names the folder of the three figures")
