"""The HTTP service: thin FastAPI routers over the engine and the solution cache."""
