"""The page (docs/ui.md): is the agent getting better, and what is it learning from? Served by the
server itself at `/ui`, offline (plain HTML, CSS and JS shipped in the package, charts drawn as
SVG), protected like the API, refreshed by polling a change token.

`ui_routes(board)` gives the routes; `Board` is what they read and act on (the store, the live
status, rollback and pause), built by the composition root (`live.live_board`) or, with no
server running, from a data directory (`live.offline_board`)."""

from clawbridge.ui.routes import Board, RouteError, ui_routes

__all__ = ["Board", "RouteError", "ui_routes"]
