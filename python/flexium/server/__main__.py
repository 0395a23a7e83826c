"""``python -m flexium.server [options]`` runs the server (same options as ``flexium server``);
``python -m flexium.server workspace ...`` / ``token ...`` manage workspaces and tokens."""

import sys

from flexium.server import app, workspaces

if __name__ == "__main__":
    argv = sys.argv[1:]
    if argv and argv[0] in ("workspace", "token"):
        sys.exit(workspaces.main(argv))
    sys.exit(app.main(argv))
