"""Errors in OpenAI's format: ``{"error": {"message", "type", "param", "code"}}`` with an HTTP status."""

from __future__ import annotations

from typing import Any


class APIError(Exception):
    """An error answered to the client as OpenAI does: status code plus an ``error`` object."""

    def __init__(
        self,
        message: str,
        *,
        status_code: int = 400,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ):
        super().__init__(message)
        self.message = message
        self.status_code = status_code
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        """The JSON body OpenAI clients parse."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def invalid_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    """A 400: the request cannot be served as written."""
    return APIError(message, status_code=400, param=param, code=code)


def model_not_found(requested: str, served: str) -> APIError:
    """A 404 for a ``model`` this server does not serve."""
    return APIError(
        f"The model `{requested}` does not exist; this server serves `{served}`.",
        status_code=404,
        param="model",
        code="model_not_found",
    )


def queue_full(max_waiting: int) -> APIError:
    """A 429 when the waiting queue already holds ``max_waiting`` requests."""
    return APIError(
        f"The server is busy: {max_waiting} requests are already waiting to start. Retry later.",
        status_code=429,
        type="server_overloaded",
        code="queue_full",
    )


def model_unpatched() -> APIError:
    """A 503 for a request that met the model unpatched, or between the two halves of a re-patch."""
    return APIError(
        "The model is not patched now (unpatched, or being patched again). Retry later.",
        status_code=503,
        type="server_error",
        code="model_unpatched",
    )


def shutting_down() -> APIError:
    """A 503 for requests that arrive while the server stops."""
    return APIError("The server is shutting down.", status_code=503, type="server_error", code="shutting_down")


def not_started() -> APIError:
    """A 503 for requests to an app whose lifespan has not run (the engine thread starts there)."""
    return APIError(
        "The server's engine has not started: the app's ASGI lifespan starts it (uvicorn runs it; "
        "httpx.ASGITransport does not: enter fastapi's TestClient(app) as a context manager instead).",
        status_code=503,
        type="server_error",
        code="not_started",
    )
