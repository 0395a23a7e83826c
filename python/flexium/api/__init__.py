"""The public API's machinery: the runtime that init() starts and shutdown() ends, device routing, error recovery."""
