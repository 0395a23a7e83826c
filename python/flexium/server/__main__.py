"""``python -m flexium.server [options]`` is ``flexium server [options]``;
``python -m flexium.server workspace ...`` / ``token ...`` are those commands."""

import sys

from flexium.cli.main import main

if __name__ == "__main__":
    argv = sys.argv[1:]
    sys.exit(main(argv if argv[:1] in (["workspace"], ["token"]) else ["server", *argv]))
