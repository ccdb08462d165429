"""TREAD routing: route specs, validation, the parameter-free token router, and loss-mask / token-keep geometry."""
from tread.routing.controller import RoutedBackbone, RoutePlan, RoutingController, run_blocks
from tread.routing.masks import resize_loss_mask, token_keep_mask
from tread.routing.router import SELECTION_MODES, TokenRouter, gather_tokens, keep_count, scatter_tokens
from tread.routing.spec import (
    NO_ROUTES_MESSAGE,
    Route,
    RouteConfigError,
    resolve_routes,
    routing_from_config,
    tokens_per_block,
    tokens_processed_fraction,
)

__all__ = [
    "NO_ROUTES_MESSAGE", "Route", "RoutePlan", "RoutedBackbone", "RouteConfigError", "RoutingController",
    "SELECTION_MODES", "TokenRouter", "gather_tokens", "keep_count", "resize_loss_mask", "resolve_routes",
    "routing_from_config", "run_blocks", "scatter_tokens", "token_keep_mask", "tokens_per_block",
    "tokens_processed_fraction",
]
