"""Command line: `pjinfer generate | chat | serve | perplexity | bench | eval | profile | train-predictors | solve |
import-powerinfer`.

Every subcommand defaults to the embedded model (SmolLM2-135M-Instruct)."""
from __future__ import annotations

import argparse
import sys

from pjinfer.cli import common, measure, pipeline, run


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, not usage plus a message
        self.exit(2, f"pjinfer: error: {message} (see --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="pjinfer", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    def command(name, function, help):
        p = sub.add_parser(name, help=help, description=help)
        p.add_argument("--model", help="GGUF file or Hugging Face directory (default: the embedded SmolLM2-135M)")
        p.add_argument("--json", action="store_true", help="print one JSON object")
        p.set_defaults(run=function)
        return p

    for module in (run, measure, pipeline):
        module.add_commands(command)
    return parser


def main(argv=None) -> int:
    """Run one subcommand; returns the exit status. Bad arguments exit 2 from the parser. An expected failure (a
    ConfigError, or any OSError or ValueError: a missing or unreadable file, a malformed checkpoint) prints one
    line `pjinfer: error: ...` on stderr and returns 2; any other exception propagates with its traceback, so
    bugs stay visible."""
    args = build_parser().parse_args(argv)
    try:
        args.run(args)
    except (OSError, ValueError) as e:  # ConfigError is a ValueError
        message = " ".join(str(e).split()) or type(e).__name__
        common.say(f"pjinfer: error: {message}")
        return 2
    except KeyboardInterrupt:
        common.say("pjinfer: interrupted")
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
