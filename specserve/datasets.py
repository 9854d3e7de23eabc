"""Benchmark workloads built offline and deterministically from material on every machine.

Five built-in workloads, each a JSON file in ``specserve/data/workloads/``:

- ``code``: signature + docstring of a Python standard-library function, asking for the body.
- ``summarize``: a long stdlib module (or function) docstring to summarise: high prompt/output overlap.
- ``chat``: varied everyday instructions written here (``CHAT_INSTRUCTIONS``).
- ``edit``: a stdlib function to rewrite with a small change (rename, type hints, ...): the best case for
  prompt lookup (n-gram) speculation, since the answer mostly copies the prompt.
- ``json``: a stdlib function's source, asking for its signature as JSON under a schema carried in the
  item's ``response_format`` (structured output: the grammar forces the keys, the values copy the prompt).

Stdlib sources are read from the files (never imported), walked with ``ast`` in source order, and
selected with a stable hash, so two builds on the same Python version are byte-identical. Each prompt
records its provenance (module, qualified name, file relative to the stdlib, line).

    python -m specserve.datasets --out specserve/data/workloads   # rebuild the shipped files

Users' own data: ``load_dataset("my.jsonl")``, one JSON object per line with a ``prompt`` (raw
completion) or ``messages`` (chat) field.
"""

from __future__ import annotations

import argparse
import ast
import copy
import hashlib
import json
import os
import platform
import sysconfig
import textwrap
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

WORKLOADS_DIR = os.path.join(os.path.dirname(__file__), "data", "workloads")

# Pure-Python stdlib modules present on every CPython >= 3.10 and read without importing them.
CODE_MODULES = (
    "textwrap", "string", "shlex", "difflib", "heapq", "bisect", "fractions", "statistics", "calendar",
    "colorsys", "glob", "fnmatch", "posixpath", "json.encoder", "json.decoder", "csv", "configparser",
    "base64", "quopri", "html", "urllib.parse", "ipaddress", "functools", "copy", "pprint", "reprlib",
    "contextlib", "queue", "sched", "random", "tempfile", "gettext", "graphlib", "shutil", "tokenize",
    "collections", "email.utils", "hmac", "uuid", "datetime", "linecache", "traceback", "weakref",
    "mimetypes", "netrc", "plistlib", "timeit",
)
SUMMARIZE_MODULES = (
    "string", "difflib", "heapq", "statistics", "colorsys", "fnmatch", "posixpath", "configparser",
    "argparse", "urllib.parse", "copy", "pprint", "sched", "random", "tempfile", "gettext", "tokenize",
    "inspect", "ast", "collections", "typing", "http.cookies", "wave", "uuid", "_pydecimal", "locale", "cmd",
    "codeop", "mimetypes", "optparse", "smtplib", "ftplib", "socketserver", "timeit", "trace", "zipimport",
    "plistlib", "doctest", "subprocess",
)
MAX_PROMPT_CHARS = 3000  # ~1000 tokens of English or code for a BPE tokenizer: fits a small model's context
NUM_CODE, NUM_SUMMARIZE, NUM_EDIT, NUM_JSON = 64, 40, 48, 40
TRAIN_CODE, NUM_CODE_TRAIN = "stdlib-code", 600  # distill's extra code prompts (not a benchmark)
TRAIN_JSON, NUM_JSON_TRAIN = "stdlib-json", 400  # distill's ``json``-task prompts over the same modules
VOCAB_CHAT, NUM_VOCAB_CHAT = "vocab-chat", 3000  # distill's requests about words of the target's vocabulary

