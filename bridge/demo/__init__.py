"""`clawbridge demo`: a simulated user teaches the embedded model a preference through the real
OpenAI API (`runner`), described by a scenario file (`scenario`, built-ins under `scenarios/`)."""
