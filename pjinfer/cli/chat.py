"""An interactive, multi-turn conversation with a loaded Engine (`pjinfer chat`).

Each turn renders the whole history through the model's chat template and streams the reply until the model's
end-of-turn token or the per-reply token limit. The oldest turns are dropped (the system message kept) when the
history would not leave room for a full reply in the model's context. Lines starting with "/" are commands.
"""
from __future__ import annotations

import contextlib
import sys
import termios
from typing import Iterator

from pjinfer.config import ConfigError
from pjinfer.load.tokenizer import StreamDecoder
from pjinfer.runtime.sampling import Sampling

COMMANDS_HELP = "/reset clears the conversation, /exit (or Ctrl-D) leaves; Ctrl-C stops a reply"


class Conversation:
    def __init__(self, engine, *, system: str | None = None, max_new_tokens: int = 256,
                 sampling: Sampling = Sampling(), batch=None):
        """batch: where replies decode (Engine.stream's `into`; a tensor-parallel run's LeaderBatch)."""
        if not engine.tokenizer.chat_template:
            raise ConfigError("this model has no chat template, so it cannot chat; use `pjinfer generate`")
        self.engine, self.system, self.max_new_tokens, self.sampling = engine, system, max_new_tokens, sampling
        self.batch = batch
        self.turns: list[dict] = []
        self.cut = False   # whether the last reply stopped at max_new_tokens rather than at the end of its turn

    def reset(self) -> None:
        self.turns = []

    def prompt_ids(self) -> list[int]:
        """The rendered history, oldest turns dropped until a full reply fits in the context."""
        tok, limit = self.engine.tokenizer, self.engine.config.max_seq_len - self.max_new_tokens
        while True:
            system = [{"role": "system", "content": self.system}] if self.system else []
            ids = tok.encode(tok.apply_chat(system + self.turns), add_special=False)
            if len(ids) <= limit:
                return ids
            if len(self.turns) <= 1:
                raise ConfigError(f"the message ({len(ids)} tokens with the system prompt) leaves no room for "
                                  f"a {self.max_new_tokens}-token reply in the model's context")
            self.turns = self.turns[2:]  # the oldest user message and its reply

    def reply(self, text: str) -> Iterator[str]:
        """Streams the reply to `text` as pieces of text. The reply joins the history as far as it got, even
        when the caller stops early (Ctrl-C). Afterwards `cut` says whether it ran into max_new_tokens."""
        self.turns.append({"role": "user", "content": text})
        ids = self.prompt_ids()
        decoder = StreamDecoder(self.engine.tokenizer)
        self.cut = False
        try:
            for token in self.engine.stream(ids, max_new_tokens=self.max_new_tokens, sampling=self.sampling,
                                            into=self.batch):
                yield decoder.push(token)
            self.cut = len(decoder.ids) == self.max_new_tokens
        finally:
            self.turns.append({"role": "assistant", "content": decoder.text.strip()})


def repl(conversation: Conversation, *, read=input, out=None, quiet_input=None) -> None:
    """Reads a line, streams the reply, until /exit or end of input. Ctrl-C during a reply stops that reply and
    keeps the session; Ctrl-C at the prompt discards the line. A reply cut at the token limit ends with a
    "[cut at N tokens]" line. quiet_input: a context manager that keeps what is typed during a reply out of it
    (TerminalInput.quiet), or None. out: default the sys.stdout of the call (not of the import)."""
    out = out or sys.stdout
    print(f"[{COMMANDS_HELP}]", file=out, flush=True)
    while True:
        try:
            line = read("> ").strip()
        except EOFError:
            print(file=out)
            return
        except KeyboardInterrupt:
            print(file=out)
            continue
        if not line:
            continue
        if line in ("/exit", "/quit"):
            return
        if line == "/reset":
            conversation.reset()
            print("[conversation cleared]", file=out, flush=True)
            continue
        if line.startswith("/"):
            print(f"[unknown command {line.split()[0]}; {COMMANDS_HELP}]", file=out, flush=True)
            continue
        with quiet_input() if quiet_input else contextlib.nullcontext():
            _stream_reply(conversation, line, out)


def _stream_reply(conversation: Conversation, line: str, out) -> None:
    try:
        for piece in conversation.reply(line):
            out.write(piece)
            out.flush()
        print(file=out, flush=True)
        if conversation.cut:
            print(f"[cut at {conversation.max_new_tokens} tokens]", file=out, flush=True)
    except KeyboardInterrupt:
        print("\n[stopped]", file=out, flush=True)


class TerminalInput:
    """The chat's terminal, when standard input is one: line editing and a history of this session's lines
    (the stdlib readline; no history file), and `quiet`, which keeps keys pressed during a reply out of it."""

    def __init__(self, stdin):
        import readline   # importing it gives input() line editing and history

        readline.parse_and_bind("set enable-bracketed-paste off")   # no escape codes around the prompt
        self.fd = stdin.fileno()

    @contextlib.contextmanager
    def quiet(self):
        """Terminal echo off while the body runs; then what was typed meanwhile is discarded and echo restored."""
        saved = termios.tcgetattr(self.fd)
        quiet = list(saved)
        quiet[3] &= ~termios.ECHO      # lflag
        termios.tcsetattr(self.fd, termios.TCSANOW, quiet)
        try:
            yield
        finally:
            termios.tcflush(self.fd, termios.TCIFLUSH)
            termios.tcsetattr(self.fd, termios.TCSANOW, saved)


def terminal_input(stdin=None) -> TerminalInput | None:
    """TerminalInput for `stdin` (default: the sys.stdin of the call) when it is a terminal, else None (a pipe or
    file is read as it is)."""
    stdin = stdin or sys.stdin
    return TerminalInput(stdin) if stdin.isatty() else None