CHAT_INSTRUCTIONS = (
    "Write a short story about a robot who learns to paint.",
    "Explain how a hash table works, step by step.",
    "List five tips for staying focused while studying.",
    "What are the main differences between Python lists and tuples?",
    "Describe the water cycle to a ten year old.",
    "Write a haiku about autumn leaves.",
    "How do I reverse a linked list in C?",
    "Summarize the plot of Romeo and Juliet in three sentences.",
    "Give me a recipe for a simple vegetable soup.",
    "What is the difference between weather and climate?",
    "Write a polite email asking my manager for a day off next Friday.",
    "Explain recursion using a real-life analogy.",
    "Suggest three names for a coffee shop near a library.",
    "What causes the seasons on Earth?",
    "Translate 'Good morning, how are you?' into French and Spanish.",
    "Write a limerick about a cat who loves boxes.",
    "Explain what an API is to someone who does not program.",
    "How does compound interest work? Give a numeric example.",
    "List the planets of the solar system in order from the Sun.",
    "Write a SQL query that returns the ten most recent orders from a table called orders.",
    "What are the benefits of regular exercise?",
    "Explain the difference between TCP and UDP.",
    "Write a short motivational message for someone starting a new job.",
    "How do vaccines train the immune system?",
    "Give three arguments for and three against school uniforms.",
    "Write a Python function that checks whether a string is a palindrome.",
    "What is photosynthesis? Answer in two sentences.",
    "Plan a one-day sightseeing itinerary for Paris.",
    "Explain big-O notation with examples.",
    "Write a product description for a reusable water bottle.",
    "What should I consider when adopting a dog?",
    "Describe how a bill becomes a law in a parliamentary system.",
    "Write a dialogue between a teacher and a student about homework.",
    "Explain what machine learning is in simple terms.",
    "Give me five ideas for a rainy-day activity with children.",
    "How do I make a good first impression at a job interview?",
    "Explain the rules of chess briefly.",
    "Write a thank-you note to a friend who helped me move house.",
    "What is the Pythagorean theorem and how is it used?",
    "Compare electric cars and petrol cars in a short table.",
    "Write a bash command that counts the lines in all .py files in a directory.",
    "What are good habits for better sleep?",
    "Explain inflation and why it matters.",
    "Write a four-line poem about the sea at night.",
    "How does a refrigerator keep food cold?",
    "Give step-by-step instructions for changing a flat bicycle tyre.",
    "What is the difference between a virus and a bacterium?",
    "Write a JavaScript function that debounces another function.",
    "Describe the main causes of the French Revolution.",
    "Suggest a weekly workout plan for a beginner.",
    "Explain how Git branches work.",
    "Write a short review of an imaginary science fiction film.",
    "What are prime numbers? List the first ten.",
    "How can I reduce my household energy use?",
    "Explain the difference between 'affect' and 'effect' with examples.",
    "Write a regular expression that matches an email address and explain it.",
    "Why is the sky blue?",
    "Give me a packing list for a weekend camping trip.",
    "Explain what a neural network is, using an analogy.",
    "Write a short speech for a friend's birthday party.",
    "What is the difference between a process and a thread?",
    "Describe three famous paintings and their artists.",
    "Write unit tests in pytest for a function add(a, b).",
    "How do bees make honey?",
)

EDIT_TASKS = ("rename_param", "type_hints", "rename_function", "strip_docs")


@dataclass
class Item:
    """One prompt: chat ``messages`` or a raw completion ``prompt``, with where it came from."""

    id: str
    messages: list[dict[str, str]] | None = None
    prompt: str | None = None
    source: dict[str, Any] = field(default_factory=dict)
    task: str | None = None
    response_format: dict[str, Any] | None = None  # OpenAI's shape: the output's JSON schema (``json``)

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {"id": self.id}
        if self.messages is not None:
            d["messages"] = self.messages
        if self.prompt is not None:
            d["prompt"] = self.prompt
        if self.task:
            d["task"] = self.task
        if self.response_format is not None:
            d["response_format"] = self.response_format
        d["source"] = self.source
        return d

    @property
    def text(self) -> str:
        """The user-visible text (for display and rough length checks)."""
        return self.prompt if self.prompt is not None else "\n".join(m["content"] for m in self.messages or [])


# -- reading the stdlib ------------------------------------------------------------------------------------
@dataclass
class _Def:
    module: str
    qualname: str
    node: ast.FunctionDef | ast.AsyncFunctionDef
    lines: list[str]  # the module's source lines (shared by all defs of the module)
    file: str  # relative to the stdlib directory

    @property
    def provenance(self) -> dict[str, Any]:
        return {"module": self.module, "qualname": self.qualname, "file": self.file,
                "line": self.node.lineno}


def _module_source(name: str) -> tuple[str, str]:
    """(source text, path relative to the stdlib dir), read from the file: no import, and frozen modules
    (posixpath, ...) are found too."""
    root = sysconfig.get_paths()["stdlib"]
    base = name.replace(".", "/")
    for rel in (f"{base}.py", f"{base}/__init__.py"):
        path = os.path.join(root, rel)
        if os.path.isfile(path):
            with open(path, encoding="utf-8") as f:
                return f.read(), rel
    raise FileNotFoundError(f"no Python source for stdlib module {name} under {root}")


