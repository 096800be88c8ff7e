"""Generate random-weight GGUF models that llama.cpp loads, so tests and benchmarks
run the real inference stack without downloading weights.

Two sizes matter:

* a *tiny* Qwen3.5 hybrid (~200 KB) for tests: loads in milliseconds, thousands of
  tokens/s, and has a byte-level vocabulary plus the ChatML / ``<tool_call>`` /
  ``<think>`` / ``<tool_response>`` specials, so every prompt and every grammar can be
  expressed;
* a model with BotPsy-0.8B's exact shapes (``arch=qwen35``, 24 layers, 248,320-token
  vocabulary) for benchmarks: random weights, but the same cost per token as the
  real model.

Files are cached by a hash of everything that determines their bytes, and written
atomically (temp file + rename), so concurrent test processes never see half a file
and never regenerate one needlessly.
"""
from __future__ import annotations

import ctypes
import dataclasses
import functools
import hashlib
import json
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

__all__ = [
    "BOTPSY_SHAPE",
    "FAMILY_SPECIAL_TOKENS",
    "SPECIAL_TOKENS",
    "special_token_ids",
    "GgufShape",
    "make_botpsy_shaped_gguf",
    "make_tiny_gguf",
    "tiny_model_path",
]

# Bump when the generator's output changes, so cached files are regenerated.
_GENERATOR_VERSION = 1

# (text, token type). Control tokens are never rendered as text; user-defined ones are,
# which is how the real Qwen tokenizer treats <tool_call> and <think>.
SPECIAL_TOKENS: tuple[tuple[str, gguf.TokenType], ...] = (
    ("<|endoftext|>", gguf.TokenType.CONTROL),
    ("<|im_start|>", gguf.TokenType.CONTROL),
    ("<|im_end|>", gguf.TokenType.CONTROL),
    ("<tool_call>", gguf.TokenType.USER_DEFINED),
    ("</tool_call>", gguf.TokenType.USER_DEFINED),
    ("<think>", gguf.TokenType.USER_DEFINED),
    ("</think>", gguf.TokenType.USER_DEFINED),
    ("<tool_response>", gguf.TokenType.USER_DEFINED),
    ("</tool_response>", gguf.TokenType.USER_DEFINED),
)
# Each tool-calling family's own specials (agent/formats/families.py), added to the ChatML ones above
# for a model of that family; the real tokenizers have them as control tokens.
FAMILY_SPECIAL_TOKENS: dict[str, tuple[tuple[str, gguf.TokenType], ...]] = {
    "llama3": tuple((t, gguf.TokenType.CONTROL) for t in (
        "<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
        "<|eom_id|>", "<|python_tag|>")),
    "mistral": tuple((t, gguf.TokenType.CONTROL) for t in (
        "<s>", "</s>", "[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]",
        "[TOOL_RESULTS]", "[/TOOL_RESULTS]")),
}
# A few BPE merges so the merge path of the tokenizer is exercised ("Ġ" is a space).
_MERGES: tuple[tuple[str, str], ...] = (
    ("n", "a"), ("m", "e"), ("na", "me"), ("t", "r"), ("u", "e"), ("tr", "ue"), ("Ġ", "t"), ("{", '"'),
)


@dataclass(frozen=True)
class GgufShape:
    """Hyper-parameters of a generated model. Defaults give the tiny test model."""

    n_embd: int = 64
    n_layer: int = 2
    n_head: int = 2
    n_head_kv: int = 1
    head_dim: int = 32
    n_ff: int = 128
    n_ctx_train: int = 32768
    vocab_size: int = 0  # pad the vocabulary up to this many tokens (0: no padding)
    ssm: tuple[int, int, int] = (16, 2, 2)  # (state size == head dim, k heads, v heads)
    full_attn_interval: int = 2  # every n-th layer is full attention, the rest gated delta net
    rope_dims: int = 16
    rope_sections: tuple[int, int, int, int] = (3, 3, 2, 0)


BOTPSY_SHAPE = GgufShape(
    n_embd=1024, n_layer=24, n_head=8, n_head_kv=2, head_dim=256, n_ff=3584,
    n_ctx_train=262144, vocab_size=248320, ssm=(128, 16, 16), full_attn_interval=4,
    rope_dims=64, rope_sections=(11, 11, 10, 0),
)


