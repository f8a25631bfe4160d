"""The error every route answers a client with, whichever API: ``APIError``
(raised anywhere below a route) and OpenAI's error object; ``errors.py``
turns it into the response, in Anthropic's shape on its routes."""

from __future__ import annotations

from typing import Optional


class APIError(Exception):
    """An error answered to the client as ``{"error": {...}}`` with ``status``."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        code: Optional[str] = None,
        param: Optional[str] = None,
        headers: Optional[dict[str, str]] = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.code = code
        self.param = param
        self.headers = headers or {}

    def body(self) -> dict:
        return error_body(self.message, self.type, self.code, self.param)


def error_body(
    message: str, type: str = "invalid_request_error", code: Optional[str] = None,
    param: Optional[str] = None,
) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}
