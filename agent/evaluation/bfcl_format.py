"""BFCL v4's format_sensitivity, run as BFCL runs it for a prompting model.

BFCL re-asks 200 of its AST cases (ids in ``data/BFCL_v4_format_sensitivity.json``: simple
python, multiple, parallel, parallel_multiple and their live kinds) in each of 26 system
prompt variants (``bfcl_eval.utils.get_all_format_sensitivity_configs``): a return format
(python, json, verbose_xml, concise_xml), with or without a ``<TOOLCALL>`` tag, the
function docs written as python, xml or json, and two more: markdown layout, and the
"experimental" wording. A prompting model gets no tools through its chat template: the
functions and the format are all in the system turn, and the reply is text that BFCL's
decoder for that format reads. So here:

* the cases are BFCL's own (``load_dataset_entry("format_sensitivity")`` and
  ``load_ground_truth_entry``, from the installed bfcl-eval, 5,200 in all), their ids
  BFCL's (``format_sensitivity_<n>:<config>:<source id>``);
* the system turn is BFCL's (``system_prompt_pre_processing_chat_model``, which builds it
  with ``formulate_system_prompt`` from the id's config), rendered with the model's chat
  template as every prompt here, and the model is offered no tools;
* the reply is decoded by BFCL's ``default_decode_ast_prompting`` for the config's return
  format and tag (its model_handler/utils.py imports tree-sitter and tenacity, which
  pyproject lists), shape-checked by its ``is_function_calling_format_output``, and the
  calls are judged by our AST checker, the one tests/test_bfcl_v4.py proves against BFCL's
  ``ast_checker`` (Python rules, as BFCL judges every format_sensitivity case);
* the summary is BFCL's ``format_sensitivity_runner``'s: accuracy per config, and the max
  delta, variance and standard deviation across configs (in points, rounded as BFCL
  rounds). BFCL counts the category in no overall score (``NON_SCORING_CATEGORY``).

One guard differs from BFCL: its python decoder ``eval``s the text of any binary
operation in a reply (``resolve_ast_by_type``), so a reply ``f(a=__import__('os')...+1)``
would run on the evaluating machine. A python-format reply reaches the decoder only if
each binary operation in it is + - * / on numbers, or + on strings (``2*3`` decodes to 6,
as in BFCL); any other is scored ``ast_decoder:decoder_failed`` without being evaluated.

``format_oracle_reply`` writes a case's ground truth in its config's format, so the
render -> decode -> check path is shown to lose no correct answer; where BFCL's own
decoder cannot read a correct answer, the tests name the cases.
"""
from __future__ import annotations

import ast
import json
import re
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from xml.sax.saxutils import escape, quoteattr

from .bfcl_categories import PYTHON, BfclDataError, bfcl_module
from .bfcl_checker import check_calls
from .bfcl_data import BfclCase, expected_calls, tool_spec
from .bfcl_oracle import oracle_arguments
from .bfcl_score import BfclResult
from ..formats.chatformat import ChatMessage, ToolCall

FORMAT_CATEGORY = "format_sensitivity"


@dataclass(frozen=True)
class PromptFormat:
    """One of BFCL's system prompt variants, read from its config string
    (``ret_fmt=...&tool_call_tag=...&func_doc_fmt=...&prompt_fmt=...&style=...``)."""

    config: str
    return_format: str
    tool_call_tag: bool
    doc_format: str

    @classmethod
    def parse(cls, config: str) -> PromptFormat:
        ret, tag, doc, _layout, _style = bfcl_module("model_handler.utils").parse_prompt_variation_params(config)
        return cls(config, ret, tag, doc)


def config_of(case_id: str) -> str:
    """The config part of a format_sensitivity id (BFCL's extract_prompt_format_from_id)."""
    return case_id.split(":")[1]


