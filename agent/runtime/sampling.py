"""The sampler: llama.cpp's sampler chain for one generation (logit bias, GBNF grammar, greedy or
top-k / top-p / min-p / temperature / seeded draw), and the grammar check for a forced token.

Called on the model worker's thread only (agent/runtime/worker.py), like every llama.cpp call.
"""
from __future__ import annotations

import ctypes
import math
from typing import Any

import llama_cpp
from llama_cpp import Llama

from .api import GrammarError


def make_sampler(llm: Llama, *, grammar_text: str | None, temperature: float, top_k: int,
                 top_p: float, min_p: float, seed: int,
                 logit_bias: tuple[tuple[int, float], ...]) -> tuple[Any, Any]:
    """The sampler chain, and its grammar stage (None without a grammar) so that a
    forced token can be checked against the grammar before it is accepted."""
    vocab = llama_cpp.llama_model_get_vocab(llm.model)
    chain = llama_cpp.llama_sampler_chain_init(llama_cpp.llama_sampler_chain_default_params())
    add = llama_cpp.llama_sampler_chain_add
    grammar = None
    try:
        if logit_bias:
            biases = (llama_cpp.llama_logit_bias * len(logit_bias))(
                *(llama_cpp.llama_logit_bias(t, b) for t, b in logit_bias))
            add(chain, llama_cpp.llama_sampler_init_logit_bias(llm.n_vocab(), len(logit_bias), biases))
        if grammar_text:
            grammar = llama_cpp.llama_sampler_init_grammar(vocab, grammar_text.encode("utf-8"), b"root")
            if not grammar:
                raise GrammarError("llama.cpp rejected the GBNF grammar")
            add(chain, grammar)  # the chain owns it now; the pointer stays valid while the chain lives
        if temperature <= 0:
            add(chain, llama_cpp.llama_sampler_init_greedy())
        else:
            if top_k > 0:
                add(chain, llama_cpp.llama_sampler_init_top_k(top_k))
            if top_p < 1.0:
                add(chain, llama_cpp.llama_sampler_init_top_p(top_p, 1))
            if min_p > 0.0:
                add(chain, llama_cpp.llama_sampler_init_min_p(min_p, 1))
            add(chain, llama_cpp.llama_sampler_init_temp(temperature))
            add(chain, llama_cpp.llama_sampler_init_dist(seed))
    except BaseException:
        llama_cpp.llama_sampler_free(chain)
        raise
    return chain, grammar

def grammar_allows(grammar: Any, token: int) -> bool:
    """Would the grammar accept `token` next? (Accepting one it refuses aborts llama.cpp.)"""
    if grammar is None:
        return True
    data = (llama_cpp.llama_token_data * 1)(llama_cpp.llama_token_data(token, 0.0, 0.0))
    candidates = llama_cpp.llama_token_data_array(data, 1, -1, False)
    llama_cpp.llama_sampler_apply(grammar, ctypes.byref(candidates))
    return math.isfinite(data[0].logit)
