"""The masks a Hugging Face model family builds: tiny random-weight models from config classes, run and traced.

The only package that imports transformers (with commands/model.py's body); `require()` says how to
install it where it is missing. Nothing here downloads: configs come from config classes or a local file.
"""

from __future__ import annotations

from maskcli.errors import MaskError

INSTALL = 'maskcli model needs transformers: pip install "maskcli[hf]" (in a clone of maskcli: pip install -e ".[hf]")'


def require(who: str = "maskcli model"):
    """The transformers module, or the one line that says how to install it (`who` needs it)."""
    try:
        import transformers
    except ImportError:
        raise MaskError(INSTALL.replace("maskcli model", who)) from None
    return transformers


def reason(error: BaseException) -> str:
    """An exception from transformers as a short clause: its type and first sentence, on one line."""
    text = " ".join(str(error).split())
    cut = text.find(". ")
    if 0 < cut < 200:
        text = text[:cut]
    return f"{type(error).__name__}: {text[:200]}"


class quiet:
    """transformers' logging held to errors, and its warnings ignored, while maskcli drives it: its advice about
    token ids, right padding and cache kinds is for real models, not these tiny ones."""

    def __enter__(self):
        import warnings

        logging = require().utils.logging
        self._level = logging.get_verbosity()
        logging.set_verbosity_error()
        self._warnings = warnings.catch_warnings()
        self._warnings.__enter__()
        warnings.simplefilter("ignore")
        return self

    def __exit__(self, *exc):
        self._warnings.__exit__(*exc)
        require().utils.logging.set_verbosity(self._level)
