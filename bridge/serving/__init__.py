"""Serving: the OpenAI-compatible proxy (`proxy`), its wire formats and errors (`wire`), and the
sessions that tie requests into conversations (`sessions`). Captures every turn into the store.
Imports neither the learning loop nor the faces; the composition root (`clawbridge.server`) hands
it what it needs through `ProxyHooks`."""
