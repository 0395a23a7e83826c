"""The public API's machinery: session lifecycle, device routing, error recovery."""