def _defs(module: str) -> Iterator[_Def]:
    """Top-level functions and methods of top-level classes, in source order."""
    src, rel = _module_source(module)
    tree = ast.parse(src)
    lines = src.splitlines(keepends=True)
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield _Def(module, node.name, node, lines, rel)
        elif isinstance(node, ast.ClassDef):
            for sub in node.body:
                if isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    yield _Def(module, f"{node.name}.{sub.name}", sub, lines, rel)


def _stable_key(*parts: str) -> str:
    return hashlib.sha1("\0".join(parts).encode()).hexdigest()


def _pick(per_module: list[list[_Def]], limit: int) -> list[_Def]:
    """Round-robin over modules (in the fixed module order) so every workload mixes many modules."""
    out: list[_Def] = []
    depth = 0
    while len(out) < limit and any(depth < len(c) for c in per_module):
        for cands in per_module:
            if depth < len(cands) and len(out) < limit:
                out.append(cands[depth])
        depth += 1
    return out


def _select(modules: tuple[str, ...], keep: Callable[[_Def], bool], per: int, limit: int) -> list[_Def]:
    per_module = []
    for m in modules:
        cands = sorted((d for d in _defs(m) if keep(d)), key=lambda d: _stable_key(d.module, d.qualname))
        per_module.append(cands[:per])
    return _pick(per_module, limit)


def _segment(d: _Def) -> str:
    """The def's own source text (decorators excluded), dedented."""
    end = d.node.end_lineno or d.node.lineno
    return textwrap.dedent("".join(d.lines[d.node.lineno - 1:end]).rstrip("\n") + "\n").rstrip("\n")


def _public(d: _Def) -> bool:
    name = d.qualname.rsplit(".", 1)[-1]
    return not name.startswith("_") or name == "__init__"


# -- the four workloads -------------------------------------------------------------------------------------
def _user(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def _code_keep(d: _Def) -> bool:
    doc = ast.get_docstring(d.node) or ""
    n_lines = (d.node.end_lineno or d.node.lineno) - d.node.lineno
    return _public(d) and len(doc) >= 60 and 4 <= n_lines <= 60 and len(_segment(d)) <= MAX_PROMPT_CHARS


def _code_item(item_id: str, d: _Def) -> Item:
    stub = copy.copy(d.node)  # shallow: only the body and decorators are replaced
    stub.body, stub.decorator_list = [d.node.body[0]], []
    sig = ast.unparse(stub)
    where = f"method `{d.qualname}`" if "." in d.qualname else f"function `{d.qualname}`"
    text = (f"Implement the body of the {where} from the Python standard library module "
            f"`{d.module}`. Reply with the complete function in one Python code block.\n\n"
            f"```python\n{sig}\n```")
    return Item(item_id, _user(text), source=d.provenance, task="complete_body")


def build_code() -> list[Item]:
    """Signature + docstring of a stdlib function; ask for the body."""
    return [_code_item(f"code-{i:03d}", d) for i, d in enumerate(_select(CODE_MODULES, _code_keep, per=3,
                                                                           limit=NUM_CODE))]


_SKIP_DIRS = ("test", "tests", "idlelib", "site-packages", "lib2to3", "__pycache__", "turtledemo", "ensurepip")


def stdlib_sources(exclude: tuple[str, ...]) -> list[tuple[str, str]]:
    """(module name, file) of every pure-Python stdlib source outside test suites, sorted, without the modules
    named in ``exclude`` (a package name skips the files directly in it)."""
    root = sysconfig.get_paths()["stdlib"]
    skip = {os.path.join(root, *m.split(".")) for m in exclude}
    out = []
    for dirpath, dirnames, names in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)
        for n in sorted(names):
            path = os.path.join(dirpath, n)
            if n.endswith(".py") and path[:-3] not in skip and dirpath not in skip:
                rel = os.path.relpath(path[:-3], root).replace(os.sep, ".")
                out.append((rel.removesuffix(".__init__"), path))
    return out


def _train_defs(keep: Callable[[_Def], bool], per: int, limit: int) -> list[_Def]:
    """Up to ``per`` defs of each public stdlib module that no benchmark workload reads (round-robin, at most
    ``limit``): distill's prompts keep every benchmark prompt, and its module, unseen."""
    per_module = []
    for module, _ in stdlib_sources(CODE_MODULES + SUMMARIZE_MODULES):
        if module.split(".")[-1].startswith("_") or "__main__" in module:
            continue
        try:
            defs = [d for d in _defs(module) if keep(d)]
        except (SyntaxError, UnicodeDecodeError, ValueError, FileNotFoundError):
            continue  # a file this Python cannot parse
        per_module.append(sorted(defs, key=lambda d: _stable_key(d.module, d.qualname))[:per])
    return _pick(per_module, limit)


