"""The known-answer job specs (*.toml), shipped as the package data `screener._jobs`.

This file only makes the folder a package, so that importlib.resources finds it in a wheel and,
through the editable install's mapping, here in a checkout. See screener/known_answer/engine/packagedata.py.
"""
