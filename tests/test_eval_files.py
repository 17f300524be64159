"""`pjinfer eval`'s result files: --output is checked before any evaluation, --compare refuses what it cannot read."""
import json

import pytest

from pjinfer import evaluate
from pjinfer.cli import main


def run(capsys, *args):
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_line_error(code, out, err, fragment):
    assert code == 2 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("pjinfer: error:") and fragment in lines[0], err


@pytest.mark.parametrize("where,fragment", [("missing/out.json", "does not exist"), (".", "is a directory")])
def test_bad_output_is_refused_before_the_model_loads(tmp_path, capsys, where, fragment):
    target = tmp_path / where
    # A fake model path proves nothing loads: the output check comes first, so the model error never shows.
    code, out, err = run(capsys, "eval", "--tasks", "piqa", "--model", str(tmp_path / "no.gguf"),
                         "--output", str(target))
    assert_one_line_error(code, out, err, fragment)
    assert not list(tmp_path.glob("**/*.tmp")) and not list(tmp_path.glob("**/.*.tmp"))


@pytest.mark.parametrize("content", ['{"foo": 1}', "[1, 2]", '{"tasks": {"piqa": 3}}', '{"tasks": {"piqa": {}}}'])
def test_compare_refuses_files_of_the_wrong_shape(tmp_path, capsys, content):
    good = {"model": "m", "tasks": {"piqa": {"n": 10, "acc": 0.5, "acc_norm": 0.6}}}
    (tmp_path / "a.json").write_text(json.dumps(good))
    (tmp_path / "b.json").write_text(content)
    code, out, err = run(capsys, "eval", "--compare", str(tmp_path / "a.json"), str(tmp_path / "b.json"))
    assert_one_line_error(code, out, err, "is not a pjinfer eval results file")


def test_compare_warns_when_item_counts_differ(tmp_path, capsys):
    a = {"model": "m", "tasks": {"piqa": {"n": 10, "acc": 0.5}, "copa": {"n": 5, "acc": 0.6}}}
    b = {"model": "m", "tasks": {"piqa": {"n": 20, "acc": 0.55}, "copa": {"n": 5, "acc": 0.4}}}
    (tmp_path / "a.json").write_text(json.dumps(a))
    (tmp_path / "b.json").write_text(json.dumps(b))
    code, out, err = run(capsys, "eval", "--compare", str(tmp_path / "a.json"), str(tmp_path / "b.json"))
    assert code == 0 and "+0.0500" in out and "-0.2000" in out
    assert err.strip() == "pjinfer: warning: piqa has 10 items in A and 20 in B"


def test_write_is_atomic_and_leaves_no_temporary(tmp_path):
    from pjinfer.cli import _write_json

    target = tmp_path / "r.json"
    target.write_text("old")
    with pytest.raises(TypeError):
        _write_json(target, {"bad": object()})       # fails half-way through serialising
    assert target.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["r.json"]
    _write_json(target, {"tasks": {}})
    assert json.loads(target.read_text()) == {"tasks": {}}
    assert evaluate.count_mismatches({"tasks": {}}, {"tasks": {}}) == []
