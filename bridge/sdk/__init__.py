"""The Python SDK for custom agents (`client`): OpenAI clients bound to a clawbridge session,
explicit feedback, and the server's status."""