def load_format_sensitivity(limit: int | None = None) -> list[BfclCase]:
    """BFCL's format_sensitivity cases, each as a prompting model is asked it: BFCL's
    system turn, no tools offered; `limit`: the first N source cases, each in all 26
    formats."""
    utils = bfcl_module("utils")
    handler = bfcl_module("model_handler.utils")
    entries = utils.load_dataset_entry(FORMAT_CATEGORY)
    truths = utils.load_ground_truth_entry(FORMAT_CATEGORY)
    if limit is not None:
        per_case = len(utils.get_all_format_sensitivity_configs())
        entries, truths = entries[:limit * per_case], truths[:limit * per_case]
    cases = []
    for entry, truth in zip(entries, truths, strict=True):
        source = entry["id"].split(":")[-1]
        if source != truth["id"]:
            raise BfclDataError(f"{entry['id']}: ground truth {truth['id']!r} does not pair with it")
        turn = handler.system_prompt_pre_processing_chat_model(
            [dict(m) for m in entry["question"][0]], entry["function"], entry["id"])
        try:
            tools = tuple(tool_spec(doc) for doc in entry["function"])
            expected = expected_calls(truth["ground_truth"], tools)
        except ValueError as exc:
            raise BfclDataError(f"{entry['id']}: {exc}") from None
        cases.append(BfclCase(entry["id"], FORMAT_CATEGORY,
                              tuple(ChatMessage(role=m["role"], content=m["content"]) for m in turn),
                              (), expected, PYTHON, tools, prompt_format=config_of(entry["id"])))
    return cases


# --------------------------------------------------------------------------- the guard

# What BFCL's python decoder may eval: arithmetic on numbers, and strings joined with + (a
# string may not be multiplied: "a" * 10**9 is a gigabyte).
_ARITHMETIC = (ast.BinOp, ast.UnaryOp, ast.Constant, ast.Add, ast.Sub, ast.Mult, ast.Div, ast.USub, ast.UAdd)
_OPERANDS = (int, float, str)


def _decoded_text(text: str, tag: bool) -> str | None:
    """The text BFCL's python decoder hands ``ast.parse`` (default_decode_ast_prompting,
    then ast_parse), or None where it stops before parsing."""
    text = text.strip("`\n ")
    text = text if text.startswith("[") else "[" + text
    text = text if text.endswith("]") else text + "]"
    if tag:
        match = re.search(r"<TOOLCALL>(.*?)</TOOLCALL>", text, re.DOTALL)
        if not match:
            return None
        text = match.group(1).strip()
    return text.strip().strip("'")


def unsafe_python_reply(text: str, tag: bool) -> str | None:
    """Why BFCL's python decoder must not see `text` (it would ``eval`` more than
    arithmetic on numbers), or None."""
    source = _decoded_text(text, tag)
    if source is None:
        return None
    try:
        tree = ast.parse(source, mode="eval")
    except (SyntaxError, ValueError):
        return None  # BFCL's decoder fails on it too, before any eval
    for node in ast.walk(tree):
        if isinstance(node, ast.Lambda):
            return "a lambda in a call's arguments"
        if isinstance(node, ast.BinOp):
            parts = list(ast.walk(node))
            texts = any(isinstance(p, ast.Constant) and type(p.value) is str for p in parts)
            if any(not isinstance(p, _ARITHMETIC) or (isinstance(p, ast.Constant) and type(p.value) not in _OPERANDS)
                   or (texts and isinstance(p, ast.operator) and not isinstance(p, ast.Add)) for p in parts):
                return f"an operation on more than numbers and text ({ast.unparse(node)[:60]})"
    return None


# --------------------------------------------------------------------------- scoring


def score_format_reply(case: BfclCase, text: str) -> BfclResult:
    """A prompting model's reply, decoded as BFCL decodes it for the case's format and
    judged by our AST checker (BFCL's verdicts: see the module docstring)."""
    assert case.expected is not None
    fmt = PromptFormat.parse(case.prompt_format)
    enums = bfcl_module("constants.enums")
    handler = bfcl_module("model_handler.utils")

    def failed(kind: str, reason: str, calls: Sequence[ToolCall] = ()) -> BfclResult:
        return BfclResult(case.id, case.category, False, kind, reason, text, list(calls))

    if fmt.return_format == "python":
        unsafe = unsafe_python_reply(text, fmt.tool_call_tag)
        if unsafe is not None:
            return failed("ast_decoder:decoder_failed", f"not decoded: BFCL's decoder would eval {unsafe}")
    try:
        decoded = handler.default_decode_ast_prompting(text, enums.ReturnFormat(fmt.return_format),
                                                        fmt.tool_call_tag)
    except Exception as exc:  # noqa: BLE001 - BFCL's own verdict for any decoder failure
        return failed("ast_decoder:decoder_failed", f"Invalid syntax. Failed to decode AST. {exc}")
    if not bfcl_module("utils").is_function_calling_format_output(decoded):
        return failed("ast_decoder:decoder_wrong_output_format", "Did not output in the specified format.")
    calls = [ToolCall(name=name, arguments=args) for item in decoded for name, args in item.items()]
    mismatch = check_calls(calls, case.expected, case.check_tools)
    if mismatch is not None:
        return failed(mismatch.kind, mismatch.message, calls)
    return BfclResult(case.id, case.category, True, "", "", text, calls)


