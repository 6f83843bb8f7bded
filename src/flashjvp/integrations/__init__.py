"""Integrations with model libraries: :mod:`flashjvp.integrations.diffusers` and
:mod:`flashjvp.integrations.transformers`.

Nothing here is imported by ``import flashjvp``: each submodule imports its library only when it
is itself imported (``pip install flashjvp[diffusers]`` / ``flashjvp[transformers]``).
"""