def build_code_train(limit: int = NUM_CODE_TRAIN) -> list[Item]:
    """``code``-style prompts over the stdlib modules that no benchmark workload reads: training prompts for
    `specserve distill` (dataset ``stdlib-code``)."""
    return [_code_item(f"{TRAIN_CODE}-{i:03d}", d) for i, d in enumerate(_train_defs(_code_keep, 4, limit))]


def _truncate_paragraphs(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    out = ""
    for para in text.split("\n\n"):
        if len(out) + len(para) + 2 > limit:
            break
        out = f"{out}\n\n{para}" if out else para
    return out or text[:limit]


def build_summarize() -> list[Item]:
    """Long module docstrings first, then long function docstrings, each asked to be summarised."""
    docs: list[tuple[str, dict[str, Any]]] = []
    for m in SUMMARIZE_MODULES:
        src, rel = _module_source(m)
        doc = ast.get_docstring(ast.parse(src)) or ""
        if len(doc) >= 400:
            docs.append((f"the documentation of the Python module `{m}`",
                         {"module": m, "qualname": None, "file": rel, "line": 1, "text": doc}))
    long_defs = _select(CODE_MODULES + SUMMARIZE_MODULES,
                        lambda d: _public(d) and len(ast.get_docstring(d.node) or "") >= 700, per=1,
                        limit=max(0, NUM_SUMMARIZE - len(docs)))
    for d in long_defs:
        docs.append((f"the documentation of `{d.module}.{d.qualname}`",
                     {**d.provenance, "text": ast.get_docstring(d.node) or ""}))
    items = []
    for i, (what, prov) in enumerate(docs[:NUM_SUMMARIZE]):
        body = _truncate_paragraphs(prov.pop("text"), MAX_PROMPT_CHARS)
        text = (f"Summarize {what} below in a few sentences, reusing its own terms.\n\n"
                f"\"\"\"\n{body}\n\"\"\"")
        items.append(Item(f"summarize-{i:03d}", _user(text), source=prov, task="summarize"))
    return items


def build_chat() -> list[Item]:
    src = {"file": "specserve/datasets.py", "qualname": "CHAT_INSTRUCTIONS"}
    return [Item(f"chat-{i:03d}", _user(t), source={**src, "index": i}, task="chat")
            for i, t in enumerate(CHAT_INSTRUCTIONS)]


def _edit_instruction(task: str, d: _Def) -> str | None:
    node = d.node
    params = [a.arg for a in node.args.posonlyargs + node.args.args + node.args.kwonlyargs
              if a.arg not in ("self", "cls")]
    if task == "rename_param":
        return f"Rename the parameter `{params[0]}` to `{params[0]}_value` everywhere in the function." \
            if params else None
    if task == "type_hints":
        return "Add type hints to every parameter and to the return value. Change nothing else."
    if task == "rename_function":
        if node.name.startswith("_"):
            return None
        return f"Rename the function `{node.name}` to `{node.name}_impl`. Change nothing else."
    if ast.get_docstring(node):  # strip_docs
        return "Remove the docstring and all comments. Keep the code exactly as it is otherwise."
    return None


def build_edit() -> list[Item]:
    """Rewrite a stdlib function with one small change: the answer mostly repeats the prompt."""
    def keep(d: _Def) -> bool:
        n_lines = (d.node.end_lineno or d.node.lineno) - d.node.lineno
        return _public(d) and 5 <= n_lines <= 40 and len(_segment(d)) <= 2000

    items: list[Item] = []
    for d in _select(CODE_MODULES, keep, per=2, limit=4 * NUM_EDIT):
        task = EDIT_TASKS[len(items) % len(EDIT_TASKS)]
        instr = _edit_instruction(task, d)
        if instr is None:  # no parameter to rename / no docstring to strip
            task, instr = "type_hints", _edit_instruction("type_hints", d)
        text = (f"{instr} Reply with the full rewritten function in one Python code block.\n\n"
                f"```python\n{_segment(d)}\n```")
        items.append(Item(f"edit-{len(items):03d}", _user(text), source=d.provenance, task=task))
        if len(items) == NUM_EDIT:
            break
    return items


SIGNATURE_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 64},
        "parameters": {"type": "array", "maxItems": 8, "items": {
            "type": "object",
            "properties": {"name": {"type": "string", "maxLength": 32},
                           "default": {"type": ["string", "null"], "maxLength": 32}},
            "required": ["name", "default"], "additionalProperties": False}},
        "returns_value": {"type": "boolean"},
        "raises": {"type": "array", "maxItems": 4, "items": {"type": "string", "maxLength": 32}},
    },
    "required": ["name", "parameters", "returns_value", "raises"],
    "additionalProperties": False,
}


