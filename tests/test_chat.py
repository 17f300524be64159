"""`pjinfer chat`: history through the chat template, and the terminal session driven through a real pty."""
import io
import os
import signal
import sys

import pexpect
import pytest

from pjinfer.cli.chat import Conversation, repl
from pjinfer.config import ConfigError

pytestmark = pytest.mark.real_model


def test_history_goes_through_the_template_and_old_turns_make_room(engine):
    chat = Conversation(engine, system="You are terse.", max_new_tokens=8)
    first = "".join(chat.reply("Name a colour."))
    assert first.strip() and chat.turns[-1] == {"role": "assistant", "content": first.strip()}
    text = engine.tokenizer.decode(chat.prompt_ids(), skip_special=False)
    assert "You are terse." in text and "Name a colour." in text and first.strip() in text
    "".join(chat.reply("And another?"))
    assert [t["role"] for t in chat.turns] == ["user", "assistant", "user", "assistant"]
    # A context that holds one exchange at most: the oldest exchange is dropped, the system message kept.
    chat.max_new_tokens = engine.config.max_seq_len - len(chat.prompt_ids()) + 1
    ids = chat.prompt_ids()
    assert len(chat.turns) == 2 and "You are terse." in engine.tokenizer.decode(ids, skip_special=False)
    chat.max_new_tokens = engine.config.max_seq_len
    with pytest.raises(ConfigError, match="leaves no room"):
        chat.prompt_ids()


def test_a_reply_cut_at_the_token_limit_is_marked(engine):
    lines = iter(["Write a long story about a dragon.", "/reset", "Say hi.", "/exit"])
    out = io.StringIO()
    chat = Conversation(engine, max_new_tokens=6)
    repl(chat, read=lambda prompt: next(lines), out=out)
    text = out.getvalue()
    assert text.count("[cut at 6 tokens]") == 2 and chat.cut         # "Say hi." needs more than 6 tokens too
    out = io.StringIO()
    chat = Conversation(engine, max_new_tokens=64)
    lines = iter(["Say hi.", "/exit"])
    repl(chat, read=lambda prompt: next(lines), out=out)
    assert "[cut at" not in out.getvalue() and not chat.cut and chat.turns[-1]["content"]


# pexpect forks this (JAX-threaded) process and execs at once in the child, which is safe; the warning is not.
@pytest.mark.filterwarnings("ignore:os.fork\\(\\) was called")
def test_terminal_session_history_quiet_typing_cut_ctrl_c_and_ctrl_d():
    env = dict(os.environ, COLUMNS="100", LINES="24")
    # Ctrl-C reaches the chat as a terminal's would even where this run ignores SIGINT (a background job of a
    # non-interactive shell does, and its children inherit that).
    child = pexpect.spawn(sys.executable, ["-m", "pjinfer.cli.main", "chat", "--weights", "q4_1",
                                           "--max-new-tokens", "100"], env=env, encoding="utf-8", timeout=600,
                          preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    story = "Write a very long story about a dragon who learns to bake bread."
    try:
        child.expect_exact("> ")
        child.sendline("What is the capital of France?")
        child.expect("Paris")
        child.expect_exact("\r\n> ")
        child.sendline(story)
        child.expect_exact("bread.\r\n")             # the terminal's echo of the line
        child.expect(r"\w+ \w+ \w+ \w+")            # then the reply, streaming
        child.send("zzqq")                           # typed during the reply: neither shown nor kept
        child.expect_exact("[cut at 100 tokens]")
        assert "zzqq" not in child.before
        child.expect_exact("> ")
        child.sendline("/reset")                     # "zzqq/reset" had the typing been kept
        child.expect_exact("[conversation cleared]")
        child.expect_exact("> ")
        child.send("\x1b[A\r")                        # the up arrow recalls the last line (readline history)
        child.expect_exact("/reset")
        child.expect_exact("[conversation cleared]")
        child.expect_exact("> ")
        child.sendline(story)
        child.expect_exact("bread.\r\n")
        child.expect(r"\w+ \w+ \w+ \w+")
        child.sendcontrol("c")
        child.expect_exact("[stopped]")
        child.expect_exact("> ")
        child.sendeof()
        child.expect(pexpect.EOF)
    finally:
        child.close()
    assert child.exitstatus == 0, child.before