# --------------------------------------------------------------------------- the oracle

_XML_TYPES = {str: "string", bool: "boolean", int: "integer", float: "float", type(None): "null",
              list: "array", dict: "dict"}


def _xml_value(value: Any) -> tuple[str, str]:
    """(type, text) for BFCL's XML decoders (convert_value_by_type reads arrays and dicts
    with ast.literal_eval)."""
    kind = _XML_TYPES.get(type(value), "string")
    if kind in ("array", "dict"):
        return kind, repr(value)
    if kind == "null":
        return kind, ""
    return kind, str(value)


def _call_text(name: str, args: Mapping[str, Any], return_format: str) -> str:
    if return_format == "python":
        return f"{name}({', '.join(f'{k}={v!r}' for k, v in args.items())})"
    if return_format == "verbose_xml":
        params = "".join(f"<param name={quoteattr(k)} value={quoteattr(text)} type={quoteattr(kind)}/>"
                         for k, (kind, text) in ((k, _xml_value(v)) for k, v in args.items()))
        return f"<function name={quoteattr(name)}><params>{params}</params></function>"
    params = "".join(f"<param name={quoteattr(k)} type={quoteattr(kind)}>{escape(text)}</param>"
                     for k, (kind, text) in ((k, _xml_value(v)) for k, v in args.items()))
    return f"<function name={quoteattr(name)}>{params}</function>"


def format_oracle_reply(case: BfclCase) -> str:
    """The ground truth's first acceptable answer written in the case's return format
    (BFCL's OUTPUT_FORMAT_MAPPING), inside <TOOLCALL> where the config asks for it."""
    assert case.expected is not None
    fmt = PromptFormat.parse(case.prompt_format)
    specs = {t.name: t for t in case.check_tools}
    calls = [(e.name, oracle_arguments(e, specs[e.name])) for e in case.expected]
    if fmt.return_format == "python":
        body = "[" + ", ".join(_call_text(n, a, "python") for n, a in calls) + "]"
    elif fmt.return_format == "json":
        body = "```json\n" + json.dumps([{"function": n, "parameters": a} for n, a in calls],
                                        ensure_ascii=False) + "\n```"
    else:
        body = "<functions>" + "".join(_call_text(n, a, fmt.return_format) for n, a in calls) + "</functions>"
    return f"<TOOLCALL>{body}</TOOLCALL>" if fmt.tool_call_tag else body


# --------------------------------------------------------------------------- BFCL's summary


@dataclass(frozen=True)
class FormatSensitivity:
    """BFCL's format_sensitivity_runner header: accuracy per config, and across configs the
    max delta, variance and standard deviation, in points rounded to 2 places."""

    by_config: dict[str, tuple[int, int]]  # config -> (correct, total)
    max_delta: float
    variance: float
    std: float

    def header_fields(self) -> dict[str, Any]:
        return {"accuracy_max_delta": self.max_delta, "accuracy_variance": self.variance, "accuracy_std": self.std,
                **{c: {"accuracy": k / n, "correct_count": k, "total_count": n} for c, (k, n) in self.by_config.items()}}


def format_sensitivity(results: Sequence[BfclResult]) -> FormatSensitivity | None:
    """The summary of the format_sensitivity results among `results` (None if none)."""
    by_config: dict[str, tuple[int, int]] = {}
    for r in results:
        if r.category == FORMAT_CATEGORY:
            k, n = by_config.get(config_of(r.id), (0, 0))
            by_config[config_of(r.id)] = (k + r.passed, n + 1)
    if not by_config:
        return None
    accs = [k / n for k, n in by_config.values()]
    if len(accs) > 1:
        return FormatSensitivity(by_config, round((max(accs) - min(accs)) * 100, 2),
                                 round(statistics.variance(accs) * 100 ** 2, 2), round(statistics.stdev(accs) * 100, 2))
    return FormatSensitivity(by_config, 0.0, 0.0, 0.0)


def all_configs() -> list[str]:
    """BFCL's 26 configs, in its order (the columns of data_format_sensitivity.csv)."""
    return list(bfcl_module("utils").get_all_format_sensitivity_configs())