def _json_keep(d: _Def) -> bool:
    n_lines = (d.node.end_lineno or d.node.lineno) - d.node.lineno
    return _public(d) and bool(d.node.args.args) and 3 <= n_lines <= 40 and len(_segment(d)) <= MAX_PROMPT_CHARS // 2


_SIGNATURE_RF = {"type": "json_schema", "json_schema": {"name": "function_signature", "schema": SIGNATURE_SCHEMA,
                                                         "strict": True}}


def _json_item(item_id: str, d: _Def) -> Item:
    text = ("Extract the signature of this Python function as JSON: its name, its parameters with their "
            "default values (as source text, null when there is none), whether it returns a value, and "
            f"the exceptions it raises.\n\n```python\n{_segment(d)}\n```")
    return Item(item_id, _user(text), source=d.provenance, task="extract_signature", response_format=_SIGNATURE_RF)


def build_json() -> list[Item]:
    """A stdlib function's source; ask for its signature as JSON under one schema (``response_format``):
    schema-constrained extraction, where the keys and punctuation are forced by the grammar and the values
    copy the prompt."""
    return [_json_item(f"json-{i:03d}", d)
            for i, d in enumerate(_select(SUMMARIZE_MODULES + CODE_MODULES, _json_keep, per=3, limit=NUM_JSON))]


def build_json_train(limit: int = NUM_JSON_TRAIN) -> list[Item]:
    """``json``-task prompts (with their ``response_format``) over the stdlib modules no benchmark workload
    reads: `specserve distill`'s dataset ``stdlib-json``."""
    return [_json_item(f"{TRAIN_JSON}-{i:03d}", d) for i, d in enumerate(_train_defs(_json_keep, 3, limit))]


NUM_AGENT_SESSIONS = 16  # x 3 turns


