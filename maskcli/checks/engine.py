"""Running the rules that read a run, and putting each finding beside the group of calls it is about."""

from __future__ import annotations

from maskcli.checks.context import Run, cross, masked_somewhere, queries
from maskcli.checks import config
from maskcli.checks.arguments import over_stated_padding
from maskcli.checks.backward import backward_streams
from maskcli.checks.registry import given, severity
from maskcli.checks.lookahead import within
from maskcli.checks.spans import explained

CONFIG = {rule.code for rule in config.RULES}
SAID_BY = {  # a code left out of a group where one of these says the same bug with its source
    "layer-differs": CONFIG,  # the config rule names the layer's type (layers.py would say it again)
    "fully-masked": {"fill-became-inf (wrong)", "padding-on-queries", "document-row-empty",
                     "nan-rows-backward", "mask-fixed-after-call", "bos-masked"},  # the NaN rows, said with the fill
    # that overflowed (dtypes.py); the padded query rows of a padding laid on the query axis (queryaxis.py); a BOS's own
    # row, which sees no key once the mask hides the BOS (bosmasked.py)
    "sees-later": {"padding-on-queries",  # the real rows that see the pads after them: the same padding's axis
                   "mask-sliced-apart"},  # (a held causal mask's window with its rows one token on: the slice said)
    "padding-lost": {"padding-ignored"},
    "positions-vs-keys": {"padding-lost", "padding-ignored", "continued-from-padding"},  # the keys past a query's
    # position are padding it sees, or a right-padded prompt's decode placed after its pads: said with the padding's
    # statement (positioned.py)
    "positions-inside-cache": {"positions-vs-keys"},  # a step numbered inside its cache, where the model call's own
    # positions show the site's earlier steps counted their keys: stale keys left in the cache (mlc-llm#2939)
    "padding-ignored": {"padding-not-permuted", "padding-shares-group"},  # the same keys, said as the mask left unsorted
    # with its tokens (permuted.py), or as the pads given a real sample's group id (padgroup.py)
    "positions-repeated": {"positions-stalled"},  # the same rope ids, said as the packed segment ids they stall on
    "encoder-padding-ignored": {"memory-padding-inverted", "batch-rows-on-queries"},  # the same padded memory keys,
    # said as the inverted mask they are (memturned.py: every padded row sees only the encoder's pads), or as the
    # memory's padding laid on the queries (rowsonqueries.py)
    "mask-of-another-row": {"padding-per-head"},  # one row's padding on another row's heads, said by the keys (heads.py)
    # the same keys, said from the padding mask the model call was handed (arguments.py; not from its input ids, which
    # say the pads without the mask the program held and never passed: both are said then)
    "padding-unused": {"padding-ignored (a mask)", "padding-lost", "encoder-padding-ignored", "batch-rows-on-queries",
                       "mask-of-another-row"},  # (another row's padding, laid on this row's head: headrows.py)
    "documents-leak": {"varlen-leak", "varlen-disagree", "positions-repeated", "padding-ignored"},  # documents given
    # outright (varlen.py); or rope ids stalled at the pad fill over real tokens, counting from 0 over the pads: no
    # packing (repeated.py); or the positions' leading zeros a padding the ids state too (idspositions.py)
    "samples-leak": {"documents-leak", "varlen-leak"},  # numbered samples, said by their position_ids or cu_seqlens first
    "top-left-mask": {"top-left-causal"},  # the is_causal that made the top-left mask (kernels.py)
    "causal-lost": {"loop-sees-later"},  # a prefix run again each step, said with the loop's appended tokens (loopcausal.py)
    "window-differs-at-decode": {"window-lost"},  # a decode step wider than its prefill: said as the window lost
    "window-miscounted": {"prefill-chunks-differ"},  # a prefill chunk's rows, said against the whole pass (prefill.py)
    "window-escaped": {"prefill-chunks-differ"},  # keys past a window a chunk laid from its own start (prefill.py)
    "window-keys-sliced": {"prefill-chunks-differ"},  # a chunk's keys sliced short of its window, said against the
    # whole pass (prefill.py: a ring cache that overflowed hands the chunk its last keys only)
    "chunks-misplaced": {"chunks-misaligned"},  # chunks from column 0 of a left-padded row, said with the config (config.py)
    "causal-config-ignored": {"causal-flag-ignored", "decoder-sees-later"},  # the module's own causal word (own.py, decoders.py)
    "causal-flag-ignored": {"fill-masks-nothing"},  # a causal fill lifted back to a score (tanh, a clamp): said as
    "decoder-mask-not-causal": {"fill-masks-nothing"},  # the fill that masks nothing, not as a causal part never built (weakfill.py)
    "held-mask-ignored": {"padding-per-head", "mask-argument-dropped", "mask-dropped", "mask-of-another-row"},  # the same cells, said by the call's keys or arguments
    "mask-argument-dropped": {"bool-added"},  # a bool mask added to the scores masks nothing, which reads as dropped:
    # said as the add it was (dtypes.py; timm PR #2686's non-fused path)
    "padding-not-per-row": {"padding-unused"},  # the same padding, said where the mask was handed it (held.py)
    "pad-ids-unmasked": {"padding-unmarked"},  # the same pads, said with the pad id the program states (tokens.py)
    "polarity": {"memory-padding-inverted"},  # the memory's padding turned round, said with its encoder's (memturned.py)
    "memory-padding-only-attended": {"padding-only-attended", "lengths-inverted"},  # the same keys, said by the mask or
    # lengths the frames hold (held.py, turned.py)
    "zero-keys-seen": {"unwritten-slot", "padding-ignored", "padding-unused", "padding-lost", "mask-withheld",
                       "batch-axis-attended"},  # zero K/V, said by their cause (a padding the forward was never handed;
    # an nn.MultiheadAttention read along the batch, whose "keys" are the samples: mhazero.py)
    "padding-seen-by-one": {"batch-rows-on-queries"},  # a key row laid on the queries hides some queries' padding and
    # not another's: the same plane, said as the broadcast it was (rowsonqueries.py; keras#21595)
    "real-query-blind": {"mask-fixed-after-call"},  # a row the padding mask, changed after the call, calls real:
    # said as the fix-up that came too late (latefix.py)
}


