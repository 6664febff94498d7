"""Chat-formatted training blocks: plain training text laid out as chat turns of the model's own template.

Routers that read the residual stream see, at the template's special tokens and right after
`<|im_start|>assistant\\n`, activations that plain text never produces; trained on plain text only, they
route those positions badly (the routed model ends the answer at once). Distillation needs no reference
answers: the loss is the dense teacher's distribution at every position, so wrapping passages of the
training text in the template is enough to train the routers where generation starts and stops.

A wrapped block of L tokens is a sequence of exchanges cut from one training block, truncated to L:
    [system + user header] instruction u-tokens [end user + assistant header] a-tokens
    [end assistant + user header] instruction u-tokens [end user + assistant header] a-tokens ...
The template pieces come from `tokenizer.apply_chat_template`, so they are the tokens generation uses.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# the user turn: an instruction, then the first tokens of a passage; the assistant turn: the rest of it.
# No trailing space: the passage tokens carry their own leading space, as the tokenizer would join them
INSTRUCTIONS = ("Continue this text:", "What comes next?", "Write more about this:", "",
                "Explain the following:", "Finish the passage:")
_MARKS = ("WIDEMARKA", "WIDEMARKB", "WIDEMARKC")


@dataclass(frozen=True)
class ChatFormat:
    """Token ids of the template pieces (see the module docstring) and of the instruction prefixes."""
    first_user: tuple[int, ...]        # system turn (if the template has one) + user header
    to_assistant: tuple[int, ...]      # end of the user turn + assistant header
    to_user: tuple[int, ...]           # end of the assistant turn + next user header
    instructions: tuple[tuple[int, ...], ...]
    user_tokens: tuple[int, int] = (8, 48)       # passage tokens in a user turn (min, max)
    assistant_tokens: tuple[int, int] = (24, 256)  # passage tokens in an assistant turn (min, max)

    @classmethod
    def from_tokenizer(cls, tok, instructions: tuple[str, ...] = INSTRUCTIONS, **kw) -> "ChatFormat":
        if not getattr(tok, "chat_template", None):
            raise ValueError("chat-formatted training needs a tokenizer with a chat template; "
                             "set the chat fraction to 0 for this model")
        a, b, c = _MARKS
        text = tok.apply_chat_template([{"role": "user", "content": a}, {"role": "assistant", "content": b},
                                        {"role": "user", "content": c}], tokenize=False,
                                       add_generation_prompt=True)
        p0, rest = text.split(a)
        p1, rest = rest.split(b)
        p2, p3 = rest.split(c)
        enc = lambda s: tuple(tok(s, add_special_tokens=False)["input_ids"])  # noqa: E731
        if enc(p1) != enc(p3):
            raise ValueError("the chat template's assistant header differs between turns; not supported")
        return cls(enc(p0), enc(p1), enc(p2), tuple(enc(s) for s in instructions), **kw)

    def wrap(self, block: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """block: [L] token ids of plain text -> [L] ids laid out as chat exchanges (same dtype)."""
        L, pos, out = len(block), 0, []
        head = self.first_user
        while len(out) < L:  # the block's own tokens plus the template's always reach L
            u = int(rng.integers(self.user_tokens[0], self.user_tokens[1] + 1))
            a = int(rng.integers(self.assistant_tokens[0], self.assistant_tokens[1] + 1))
            instr = self.instructions[int(rng.integers(len(self.instructions)))]
            out += [*head, *instr, *block[pos:pos + u].tolist(), *self.to_assistant,
                    *block[pos + u:pos + u + a].tolist(), *self.to_user]
            pos += u + a
            head = ()
        return np.asarray(out[:L], dtype=block.dtype)


def wrap_blocks(blocks: np.ndarray, fmt: ChatFormat, frac: float, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """blocks: [N, L]. A seeded `frac` of the rows wrapped as chat exchanges; returns (blocks, wrapped row
    indices). frac 0 returns the blocks unchanged."""
    if not 0.0 <= frac <= 1.0:
        raise ValueError(f"chat fraction must be in [0, 1], got {frac}")
    rng = np.random.default_rng(seed)
    n = int(round(frac * len(blocks)))
    idx = np.sort(rng.choice(len(blocks), size=n, replace=False)) if n else np.zeros(0, np.int64)
    out = blocks.copy()
    for i in idx:
        out[i] = fmt.wrap(blocks[i], rng)
    return out, idx
