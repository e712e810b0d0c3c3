"""A mask implied by a packed batch's fields (what `maskcli pack BATCH` reads): cu_seqlens, position_ids, seq_idx,
attention_mask, as pack/fields.py reads them and pack/boundaries.py places each field's documents.

The batch's mask is causal attention inside each document of its reference field (the field most others agree with,
in pack's REFERENCE_ORDER, or the one named), every padding token cut from the keys: what the collator meant. pack
itself checks what each attention path builds from each field against it.
"""

from __future__ import annotations

from maskcli.errors import MaskError
from maskcli.mask import Mask, MaskOptions
from maskcli.pack.fields import Batch
from maskcli.sources.base import Source


def read(spec: str | None, given: dict[str, str] | None = None, maps: list[str] | tuple = ()) -> Batch:
    """The batch a BATCH file holds (.pt, .safetensors, .npz or .json of named fields), as pack reads it: `given`,
    fields as option text (--position-ids 0,1,2,0,1), over the file's (spec None: the options alone); `maps`, the
    --field NAME=KEY maps naming a file's key as a field."""
    from maskcli.pack.fields import read as read_batch

    return read_batch(spec, dict(given or {}), list(maps))


def documents(batch: Batch, reference: str | None = None, where: str = "the batch") -> Mask:
    """The batch's Mask: one batch row per row of tokens, causal inside the documents `reference` (a field's name;
    None: pack's choice) places, padding cut; a document's first token is where a padding run ends too."""
    from maskcli.pack import boundaries as bd
    from maskcli.pack.paths import documents_mask

    fields = bd.every_field(batch, None)
    pad = bd.padding(fields, batch.rows, batch.length)
    ref = bd.reference(fields, reference, pad)
    if ref is None:
        raise MaskError(f"{where} does not say where its documents are: give position_ids, cu_seqlens or seq_idx in it")
    return documents_mask("document", ref.starts, pad)  # made from the sizes: no text to parse


def sequence(batch: Batch, where: str = "the batch"):
    """`document` bound to the sizes of the documents of a batch of one row with no padding (what shard splits: the
    real tokens of one sequence), as a term: and-ed into a mask as it is (mask.build's before), never written to be
    parsed back."""
    from maskcli import terms
    from maskcli.kinds import get as get_kind
    from maskcli.kinds.values import from_sizes
    from maskcli.pack.boundaries import document_sizes

    sizes = document_sizes(batch, where)
    return terms.bound(get_kind("document"), {"labels": from_sizes([sizes], "document(sizes=...)")})


def load(spec: str, options: MaskOptions | None = None, reference: str | None = None) -> Mask:
    """The Mask a BATCH file's documents imply (`documents`); the mask options do not apply: the batch says the
    sizes."""
    return documents(read(spec), reference, f"BATCH {spec!r}")


SOURCE = Source("packed", load, read=read)
