"""The OpenAI-compatible HTTP gateway in front of a `LivePool` (FastAPI, served by uvicorn)."""

from pool.gateway.app import GatewaySettings, create_app

__all__ = ["GatewaySettings", "create_app"]