def _agent_keep(d: _Def) -> bool:
    n_lines = (d.node.end_lineno or d.node.lineno) - d.node.lineno
    return (_public(d) and bool(ast.get_docstring(d.node)) and 4 <= n_lines <= 30
            and len(_segment(d)) <= MAX_PROMPT_CHARS // 3)


def build_agent() -> list[Item]:
    """Agent sessions of 3 turns over one stdlib function, each turn a request with the whole conversation so
    far: a tool call reads the source, the answer explains it; then a rewrite; then the tool reads the same
    source again and the answer lists the parameters. Tool outputs repeat within a session and earlier
    answers come back in later turns' prompts (the stand-in answers are built from the source, since the
    model's own answers are not known here). Run in order at batch 1, a session's later turns can draft
    from its earlier requests: suffix decoding's cross-request case."""
    items = []
    for i, d in enumerate(_select(SUMMARIZE_MODULES + CODE_MODULES, _agent_keep, per=2, limit=NUM_AGENT_SESSIONS)):
        src = _segment(d)
        def_line = next((ln.strip() for ln in src.splitlines() if ln.lstrip().startswith(("def ", "async def "))),
                        src.splitlines()[0])
        doc = (ast.get_docstring(d.node) or "").strip().splitlines()[0]
        call = f'read_source(module="{d.module}", name="{d.qualname}")'
        tool = f"Tool output:\n```python\n{src}\n```\n"
        turn1 = [{"role": "user", "content": f"You are a coding agent with a read_source tool. Find out what "
                                             f"`{d.module}.{d.qualname}` does."},
                 {"role": "assistant", "content": call},
                 {"role": "user", "content": tool + "Explain what the function does in two or three sentences, "
                                                    "then quote its def line."}]
        turn2 = turn1 + [{"role": "assistant", "content": f"{doc}\n\n`{def_line}`"},
                         {"role": "user", "content": "Now rewrite the function with type hints on every parameter. "
                                                     "Reply with the complete function in one code block."}]
        turn3 = turn2 + [{"role": "assistant", "content": f"```python\n{src}\n```"},
                         {"role": "user", "content": "Read it again with the tool and list its parameters."},
                         {"role": "assistant", "content": call},
                         {"role": "user", "content": tool + "List the parameters, one per line, then quote the "
                                                            "def line again."}]
        for t, messages in enumerate((turn1, turn2, turn3), start=1):
            items.append(Item(f"agent-{i:02d}-{t}", messages, source={**d.provenance, "turn": t}, task="agent"))
    return items


BUILDERS: dict[str, Callable[[], list[Item]]] = {
    "code": build_code, "summarize": build_summarize, "chat": build_chat, "edit": build_edit, "json": build_json,
    "agent": build_agent,
}
DESCRIPTIONS = {
    "code": "complete the body of a stdlib function from its signature and docstring",
    "summarize": "summarise a long stdlib docstring (high prompt/output overlap)",
    "chat": "varied everyday instructions",
    "edit": "rewrite a stdlib function with one small change (best case for prompt lookup)",
    "json": "extract a stdlib function's signature as JSON under a schema (structured output)",
    "agent": "3-turn agent sessions over a stdlib function: tool outputs and earlier answers repeat (suffix decoding)",
}


def build(name: str) -> dict[str, Any]:
    """The JSON document of one workload (deterministic for a given Python version)."""
    items = BUILDERS[name]()
    return {
        "name": name,
        "description": DESCRIPTIONS[name],
        "builder": f"specserve.datasets.{BUILDERS[name].__name__}",
        "python_version": platform.python_version(),
        "num_prompts": len(items),
        "prompts": [it.to_json() for it in items],
    }


def dumps(doc: dict[str, Any]) -> str:
    return json.dumps(doc, indent=1, ensure_ascii=False) + "\n"


# -- loading ------------------------------------------------------------------------------------------------
def _item(obj: dict[str, Any], default_id: str) -> Item:
    rf = obj.get("response_format")
    if rf is not None and not isinstance(rf, dict):
        raise ValueError(f"dataset entry {default_id}: response_format must be an object")
    if "messages" in obj and isinstance(obj["messages"], list):
        return Item(str(obj.get("id", default_id)), messages=obj["messages"], source=obj.get("source", {}),
                    task=obj.get("task"), response_format=rf)
    if isinstance(obj.get("prompt"), str):
        return Item(str(obj.get("id", default_id)), prompt=obj["prompt"], source=obj.get("source", {}),
                    task=obj.get("task"), response_format=rf)
    raise ValueError(f"dataset entry {default_id} has neither a 'prompt' string nor a 'messages' list")


def load_dataset(name_or_path: str) -> list[Item]:
    """A built-in workload by name, a workload JSON file, or a JSONL file (``prompt`` or ``messages``)."""
    if name_or_path in BUILDERS and not os.path.exists(name_or_path):
        path = os.path.join(WORKLOADS_DIR, f"{name_or_path}.json")
        if not os.path.exists(path):  # not shipped (e.g. a source tree without data): build it now
            return [_item(p, p["id"]) for p in build(name_or_path)["prompts"]]
    else:
        path = name_or_path
    if not os.path.exists(path):
        raise ValueError(f"dataset {name_or_path!r}: not a built-in workload ({', '.join(BUILDERS)}) "
                         f"nor an existing file")
    with open(path, encoding="utf-8") as f:
        text = f.read()
    if path.endswith(".jsonl"):
        lines = [ln for ln in text.splitlines() if ln.strip()]
        items = []
        for i, ln in enumerate(lines):
            try:
                obj = json.loads(ln)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{i + 1}: not valid JSON ({e})") from None
            items.append(_item(obj, f"{os.path.basename(path)}:{i + 1}"))
    else:
        doc = json.loads(text)
        entries = doc["prompts"] if isinstance(doc, dict) else doc
        items = [_item(p, f"{os.path.basename(path)}:{i}") for i, p in enumerate(entries)]
    if not items:
        raise ValueError(f"dataset {path} has no prompts")
    return items


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Build the benchmark workloads from the Python stdlib.")
    ap.add_argument("--out", default=WORKLOADS_DIR, help="output directory (default: the shipped data dir)")
    ap.add_argument("--only", default=None, help="comma-separated subset of " + ",".join(BUILDERS))
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    names = args.only.split(",") if args.only else list(BUILDERS)
    for name in names:
        doc = build(name)
        path = os.path.join(args.out, f"{name}.json")
        text = dumps(doc)
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
        print(f"{path}: {doc['num_prompts']} prompts, {len(text.encode()) / 1024:.1f} KiB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
