"""flexium: move running PyTorch training between GPUs, or pause it with its GPU memory freed.

import flexium
flexium.init()
"""

from flexium import auto, config, utils
from flexium.api.runtime import init, is_initialized, shutdown

__version__ = "0.1.0"
__all__ = ["init", "shutdown", "is_initialized", "auto", "config", "utils", "__version__"]
