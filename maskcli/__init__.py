"""maskcli: see and check attention masks.

The public API is imported lazily so that `maskcli --help` never loads torch:

    from maskcli import make_spec, build
    mask = build(make_spec("window", length=8, window=3))
    mask.mask_mod          # hand it to torch.nn.attention.flex_attention.create_block_mask
"""

__version__ = "0.1.0"

_EXPORTS = {
    "MaskError": "maskcli.errors",
    "MaskSpec": "maskcli.spec",
    "make_spec": "maskcli.spec",
    "Mask": "maskcli.masks",
    "build": "maskcli.masks",
    "and_masks": "maskcli.masks",
    "or_masks": "maskcli.masks",
    "to_convention": "maskcli.conventions",
}

__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str):
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'maskcli' has no attribute {name!r}")