def _bytes_to_unicode() -> list[str]:
    """GPT-2 byte-level alphabet: one printable character per byte value."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {b: b for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = 256 + extra
            extra += 1
    return [chr(table[b]) for b in range(256)]


def _vocabulary(pad_to: int, extra: tuple[tuple[str, gguf.TokenType], ...] = ()
                ) -> tuple[list[str], list[int], list[str], dict[str, int]]:
    tokens = _bytes_to_unicode()  # token id == byte value for ids 0-255
    types = [int(gguf.TokenType.NORMAL)] * 256
    for a, b in _MERGES:
        tokens.append(a + b)
        types.append(int(gguf.TokenType.NORMAL))
    ids: dict[str, int] = {}
    for text, token_type in (*SPECIAL_TOKENS, *extra):
        ids[text] = len(tokens)
        tokens.append(text)
        types.append(int(token_type))
    while len(tokens) % 32 or len(tokens) < pad_to:
        tokens.append(f"[PAD{len(tokens)}]")
        types.append(int(gguf.TokenType.UNUSED))
    return tokens, types, [f"{a} {b}" for a, b in _MERGES], ids


def special_token_ids(pad_to: int = 0) -> dict[str, int]:
    """Token ids of the ChatML / tool-call specials in the generated vocabulary."""
    return _vocabulary(pad_to)[3]


@dataclass
class _Tensor:
    name: str
    shape: tuple[int, ...]  # numpy order: (rows, cols) == ggml ne {cols, rows}
    kind: str  # "mat" (random, quantizable) | "vec" (constant) | "raw" (random float32)
    value: float = 1.0


def _tensor_plan(arch: str, s: GgufShape, n_vocab: int) -> list[_Tensor]:
    plan = [_Tensor("token_embd.weight", (n_vocab, s.n_embd), "mat"),  # output.weight omitted: tied
            _Tensor("output_norm.weight", (s.n_embd,), "vec")]
    d_state, n_k_heads, n_v_heads = s.ssm
    for i in range(s.n_layer):
        p = f"blk.{i}."
        plan += [_Tensor(p + "attn_norm.weight", (s.n_embd,), "vec"),
                 _Tensor(p + "ffn_gate.weight", (s.n_ff, s.n_embd), "mat"),
                 _Tensor(p + "ffn_up.weight", (s.n_ff, s.n_embd), "mat"),
                 _Tensor(p + "ffn_down.weight", (s.n_embd, s.n_ff), "mat")]
        full_attention = arch == "qwen3" or (i + 1) % s.full_attn_interval == 0
        if arch == "qwen3":
            plan.append(_Tensor(p + "ffn_norm.weight", (s.n_embd,), "vec"))
        else:
            plan.append(_Tensor(p + "post_attention_norm.weight", (s.n_embd,), "vec"))
        if full_attention:
            q_rows = s.n_head * s.head_dim * (2 if arch == "qwen35" else 1)  # qwen35: query + output gate
            plan += [_Tensor(p + "attn_q.weight", (q_rows, s.n_embd), "mat"),
                     _Tensor(p + "attn_k.weight", (s.n_head_kv * s.head_dim, s.n_embd), "mat"),
                     _Tensor(p + "attn_v.weight", (s.n_head_kv * s.head_dim, s.n_embd), "mat"),
                     _Tensor(p + "attn_output.weight", (s.n_embd, s.n_head * s.head_dim), "mat"),
                     _Tensor(p + "attn_q_norm.weight", (s.head_dim,), "vec"),
                     _Tensor(p + "attn_k_norm.weight", (s.head_dim,), "vec")]
        else:  # gated delta net (recurrent) layer
            key_dim, value_dim = d_state * n_k_heads, d_state * n_v_heads
            conv_dim = 2 * key_dim + value_dim
            plan += [_Tensor(p + "attn_qkv.weight", (conv_dim, s.n_embd), "mat"),
                     _Tensor(p + "attn_gate.weight", (value_dim, s.n_embd), "mat"),
                     _Tensor(p + "ssm_conv1d.weight", (conv_dim, 4), "raw", 0.3),
                     _Tensor(p + "ssm_dt.bias", (n_v_heads,), "vec", 0.0),
                     _Tensor(p + "ssm_a", (n_v_heads,), "raw", -1.0),
                     _Tensor(p + "ssm_beta.weight", (n_v_heads, s.n_embd), "mat"),
                     _Tensor(p + "ssm_alpha.weight", (n_v_heads, s.n_embd), "mat"),
                     _Tensor(p + "ssm_norm.weight", (d_state,), "vec"),
                     _Tensor(p + "ssm_out.weight", (s.n_embd, value_dim), "mat")]
    return plan


_WTYPES = {
    "F32": (gguf.LlamaFileType.ALL_F32, None),
    "F16": (gguf.LlamaFileType.MOSTLY_F16, None),
    "Q8_0": (gguf.LlamaFileType.MOSTLY_Q8_0, gguf.GGMLQuantizationType.Q8_0),
}


def _materialize(t: _Tensor, rng: np.random.Generator, wtype: str) -> tuple[np.ndarray, gguf.GGMLQuantizationType | None]:
    if t.kind == "vec":
        return np.full(t.shape, t.value, dtype=np.float32), None
    if t.kind == "raw":
        a = rng.standard_normal(t.shape, dtype=np.float32) * np.float32(abs(t.value))
        return (-np.abs(a) if t.value < 0 else a), None
    rows, cols = t.shape
    out_dtype = np.float32 if wtype == "F32" else np.float16
    out = np.empty(t.shape, dtype=out_dtype)
    scale = np.float32(0.5 / np.sqrt(cols))
    step = max(1, (1 << 24) // cols)  # ~64 MB of float32 at a time keeps peak memory flat
    for r in range(0, rows, step):
        out[r:r + step] = rng.standard_normal((min(step, rows - r), cols), dtype=np.float32) * scale
    qtype = _WTYPES[wtype][1]
    if qtype is not None:
        return gguf.quants.quantize(out.astype(np.float32), qtype), qtype
    return out, None


def _nbytes_and_dtype(t: _Tensor, wtype: str) -> tuple[tuple[int, ...], np.dtype, int, gguf.GGMLQuantizationType | None]:
    if t.kind != "mat":
        return t.shape, np.dtype(np.float32), int(np.prod(t.shape)) * 4, None
    qtype = _WTYPES[wtype][1]
    if qtype is None:
        dtype = np.dtype(np.float32 if wtype == "F32" else np.float16)
        return t.shape, dtype, int(np.prod(t.shape)) * dtype.itemsize, None
    byte_shape = gguf.quant_shape_to_byte_shape(t.shape, qtype)
    return byte_shape, np.dtype(np.uint8), int(np.prod(byte_shape)), qtype


def _write_gguf(path: Path, arch: str, shape: GgufShape, chat_template: str | None, wtype: str, seed: int,
                special_tokens: tuple[tuple[str, gguf.TokenType], ...] = (), eos: str = "<|im_end|>") -> None:
    """Stream tensors to disk one at a time: the BotPsy-shaped model is 1.5 GB in F16."""
    if arch not in ("qwen35", "qwen3"):
        raise ValueError(f"unsupported arch {arch!r} (qwen35 or qwen3)")
    if wtype not in _WTYPES:
        raise ValueError(f"unsupported wtype {wtype!r} (one of {sorted(_WTYPES)})")
    s = shape
    rng = np.random.default_rng(seed)
    tokens, types, merges, ids = _vocabulary(s.vocab_size, special_tokens)

    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"random-{arch}")
    w.add_context_length(s.n_ctx_train)
    w.add_embedding_length(s.n_embd)
    w.add_block_count(s.n_layer)
    w.add_feed_forward_length(s.n_ff)
    w.add_head_count(s.n_head)
    w.add_head_count_kv(s.n_head_kv)
    w.add_key_length(s.head_dim)
    w.add_value_length(s.head_dim)
    w.add_rope_freq_base(10_000_000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_file_type(_WTYPES[wtype][0])
    if arch == "qwen35":
        d_state, n_k_heads, n_v_heads = s.ssm
        w.add_rope_dimension_count(s.rope_dims)  # partial rotary, multi-section like the real model
        w.add_rope_dimension_sections(list(s.rope_sections))
        w.add_ssm_conv_kernel(4)
        w.add_ssm_state_size(d_state)
        w.add_ssm_group_count(n_k_heads)
        w.add_ssm_time_step_rank(n_v_heads)
        w.add_ssm_inner_size(d_state * n_v_heads)
        w.add_full_attention_interval(s.full_attn_interval)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_eos_token_id(ids[eos])
    w.add_bos_token_id(ids["<|endoftext|>"])
    w.add_pad_token_id(ids["<|endoftext|>"])
    w.add_add_bos_token(False)
    if chat_template:
        w.add_chat_template(chat_template)

    plan = _tensor_plan(arch, s, len(tokens))
    for t in plan:
        shp, dtype, nbytes, qtype = _nbytes_and_dtype(t, wtype)
        w.add_tensor_info(t.name, shp, dtype, nbytes, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for t in plan:
        data, _ = _materialize(t, rng, wtype)
        w.write_tensor_data(data)
    w.close()


def _cache_name(kind: str, params: dict[str, object]) -> str:
    blob = json.dumps({"v": _GENERATOR_VERSION, **params}, sort_keys=True, default=str)
    return f"{kind}-{hashlib.sha256(blob.encode()).hexdigest()[:16]}.gguf"


def _atomic_create(target: Path, write: Callable[[Path], None]) -> Path:
    """Create `target` via `write(tmp)` + rename unless it already exists."""
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=target.name + ".", suffix=".part", dir=target.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        write(tmp)
        tmp.chmod(0o644)  # mkstemp makes it private; it is a shared cache
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    return target


def make_tiny_gguf(
    path: str | os.PathLike[str],
    *,
    arch: str = "qwen35",
    chat_template: str | None = None,
    wtype: str = "F16",
    seed: int = 0,
    special_tokens: tuple[tuple[str, gguf.TokenType], ...] = (),
    eos: str = "<|im_end|>",
    **shape: object,
) -> Path:
    """Write a tiny random-weight model to `path` (a file, or a directory to cache in).

    `chat_template` is written as ``tokenizer.chat_template``; `special_tokens` are added to
    the ChatML ones (e.g. a family's, :data:`FAMILY_SPECIAL_TOKENS`) and `eos` (one of them)
    ends a turn. `shape` overrides fields of :class:`GgufShape`. When `path` is a directory
    the file name is a hash of all parameters, and an existing file is reused.
    """
    s = dataclasses.replace(GgufShape(), **shape)  # type: ignore[arg-type]
    target = Path(path)
    write = functools.partial(_write_gguf, arch=arch, shape=s, chat_template=chat_template, wtype=wtype, seed=seed,
                              special_tokens=special_tokens, eos=eos)
    if target.is_dir():
        params: dict[str, object] = {"arch": arch, "template": chat_template, "wtype": wtype, "seed": seed,
                                     "shape": dataclasses.asdict(s)}
        if special_tokens or eos != "<|im_end|>":  # only then, so existing cache names stay
            params.update(special_tokens=[(t, int(k)) for t, k in special_tokens], eos=eos)
        return _atomic_create(target / _cache_name(f"tiny-{arch}", params), lambda tmp: write(tmp))
    target.parent.mkdir(parents=True, exist_ok=True)
    write(target)
    return target


_QUANT_FTYPES = {"Q4_K_M": "LLAMA_FTYPE_MOSTLY_Q4_K_M", "Q8_0": "LLAMA_FTYPE_MOSTLY_Q8_0",
                 "Q4_0": "LLAMA_FTYPE_MOSTLY_Q4_0", "Q6_K": "LLAMA_FTYPE_MOSTLY_Q6_K"}


def _quantize(src: Path, dst: Path, wtype: str, n_threads: int) -> None:
    import llama_cpp  # heavy native import only when quantizing

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, _QUANT_FTYPES[wtype])
    params.nthread = n_threads
    # llama.cpp logs every tensor to stderr (fd 2); keep the log, show it only on failure.
    with tempfile.TemporaryFile() as log:
        saved = os.dup(2)
        os.dup2(log.fileno(), 2)
        try:
            rc = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params))
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        if rc != 0:
            log.seek(0)
            tail = log.read()[-2000:].decode(errors="replace")
            raise RuntimeError(f"llama_model_quantize({wtype}) failed with code {rc}:\n{tail}")


def make_botpsy_shaped_gguf(
    cache_dir: str | os.PathLike[str],
    *,
    wtype: str = "Q4_K_M",
    seed: int = 0,
    n_threads: int | None = None,
) -> Path:
    """A random-weight model with BotPsy-0.8B's exact shapes, cached in `cache_dir`.

    F16/F32 are written directly; quantized types are produced from a temporary F16
    file by llama.cpp's own quantizer (the same path a real GGUF takes).
    """
    cache = Path(cache_dir)
    params = {"shape": dataclasses.asdict(BOTPSY_SHAPE), "wtype": wtype, "seed": seed}
    target = cache / _cache_name(f"botpsy-shaped-{wtype}", params)
    if wtype in ("F16", "F32"):
        return _atomic_create(target, lambda tmp: _write_gguf(tmp, "qwen35", BOTPSY_SHAPE, None, wtype, seed))
    if wtype not in _QUANT_FTYPES:
        raise ValueError(f"unsupported wtype {wtype!r} (F16, F32 or one of {sorted(_QUANT_FTYPES)})")

    def build(tmp: Path) -> None:
        f16 = tmp.with_name(tmp.name + ".f16")
        try:
            _write_gguf(f16, "qwen35", BOTPSY_SHAPE, None, "F16", seed)
            _quantize(f16, tmp, wtype, n_threads or os.cpu_count() or 1)
        finally:
            f16.unlink(missing_ok=True)

    return _atomic_create(target, build)


def tiny_model_path(cache_dir: str | os.PathLike[str], *, chat_template: str | None = None,
                    family: str | None = None, **shape: object) -> Path:
    """The cached tiny qwen35 model for tests (e.g. under pytest's `tmp_path_factory`); with
    `family` ("llama3", "mistral"), that family's specials too, its end-of-turn token ending
    a turn (give its `chat_template` with it)."""
    d = Path(cache_dir)
    d.mkdir(parents=True, exist_ok=True)
    from ..formats.families import FAMILIES, ToolFamily

    extra = FAMILY_SPECIAL_TOKENS.get(family or "", ())
    eos = FAMILIES[ToolFamily(family)].eos_token if family else "<|im_end|>"
    return make_tiny_gguf(d, chat_template=chat_template, special_tokens=extra, eos=eos, **shape)
