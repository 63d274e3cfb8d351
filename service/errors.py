"""``sigprop.errors``: the service's name for the one exception type, which lives on the shared
floor (``sigprop.schemas.errors``) so that the client raises it without importing the service."""

from .schemas.errors import HTTP_STATUS, SigpropError

__all__ = ["HTTP_STATUS", "SigpropError"]