def findings(run: Run) -> list:
    """(call, Finding) of every rule written in this package that reads calls, sites or steps."""
    attending = {call.where for call in run.calls if masked_somewhere(call) or "documents" in call.details
                 or "additive_pool" in call.details or over_stated_padding(call, run)}
    # (a site that masks once is attention; so is one handed documents, full as its call may be: varlen.py; so is a
    # softmax over the model call's padded tokens: arguments.py; and additive attention, trace/poolweights.attended)
    reweighed = [call for call in run.calls if "over_weights" in call.details]  # (a softmax over an earlier one's
    # weights: no mask handed to it, nor its padding; judged against that softmax's mask alone, weighted.py)
    calls = [call for call in run.calls if call.where in attending and "over_weights" not in call.details]
    crossing = [call for call in calls if cross(call)]  # its queries sit nowhere among its keys: read apart (steps.py)
    unmasked = [call for call in run.calls if call.where not in attending and "over_weights" not in call.details]
    run = Run([call for call in calls if not cross(call)], run.tops, crossing, unmasked, reweighed)
    found = []
    for check in given("run"):  # (one function may make the findings of several codes: called once)
        try:
            found += check(run)
        except Exception as error:
            if not program_raised(error):
                raise
            # (a config or an argument of the program's whose __eq__, __bool__ or property raises when read after
            # the run: python ran it, so the rule reads it as stating nothing, as a config that raises on read)
    return found


def program_raised(error: BaseException) -> bool:
    """The exception was raised by the traced program's own code, run by a rule's read of one of its objects (a
    config's __eq__, __bool__ or property): the innermost frame is neither maskcli's nor an installed library's nor
    the standard library's. An error of maskcli's own is raised in maskcli's frames (or a library's below them)."""
    import os
    import sysconfig

    tb, name = error.__traceback__, None
    while tb is not None:
        name, tb = tb.tb_frame.f_code.co_filename, tb.tb_next
    if name is None or name.startswith("<"):
        return False
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the maskcli package
    libraries = {sysconfig.get_paths()[key] for key in ("stdlib", "platstdlib", "purelib", "platlib")}
    return not any(os.path.abspath(name).startswith(root + os.sep) for root in (here, *libraries))


def apply(groups: list, run: Run) -> list:
    """`groups` (trace's, each with .calls and .findings) with the findings of the rules added to the group of their
    call, each said once per group."""
    where = {call.index: group for group in groups for call in group.calls}
    for call, finding in findings(run):
        group = where.get(call.index)
        if group is not None and all((f.code, f.message) != (finding.code, finding.message) for f in group.findings):
            group.findings.append(finding)
    for group in groups:  # one bug reported once, by the finding that names its cause
        codes = {f.code for f in group.findings}
        if any(f.code == "fill-became-inf" and f.severity is None for f in group.findings):
            codes.add("fill-became-inf (wrong)")
        if any(f.code == "padding-ignored" and not (f.source or "").startswith("input ids") for f in group.findings):
            codes.add("padding-ignored (a mask)")
        gone = {code for code, by in SAID_BY.items() if codes & by}
        if any(severity(f) == "wrong" for f in group.findings if f.code != "prefill-chunks-differ" and f.code not in gone):
            gone.add("prefill-chunks-differ")  # a chunk another rule calls wrong
        if "top-left-causal" in codes and group.calls and all(queries(c, run.top(c))[0] == 0 for c in group.calls):
            gone.add("top-left-causal")  # queries at a static cache's start, its slots past them unwritten: top-left
            # is where they sit (cache.py reads those slots)
        group.findings = [f for f in group.findings if f.code not in gone]
    try:
        judged = explained(run) | backward_streams(run)  # later keys the model call's token types account for
        # (spans.py), or a backward LM's stream's own context (backward.py): not a causal mask's slip
    except Exception as error:
        if not program_raised(error):
            raise
        judged = set()  # (a program's config that raises when read: as in findings)
    for group in groups:
        if group.calls and all(call.index in judged or within(call) for call in group.calls):  # (or within a
            # look-ahead the program states: lookahead.py)
            group.findings = [f for f in group.findings if f.code != "sees-later"]
    return groups
