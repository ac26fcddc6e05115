"""Fake, deterministic tokens for the served model.

There is no tokenizer: a token is a run of up to :data:`CHARS_PER_TOKEN`
characters (so a text of ``c`` characters is ``ceil(c / 4)`` tokens, close
to real BPE averages for English), its id is a CRC32 of its UTF-8 bytes
modulo :data:`VOCAB`, and its logprob is another hash mapped into
``(-2, 0]``.  The same text always gives the same ids and logprobs, which is
what a test of token capture needs; nothing else about them is meaningful.

Prompt usage is ``max(1, chars // 4)`` over the request's text fields
(images and other binary payloads are not counted).
"""

from __future__ import annotations

import zlib
from typing import Any

CHARS_PER_TOKEN = 4
VOCAB = 100_000

_FILLER = "The scripted model has no script for this prompt, so it answers with this fixed text. "


def split(text: str) -> list[str]:
    """``text`` cut into tokens of up to :data:`CHARS_PER_TOKEN` characters; ``"".join`` gives it back."""
    return [text[i : i + CHARS_PER_TOKEN] for i in range(0, len(text), CHARS_PER_TOKEN)]


def count(text: str) -> int:
    """Number of tokens in ``text`` (0 for the empty string)."""
    return -(-len(text) // CHARS_PER_TOKEN)


def prompt_count(chars: int) -> int:
    """Prompt tokens for ``chars`` characters of request text (at least 1)."""
    return max(1, chars // CHARS_PER_TOKEN)


def _bytes(token: str) -> bytes:
    # A JSON string may carry a lone surrogate; it must not crash the server.
    return token.encode("utf-8", "surrogatepass")


def token_id(token: str) -> int:
    """The token's fake id in ``[0, VOCAB)``."""
    return zlib.crc32(_bytes(token)) % VOCAB


def logprob(token: str) -> float:
    """The token's fake logprob in ``(-2, 0]``, three decimals."""
    return -(zlib.crc32(b"lp" + _bytes(token)) % 2000) / 1000


def ids(text: str) -> list[int]:
    """Token ids of ``text``."""
    return [token_id(t) for t in split(text)]


def filler(n_tokens: int) -> str:
    """A fixed text of exactly ``n_tokens`` tokens (``4 * n_tokens`` characters)."""
    chars = n_tokens * CHARS_PER_TOKEN
    return (_FILLER * (chars // len(_FILLER) + 1))[:chars]


def logprob_entry(token: str, top: int = 0, as_ids: bool = False) -> dict[str, Any]:
    """One entry of OpenAI's ``logprobs.content`` list for ``token``.

    Args:
        top: length of ``top_logprobs``: the token itself first, then
            ``top - 1`` made-up alternatives, each 1 nat less likely.
        as_ids: spell tokens as ``"token_id:N"`` (vLLM's
            ``return_tokens_as_token_ids``), so a client can read the ids.
    """
    tid, lp = token_id(token), logprob(token)
    entry: dict[str, Any] = {
        "token": f"token_id:{tid}" if as_ids else token,
        "logprob": lp,
        "bytes": list(_bytes(token)),
        "top_logprobs": [],
    }
    if top:
        alternatives = [(entry["token"], lp, entry["bytes"])]
        for j in range(1, top):
            alt = (tid + j) % VOCAB
            name = f"token_id:{alt}" if as_ids else f"<{alt}>"
            alternatives.append((name, round(lp - j, 3), list(name.encode())))
        entry["top_logprobs"] = [{"token": t, "logprob": p, "bytes": b} for t, p, b in alternatives]
    return entry
