"""The `pjinfer` command run in this process, and what a clean one-line error looks like."""
from pjinfer.cli import main as cli


def run_cli(capsys, *args):
    """(exit status, stdout, stderr) of `pjinfer ARGS` run in this process."""
    try:
        code = cli.main(list(args))
    except SystemExit as e:  # argparse's refusals
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def assert_clean_error(result, fragment):
    code, out, err = result
    assert code == 2, err
    lines = [l for l in err.splitlines() if l.startswith("pjinfer:")]
    assert len(lines) == 1 and fragment in lines[0], err
    assert "Traceback" not in err
    assert out == ""
