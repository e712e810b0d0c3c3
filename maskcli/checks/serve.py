"""The rules `serve` runs on a serving engine's batch metadata, declared here; their findings are made in
maskcli/serve/checks.py (one batch), serve/steps.py (a request's steps across files), serve/expect.py (--expect)
and serve/model.py (--model), which each rule names as its check.

What a rule reads: one step's `batch` (the metadata of one attention call: lengths, page table, slot mapping,
cascade, virtual batches, draft masks), or the `steps` of one request across step files.
"""

from __future__ import annotations

import importlib

from maskcli.checks.registry import Rule


def _in_serve(pointer: str):
    """serve's function `module:name`, imported when it is called: the checks layer sits below serve/, whose batch
    and page-map types these rules read, so it names them rather than importing them."""
    module, _, name = pointer.partition(":")

    def check(*args, **kwargs):
        return getattr(importlib.import_module(module), name)(*args, **kwargs)

    check.__qualname__ = check.__name__ = pointer
    return check


CHECKS = "maskcli.serve.checks"
STEPS = "maskcli.serve.steps:steps"

RULES = (
    Rule("no-keys", "wrong", "batch", "a request with queries and a key length of 0 (often only at batch > 1): its rows "
         "are empty, the kernel writes zeros or NaN there", _in_serve(f"{CHECKS}:lengths"), given="metadata"),
    Rule("more-queries-than-keys", "wrong", "batch", "a request with more new tokens than keys, which include the new "
         "tokens", _in_serve(f"{CHECKS}:lengths"), given="metadata"),
    Rule("seq-len", "wrong", "batch", "seq_len not computed + new: a prefix hit whose new queries never see the cached "
         "prefix, or query offsets built from full lengths", _in_serve(f"{CHECKS}:lengths"), given="metadata"),
    Rule("query-count", "wrong", "batch", "query offsets (query_start_loc, cu_seqlens_q) that count more tokens than q "
         "holds (the per-token slot mapping)", _in_serve(f"{CHECKS}:lengths"), given="metadata"),
    Rule("table-short", "wrong", "batch", "a block-table row with fewer blocks than the request's keys need",
         _in_serve(f"{CHECKS}:pages"), given="metadata"),
    Rule("last-page-fill", "wrong", "batch", "a last page's fill (kv_last_page_len) outside 1..page_size",
         _in_serve(f"{CHECKS}:pages"), given="metadata"),
    Rule("bad-page", "wrong", "batch", "a block the keys need that is no page (a negative id): keys read from outside "
         "the cache", _in_serve(f"{CHECKS}:pages"), given="metadata"),
    Rule("null-page", "wrong", "batch", "the null page where keys are read: anywhere on a full layer, inside the window "
         "on a sliding one", _in_serve(f"{CHECKS}:pages"), given="metadata"),
    Rule("page-twice", "wrong", "batch", "one request reading one page as two logical blocks", _in_serve(f"{CHECKS}:pages"), given="metadata"),
    Rule("shared-page-partial", "wrong", "batch", "a page shared between requests that is partly filled (prefix caching "
         "shares only full pages)", _in_serve(f"{CHECKS}:pages"), given="metadata"),
    Rule("shared-page-written", "wrong", "batch", "a page another request reads, written this step (a page reused "
         "while a request, or its sliding window, still reads it)", _in_serve(f"{CHECKS}:pages"), given="metadata"),
    Rule("slot-mapping", "wrong", "batch", "a new token written off its own page's slot for its position (block "
         "tables indexed in the wrong units, another request's page)", _in_serve(f"{CHECKS}:pages"), given="metadata"),
    Rule("cascade-lengths", "wrong", "batch", "cascade lengths (cu_prefix_query_lens, prefix_kv_lens, suffix_kv_lens) "
         "that do not split each request's keys once", _in_serve(f"{CHECKS}:cascade"), given="metadata"),
    Rule("cascade-partial-page", "wrong", "batch", "a cascade's common prefix that is not whole pages",
         _in_serve(f"{CHECKS}:cascade"), given="metadata"),
    Rule("cascade-sees-later", "wrong", "batch", "a cascade's common prefix past a request's first new token: the "
         "prefix pass shows it later keys", _in_serve(f"{CHECKS}:cascade"), given="metadata"),
    Rule("cascade-pages", "wrong", "batch", "a request whose prefix blocks are not the pages the prefix pass reads",
         _in_serve(f"{CHECKS}:cascade"), given="metadata"),
    Rule("local-lengths", "wrong", "batch", "chunked-local virtual batches that split other tokens than the batch's",
         _in_serve(f"{CHECKS}:local"), given="metadata"),
    Rule("local-crosses-chunk", "wrong", "batch", "a chunked-local virtual batch across a chunk or request boundary",
         _in_serve(f"{CHECKS}:local"), given="metadata"),
    Rule("local-keys", "wrong", "batch", "a chunked-local virtual batch that sees keys before its chunk or misses its "
         "start: together they are not local(C)", _in_serve(f"{CHECKS}:local"), given="metadata"),
    Rule("local-pages", "wrong", "batch", "a chunked-local virtual batch's block table that is not its chunk's blocks",
         _in_serve(f"{CHECKS}:local"), given="metadata"),
    Rule("tree-mask", "wrong", "batch", "a draft-tree node that sees more or less than the prefix, its ancestors and "
         "itself", _in_serve(f"{CHECKS}:trees"), given="metadata"),
    Rule("positions", "wrong", "batch", "a token whose position is not its mask's (prefix + depth in a draft tree)",
         _in_serve(f"{CHECKS}:trees"), given="metadata"),
    Rule("steps-positions", "wrong", "steps", "a request's steps (chunked prefill, prefix hits) that skip or repeat "
         "positions: not one pass", _in_serve(STEPS), given="request-steps"),
    Rule("steps-pages", "wrong", "steps", "a request's step that reads earlier keys from other pages than they were "
         "written to", _in_serve(STEPS), given="request-steps"),
    Rule("expect", "wrong", "batch", "a request whose mask is not the one --expect names (a note where every one "
         "holds)", _in_serve("maskcli.serve.expect:expect"), given="metadata"),
    Rule("model", "wrong", "batch", "a window or chunk that no layer type of --model's config has (an off-by-one named "
         "as such; suspicious where no request is long enough to show it, a note where it matches)",
         _in_serve("maskcli.serve.model:against_config"), given="metadata"),
)
