"""``python -m flexium.server [options]`` runs the server (same options as ``flexium server``);
``python -m flexium.server workspace ...`` / ``token ...`` manage workspaces and tokens."""

import sys


def _main() -> int:
    try:
        from flexium.server import app, workspaces
    except ImportError as exc:
        print(f'flexium server: the server is not installed ({exc}): pip install "flexium[server]"',
              file=sys.stderr)
        return 2
    argv = sys.argv[1:]
    if argv and argv[0] in ("workspace", "token"):
        return workspaces.main(argv)
    return app.main(argv)


if __name__ == "__main__":
    sys.exit(_main())
