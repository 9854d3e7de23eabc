"""HTTP errors in OpenAI's shape, and the mapping from engine and validation exceptions to them."""

from __future__ import annotations

import logging

from fastapi.responses import JSONResponse

from specserve.engine.async_engine import EngineClosedError, EngineStepError, QueueFullError
from specserve.sample.grammar import GrammarError
from specserve.server.protocol import ErrorInfo, ErrorResponse

log = logging.getLogger("specserve.server")


class APIError(Exception):
    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        # NOTE: a message quoting the request may hold lone surrogates, which JSON responses cannot encode.
        message = message.encode("utf-8", "backslashreplace").decode("utf-8")
        super().__init__(message)
        self.status, self.info = status, ErrorInfo(message=message, type=type, param=param, code=code)

    def response(self) -> JSONResponse:
        return JSONResponse(ErrorResponse(error=self.info).model_dump(), status_code=self.status)


def as_api_error(e: BaseException, fields: set[str] | None = None, constraint_param: str | None = None
                 ) -> APIError:
    """Map engine and validation exceptions to HTTP errors (anything unexpected is a 500). A grammar that
    does not compile names ``constraint_param``, the request field it came from."""
    if isinstance(e, APIError):
        return e
    if isinstance(e, GrammarError):
        param = constraint_param or "structured_outputs"
        return APIError(400, f"{param}: {e}", param=param)
    if isinstance(e, QueueFullError):
        return APIError(429, str(e), "rate_limit_exceeded", code="rate_limit_exceeded")
    if isinstance(e, EngineClosedError):
        return APIError(503, str(e), "server_error", code="service_unavailable")
    if isinstance(e, EngineStepError):
        return APIError(500, str(e), "server_error", code="internal_error")
    if isinstance(e, ValueError):
        first = str(e).split(" ", 1)[0].rstrip(":")
        return APIError(400, str(e), param=first if fields and first in fields else None)
    log.error("unexpected error", exc_info=(type(e), e, e.__traceback__))
    return APIError(500, f"internal server error ({type(e).__name__}: {e})", "server_error",
                    code="internal_error")
