"""llama.cpp's SentencePiece ("SPM", `tokenizer.ggml.model` = "llama") vocabulary: text <-> ids in plain Python.

The algorithm is the one llama.cpp's tokenizer runs on such a vocabulary (Llama-2, Mistral, TinyLlama, PowerInfer's
ReluLLaMA / ProSparse / Bamboo files), checked against llama.cpp's own tokenizer test files
(tests/test_tokenizer_vocab.py):

- the text's spaces become "▁" (U+2581), with one "▁" put in front of each run of text when add_space_prefix;
- the text starts as one symbol per character; the adjacent pair whose join is a token with the highest score is
  joined first (the leftmost pair on a tie), and so on until no adjacent pair joins to a token;
- a final symbol that is not a token is written as its UTF-8 bytes, each the byte token "<0xNN>" (the unknown
  token where the vocabulary lacks one).

Decoding turns "▁" back into a space, byte tokens into their bytes, and drops one leading space of the first
token's text when add_space_prefix (the space encoding put there).
"""
from __future__ import annotations

import heapq

# GGUF token types (llama.cpp's llama_token_type)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
SPACE = "\u2581"


class SpmVocab:
    """tokens[i] with scores[i] and token_types[i]; unk_id the id for a byte with no byte token (or None)."""

    def __init__(self, tokens, scores, token_types, *, unk_id: int | None, add_space_prefix: bool):
        if len(scores) != len(tokens):
            raise ValueError(f"{len(scores)} scores for {len(tokens)} tokens")
        self.tokens = list(tokens)
        self.scores = [float(s) for s in scores]
        self.types = [NORMAL] * len(tokens) if token_types is None else [int(t) for t in token_types]
        self.ids = {t: i for i, t in enumerate(self.tokens)}
        self.unk_id = unk_id
        self.add_space_prefix = add_space_prefix
        self.byte_ids = [self.ids.get(f"<0x{b:02X}>", unk_id) for b in range(256)]

    # ------------------------------------------------------------ encode
    def encode_text(self, text: str, *, prefix_space: bool) -> list[int]:
        """The ids of a run of plain text (no special token in it). prefix_space: put the "▁" of add_space_prefix
        in front (llama.cpp does so for text at the start or right after a special token)."""
        if prefix_space and self.add_space_prefix:
            text = " " + text
        ids: list[int] = []
        for piece in self._merge(text.replace(" ", SPACE)):
            token = self.ids.get(piece)
            if token is not None:
                ids.append(token)
            else:
                ids.extend(self._bytes(piece))
        return ids

    def _bytes(self, piece: str) -> list[int]:
        out = [self.byte_ids[b] for b in piece.encode("utf-8")]
        if None in out:
            raise ValueError(f"the vocabulary has neither a byte token nor an unknown token for {piece!r}")
        return out

    def _merge(self, text: str) -> list[str]:
        """The symbols left after joining the best-scoring adjacent pairs, in order."""
        symbols = list(text)               # one per character; a joined-away symbol becomes ""
        nxt = list(range(1, len(symbols))) + [-1]
        prev = list(range(-1, len(symbols) - 1))
        queue: list[tuple[float, int, int, str]] = []

        def offer(left: int, right: int) -> None:
            if left < 0 or right < 0:
                return
            joined = symbols[left] + symbols[right]
            token = self.ids.get(joined)
            if token is not None:       # best score first, then leftmost
                heapq.heappush(queue, (-self.scores[token], left, right, joined))

        for i in range(len(symbols) - 1):
            offer(i, i + 1)
        while queue:
            _, left, right, joined = heapq.heappop(queue)
            if not symbols[left] or not symbols[right] or symbols[left] + symbols[right] != joined:
                continue                 # one side was joined to something else since
            symbols[left], symbols[right] = joined, ""
            nxt[left] = nxt[right]
            if nxt[right] >= 0:
                prev[nxt[right]] = left
            offer(prev[left], left)
            offer(left, nxt[left])
        return [s for s in symbols if s]

    # ------------------------------------------------------------ decode
    def piece(self, token: int, *, skip_special: bool) -> bytes:
        """The bytes one token stands for: control and unknown tokens are empty when skip_special, unused ones
        always."""
        kind = self.types[token]
        if kind == BYTE:
            return bytes([int(self.tokens[token][3:5], 16)])
        if kind == NORMAL:
            return self.tokens[token].replace(SPACE, " ").encode("utf-8")
        if kind == USER_DEFINED or (kind in (CONTROL, UNKNOWN) and not skip_special):
            return self.tokens[token].encode("utf-8")
        return b""

    def decode_bytes(self, ids, *, skip_special: bool) -> bytes:
        pieces = [self.piece(int(i), skip_special=skip_special) for i in ids]
        if pieces and self.add_space_prefix and pieces[0].startswith(b" "):
            pieces[0] = pieces[0][1:]   # only the first token's: after a BOS, llama.cpp keeps the space too
        return b"".join(pieces)
