"""The HTTP API's routes, one module per resource; ``app.create_app`` includes them (the ``/v1``
ones behind the read-access check). Each router carries its whole path prefix: the route a request
matched (its ``path``, the label of the request metrics and logs) is the router's own, without a
prefix given where it is included."""

from . import health, solutions, solve, templates, validations

# the /v1 resources, in the order their routes are matched and documented
V1_ROUTERS = (solve.router, solutions.router, templates.router, validations.router)
# the routes that read stored submissions (auth: a key unless SIGPROP_ANONYMOUS_STORED_READS)
STORED_ROUTERS = (solutions.router, validations.router)

__all__ = ["STORED_ROUTERS", "V1_ROUTERS", "health", "solutions", "solve", "templates", "validations"]
