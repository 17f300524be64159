"""`pjinfer chat`: history through the chat template, and the terminal session driven through a real pty."""
import os
import sys

import pexpect
import pytest

from pjinfer.cli.chat import Conversation
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


# pexpect forks this (JAX-threaded) process and execs at once in the child, which is safe; the warning is not.
@pytest.mark.filterwarnings("ignore:os.fork\\(\\) was called")
def test_terminal_session_two_turns_ctrl_c_and_ctrl_d():
    env = dict(os.environ, COLUMNS="100", LINES="24")
    child = pexpect.spawn(sys.executable, ["-m", "pjinfer.cli.main", "chat", "--weights", "q4_1",
                                           "--max-new-tokens", "400"], env=env, encoding="utf-8", timeout=600)
    try:
        child.expect_exact("> ")
        child.sendline("What is the capital of France?")
        child.expect("Paris")
        child.expect_exact("\r\n> ")
        child.sendline("Write a very long story about a dragon who learns to bake bread.")
        child.expect_exact("bread.\r\n")             # the terminal's echo of the line
        child.expect(r"\w+ \w+ \w+ \w+")            # then the reply, streaming
        child.sendcontrol("c")
        child.expect_exact("[stopped]")
        child.expect_exact("> ")
        child.sendline("/reset")
        child.expect_exact("[conversation cleared]")
        child.expect_exact("> ")
        child.sendeof()
        child.expect(pexpect.EOF)
    finally:
        child.close()
    assert child.exitstatus == 0, child.before
