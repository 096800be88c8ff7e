"""Make a random-weight test model spell its text the way a trained model does.

A trained model writes ``<tool_call>`` as that one special token and a word as its BPE
merge; a random one picks the byte tokens just as often. A reply spelled in such
non-canonical tokens is one the runtime cannot continue (the next prompt's fresh
tokenisation differs from it, so the next step falls back to the checkpoint before
the reply). Tests that measure state reuse across steps therefore favour every token
longer than one byte, longer ones more, which makes the greedy-by-bias choice the
canonical BPE spelling wherever a grammar leaves the choice open.
"""
from __future__ import annotations

from functools import cache
from pathlib import Path

import llama_cpp
from llama_cpp import Llama


@cache
def canonical_bias(path: Path, per_byte: float = 8.0) -> dict[int, float]:
    """Logit bias for the model at `path`: +`per_byte` per byte of every multi-byte token
    that is not a control token (so ``<|im_end|>`` is not made likelier)."""
    llm = Llama(model_path=str(path), vocab_only=True, verbose=False)
    try:
        vocab = llama_cpp.llama_model_get_vocab(llm.model)
        bias = {}
        for token in range(llm.n_vocab()):
            if llama_cpp.llama_vocab_is_control(vocab, token) or llama_cpp.llama_vocab_is_eog(vocab, token):
                continue
            piece = llm.detokenize([token], special=True)
            if len(piece) > 1:
                bias[token] = per_byte * len(piece)
        return bias
    finally:
        llm.close()
