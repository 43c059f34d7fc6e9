"""Moved to screener.known_answer.engine.synthetic (the known-answer folder's parts: issue 37.2). This
name stays for the scripts and Job manifests that import or run it, with a deprecation line."""

import sys
import warnings

from screener.known_answer.engine import synthetic as _moved

warnings.warn("screener.known_answer.synthetic moved: use screener.known_answer.engine.synthetic",
              DeprecationWarning, stacklevel=2)
sys.modules[__name__] = _moved
