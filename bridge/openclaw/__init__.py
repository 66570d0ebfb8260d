"""OpenClaw as a client: the provider entry and install into openclaw.json (`provider`) and the
plug-in that tags OpenClaw's requests (`plugin/`, package data)."""
