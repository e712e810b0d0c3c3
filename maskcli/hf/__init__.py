"""The masks a Hugging Face model family builds: tiny random-weight models from config classes, run and traced.

The only package that imports transformers (with commands/model.py's body); `require()` says how to
install it where it is missing. Nothing here downloads: configs come from config classes or a local file.
"""

from __future__ import annotations

from maskcli.errors import MaskError

INSTALL = 'maskcli model needs transformers: pip install "maskcli[hf]"'


def require():
    """The transformers module, or the one line that says how to install it."""
    try:
        import transformers
    except ImportError:
        raise MaskError(INSTALL) from None
    return transformers
