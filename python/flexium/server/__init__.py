"""flexium's server: API, dashboard and live events in one process (``flexium server``).

Needs the ``server`` extra: ``pip install "flexium[server]"``. Entry points for the CLI:
``flexium.server.app.main(argv)`` and ``flexium.server.workspaces``.
"""
