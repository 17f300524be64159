"""Command line: `pjinfer generate | chat | serve | perplexity | bench | eval | profile | train-predictors | solve |
import-powerinfer`.

Every subcommand defaults to the embedded model (SmolLM2-135M-Instruct)."""
from __future__ import annotations

import argparse
import sys
from importlib.metadata import PackageNotFoundError, version

from pjinfer.cli import common, measure, pipeline, run


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, not usage plus a message
        self.exit(2, f"pjinfer: error: {message} (see --help)\n")


class _HelpFormatter(argparse.HelpFormatter):
    """Appends "(default: X)" to an option's help, unless the help already speaks of its default or there is
    none worth showing (None, False, an empty list)."""

    def _get_help_string(self, action):
        text = action.help or ""
        default = action.default
        if (not action.option_strings or default is argparse.SUPPRESS or default is None or default is False
                or default == [] or "default" in text):
            return text
        return f"{text} (default: %(default)s)".lstrip()


def package_version() -> str:
    """The installed pjinfer's version (its package metadata)."""
    try:
        return version("pjinfer")
    except PackageNotFoundError:   # a source tree that was never installed
        return "unknown (not installed)"


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="pjinfer", description=__doc__, formatter_class=_HelpFormatter)
    parser.add_argument("--version", action="version", version=f"pjinfer {package_version()}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    def command(name, function, help, json=False):
        """A subcommand with --model; json: it takes --json (one JSON object on stdout)."""
        p = sub.add_parser(name, help=help, description=help, formatter_class=_HelpFormatter)
        p.add_argument("--model", help="GGUF file or Hugging Face directory (default: the embedded SmolLM2-135M)")
        if json:
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
        try:
            args.run(args)
        finally:
            end_kernel_notice()    # before any error line, which would otherwise continue it
    except (OSError, ValueError) as e:  # ConfigError is a ValueError
        message = " ".join(str(e).split()) or type(e).__name__
        common.say(f"pjinfer: error: {message}")
        return 2
    except KeyboardInterrupt:
        common.say("pjinfer: interrupted")
        return 130
    except Exception as e:
        parallel = sys.modules.get("pjinfer.runtime.tensor_parallel")
        line = parallel and parallel.lost(e)
        if not line:
            raise
        parallel.leave(line)
    return 0


def end_kernel_notice() -> None:
    """A compile-progress line left open (the command failed or was stopped before it ended it) is ended."""
    compile_cache = sys.modules.get("pjinfer.runtime.compile_cache")   # not imported: nothing was loaded
    if compile_cache is not None:
        compile_cache.kernel_notice.finish()


if __name__ == "__main__":
    sys.exit(main())
