"""Moved to screener.known_answer.collective.peer_training (the known-answer folder's parts:
issue 37.2). This name stays for the scripts and Job manifests that import or run it, with a
deprecation line."""

import sys
import warnings

from screener.known_answer.collective import peer_training as _moved

warnings.warn("screener.known_answer.peer_training moved: use "
              "screener.known_answer.collective.peer_training", DeprecationWarning, stacklevel=2)

if __name__ == "__main__":  # `python -m screener.known_answer.peer_training`, as old manifests run it
    sys.exit(_moved.main())
sys.modules[__name__] = _moved
