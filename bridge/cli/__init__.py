"""The `clawbridge` command (`main`) and its read-outs of a data directory (`status`)."""
