"""The chat format: messages and tools ↔ token ids with the model's own template (`renderer`),
its incremental prompt cache (`cache`), the streaming decoder of completions (`decode`), the
message and delta types (`messages`), and structural prefix matching of conversations
(`prefix`). Used by serving, learning and the judges alike; imports none of them."""
