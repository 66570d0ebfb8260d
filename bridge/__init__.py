"""clawbridge: serve your agent's model over the OpenAI API, learn from every conversation.

The SDK for custom agents is `clawbridge.Client` and `clawbridge.AsyncClient` (see `clawbridge.sdk.client`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__all__ = ["AsyncClient", "AsyncEpisode", "AsyncGroup", "AsyncSession", "Client", "Episode", "Group", "Session"]

if TYPE_CHECKING:
    from clawbridge.sdk.client import (
        AsyncClient,
        AsyncEpisode,
        AsyncGroup,
        AsyncSession,
        Client,
        Episode,
        Group,
        Session,
    )


def __getattr__(name: str) -> Any:
    # Lazy: `import clawbridge.<module>` must not pay for the openai SDK's import.
    if name in __all__:
        from clawbridge.sdk import client

        return getattr(client, name)
    raise AttributeError(f"module 'clawbridge' has no attribute {name!r}")
