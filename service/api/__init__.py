"""The HTTP API. ``app.create_app`` wires it: the routers by resource (``routers/``), the
dependencies they share (``deps``), the error handlers (``handlers``) and the OpenAPI additions
(``openapi``). Behind the routes, free of HTTP: the solve path and stored solutions
(``solutions.SolutionService``) and the validations (``validations.Validations``); around them,
API keys (``auth``), rate limits (``ratelimit``), logs and metrics (``observability``)."""
