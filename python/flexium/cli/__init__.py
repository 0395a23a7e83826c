"""The `flexium` command line."""
