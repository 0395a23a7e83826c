"""flexium's server: API, dashboard and live events in one process (``flexium server``).

Needs the ``server`` extra: ``pip install ".[server]"``. What the CLI (cli/server.py,
cli/workspaces.py) calls: ``flexium.server.app.serve(settings)`` and ``flexium.server.database_admin``.
"""
