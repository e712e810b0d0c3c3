"""Checking a packed batch: the document boundaries each field implies, the mask each attention path builds
from them, and what leaks across documents.

    fields.py      reading a batch (a file or options) under the names HF, TRL, torchtitan and TE use
    boundaries.py  document starts and padding per field, per batch row, and where fields disagree
    paths.py       which field each attention path reads, and its mask as a maskcli expression
    findings.py    each path's cells across documents and onto padding, the paths compared; the whole report
                   (what the rules read gathered into one Packed, and the registry asked for every rule given a
                   packed `batch`: checks/packing.py's)

Everything is O(tokens) numpy on intervals; only a 4-D attention_mask the user gave has L x L cells.
"""
