"""maskcli: see and check attention masks.

The public API is imported lazily so that `maskcli --help` never loads torch:

    from maskcli import build
    m = build("document(sizes=[3,5]) & window(2)")
    m.intervals()          # exact key intervals per query row (numpy)
    m.mask_mod             # hand it to torch.nn.attention.flex_attention.create_block_mask
    m.dense()              # bool (B, H, Lq, Lk), True = may attend
    m.table(); m.figure(); m.summary(); m.why(4, 2); m.diff(other)   # views (a notebook shows m itself)
    build("causal", lengths=[5, 3]); build("document", sizes=[300, 212]); build("chunk", chunks=np.array(...))

    with maskcli.trace() as t:   # every attention call of the code inside, with its mask
        model(x)
    t.calls[0].keep(); print(t.report())
"""

__version__ = "0.2.0"

_EXPORTS = {
    "MaskError": "maskcli.errors",
    "Mask": "maskcli.mask",
    "MaskOptions": "maskcli.mask",
    "build": "maskcli.api",
    "parse": "maskcli.expression",
    "Intervals": "maskcli.intervals",
    "kinds": "maskcli.kinds",
    "to_convention": "maskcli.conventions",
    "trace": "maskcli.trace",
    "testing": "maskcli.testing",
}

__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str):
    if name in _EXPORTS:
        import importlib

        module = importlib.import_module(_EXPORTS[name])
        return module if name in ("kinds", "trace", "testing") else getattr(module, name)
    raise AttributeError(f"module 'maskcli' has no attribute {name!r}")
