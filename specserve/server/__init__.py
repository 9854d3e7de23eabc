"""OpenAI-compatible HTTP server: `create_app` / `run_server` in :mod:`specserve.server.api`."""
