"""Errors in OpenAI's shape, and one message for pydantic's validation errors."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


def _is_union_tag(x: str) -> bool:
    return "[" in x or x in ("str", "int", "float", "bool", "dict", "list", "none")


def validation_message(errors: list[dict[str, Any]]) -> tuple[str, str | None]:
    """One OpenAI-style message (and the top-level parameter) for pydantic's errors."""
    if not errors:
        return "invalid request", None
    # A validator's own message (ValueError) says the most; else the first error.
    e = next((x for x in errors if x.get("type") == "value_error"), errors[0])
    raw = [str(x) for x in e.get("loc", ()) if x != "body"]
    path = ".".join(x for x in raw if not _is_union_tag(x))
    param = raw[0] if raw else None
    kind = e.get("type", "")
    if kind == "json_invalid":
        why = str((e.get("ctx") or {}).get("error", e.get("msg", "")))
        where = "" if not raw else f" character {raw[0]}" if why.endswith(" at") else f" at character {raw[0]}"
        return f"Invalid JSON body: {why}{where}", None
    if not raw and isinstance(e.get("input"), bytes | str):  # not parsed: no JSON content type
        return "Invalid JSON body: send a JSON object with Content-Type: application/json", None
    if kind == "extra_forbidden":
        return f"Unrecognized request argument supplied: {path}", param
    if kind == "missing":
        return (f"Missing required parameter: '{path}'" if raw else "The request body is missing"), param
    msg = str(e.get("msg", "invalid value")).removeprefix("Value error, ")
    tags = [t for x in errors for t in [str(y) for y in x.get("loc", ())][:len(e.get("loc", ())) + 1]
            if _is_union_tag(t)]
    if kind != "value_error" and len(set(tags)) > 1:  # a union: one error per alternative
        expected = ", ".join(dict.fromkeys(tags))
        return f"Invalid value for '{path}': {e.get('input')!r} (expected one of: {expected})", param
    return (f"Invalid value for '{path}': {msg}" if raw else msg), param
