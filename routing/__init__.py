"""TREAD routing: route specs, validation and the parameter-free token router."""
from routing.controller import RoutingController, run_blocks
from routing.router import SELECTION_MODES, TokenRouter, gather_tokens, scatter_tokens
from routing.spec import (
    NO_ROUTES_MESSAGE,
    Route,
    RouteConfigError,
    resolve_routes,
    routing_from_config,
    tokens_processed_fraction,
)

__all__ = [
    "NO_ROUTES_MESSAGE", "Route", "RoutingController", "run_blocks", "RouteConfigError", "SELECTION_MODES", "TokenRouter",
    "gather_tokens", "resolve_routes", "routing_from_config", "scatter_tokens", "tokens_processed_fraction",
]
