"""What serve is told a batch's masks should be: --expect PATTERN=EXPR, and --model's layer types.

--expect: each matching request's mask compared with EXPR at its positions. PATTERN is a shell pattern over a
request's names: its index in the batch, and its request id where the batch has request_ids ("*" is every
request). The expression is built on the request's own frame (queries at seq_len - new .. seq_len - 1, keys
0 .. seq_len - 1) and compared by key intervals, O(queries) per request.

--model: a batch is one layer's call. Its window (W keys including the query's own, however the engine spells it) or
chunk must be one the config gives a layer type (maskcli.hf.layers reads them), or it must have neither where the
config has full-attention layers. Where not, each request is compared with the nearest mask the config allows: wrong
where a request's mask differs (its first cell), suspicious where only the parameter does (no request is long enough
to show it). The masks compared are those the window or chunk makes on each request's positions, so that a draft tree
or a cascade is not taken for a window.

A batch is maskcli.serve.batch.ServeBatch, taken as it comes (this package sits below serve/).
"""

from __future__ import annotations

from fnmatch import fnmatchcase

from maskcli.checks.registry import Rule
from maskcli.errors import MaskError
from maskcli.text import Finding, spans

# how each engine spells HF's sliding_window W (transformers' modeling_flash_attention_utils.py: window_size=(W-1, ...))
SPELLED = {"flash_attn": "window_size=({left}, 0)", "flashinfer": "window_left={left}", "sglang": "sliding_window_size={left}",
           "vllm": "sliding_window={w}", "trtllm": "attention_window_size={w}"}


def names(b, r: int) -> tuple[str, ...]:
    return (str(r),) if b.request_ids is None else (str(r), str(int(b.request_ids[r])))


def expect(b, expectations: list[tuple[str, str]], where: str | None = None) -> list[Finding]:
    """One finding per expectation that does not hold: its first differing request with the first differing cell,
    and how many more differ; a pattern that matches no request is one too. `where`: the batch's name where the
    pattern chose the batch, not its requests (trace --api vllm matches a step by its layers): every request of it is
    compared, and the message says which batch."""
    out = []
    for pattern, expression in expectations:
        head = f"--expect {pattern}={expression}" + (f": {where}" if where is not None else "")
        if where is not None:
            matched = list(range(b.requests))
        else:
            matched = [r for r in range(b.requests) if any(fnmatchcase(name, pattern) for name in names(b, r))]
        if not matched and where is None:
            known = "request indexes 0 to " + str(b.requests - 1) if b.requests else "no requests at all"
            out.append(Finding("expect", f"{head}: no request matches {pattern!r} (the batch has {known})"))
            continue
        found = first_difference(b, matched, expression, head)
        if found is not None:
            out.append(found)
    if expectations and not out:
        count = len(expectations)
        out.append(Finding("expect", f"--expect: every request matched holds ({count} expectation{'s' * (count != 1)})", "note"))
    return out


def first_difference(b, requests: list[int], expression: str, head: str, code: str = "expect",
                     actual: str | None = None) -> Finding | None:
    """The first of `requests` whose mask (or the mask `actual` makes at its positions) is not `expression` at its
    positions, as a finding (severity wrong) that counts the others; None where all hold."""
    differing, first = [], None
    for r in requests:
        if code != "expect" and b.mask(r) is None:
            continue  # a request with no mask is the length rules' finding; only --expect asks for every one
        found = _differs(b, r, expression, head, actual)
        if found is not None:
            differing.append(r)
            first = first or found
    if first is None:
        return None
    more = f"; {len(differing) - 1} more differ: requests {spans(differing[1:])}" if len(differing) > 1 else ""
    return Finding(code, first.message + more, first.severity, request=first.request, cell=first.cell)


def _differs(b, r: int, expression: str, head: str, actual: str | None = None) -> Finding | None:
    from maskcli.diff import compare, row_words
    from maskcli.mask import build

    mask = b.mask(r)
    if mask is not None and actual is not None:
        q_start, q_len, seq_len = b.frame(r)
        mask = build(actual, offset=q_start, length=q_len, kv_len=seq_len)
    if mask is None:
        q_start, q_len, seq_len = b.frame(r)
        if q_len == 0:
            return None  # no queries: nothing to hold
        return Finding("expect", f"{head}: request {r} has {q_len} queries and {seq_len} keys: no mask to compare", request=r)
    q_start, q_len, seq_len = b.frame(r)
    try:
        expected = build(expression, offset=q_start, length=q_len, kv_len=seq_len)
    except MaskError as error:
        return Finding("expect", f"{head}: request {r}: cannot build it there: {error}", request=r)
    difference = compare(mask, expected, first=1)
    if difference.equal:
        return None
    row = difference.rows[0]
    key = min(start for start, _ in row.only_a + row.only_b)
    words = row_words(difference, f"request {r}", expression)[0]
    return Finding("expect", f"{head}: request {r} ({actual or b.expression(r)}) differs: {words}", request=r, cell=(row.query, key))


def against_config(b, masks: dict[str, tuple[str, int | None]], model: str) -> list[Finding]:
    windows = {value: kind for kind, (what, value) in masks.items() if what == "window"}
    chunks = {value: kind for kind, (what, value) in masks.items() if what == "chunk"}
    full = [kind for kind, (what, _) in masks.items() if what == "full"]
    if b.chunk is not None:
        have, options, word = b.chunk, chunks, "attention_chunk_size"
    elif b.window is not None:
        have, options, word = b.window, windows, "sliding_window"
    else:
        have, options, word = None, {}, ""
    if have is None and full:
        return [Finding("model", f"--model {model}: a {', '.join(full)} layer's batch (no window, no chunk)", "note")]
    if have in options:
        return [Finding("model", f"--model {model}: a {options[have]} layer's batch ({word} {have})", "note")]
    if options:
        want = min(options, key=lambda value: (abs(value - have), value))
        expression = f"local({want})" if b.chunk is not None else f"window({want})"
        said = f"the batch's {b.name('window') if b.chunk is None else 'attention_chunk_size'} gives {expression.split('(')[0]}({have}); " \
               f"{model}'s {options[want]} layers have {word} {want}"
        if b.chunk is None and abs(have - want) == 1:
            spelled = SPELLED.get(b.engine, "{w}").format(w=want, left=want - 1)
            said += f": off by one ({'one key more' if have > want else 'one key less'}; HF's sliding_window {want} is {spelled} here)"
    elif have is not None:
        expression = "causal"
        said = f"the batch has a {'chunk' if b.chunk is not None else 'window'} ({have}), and {model} has no such layer: " \
               f"its layers are {', '.join(masks) or 'none that attend'}"
    else:
        layer_kind, (what, want) = next((k, v) for k, v in masks.items()) if masks else ("", ("", None))
        if want is None:
            return [Finding("model", f"--model {model}: no attention layer type to compare the batch with", "note")]
        expression = f"window({want})" if what == "window" else f"local({want})"
        said = f"the batch has no window or chunk, and every attention layer of {model} has one ({layer_kind}: {expression})"
    # the masks the parameters make, whatever else (a draft tree, a cascade) each request's mask holds
    own = f"local({b.chunk})" if b.chunk is not None else f"window({b.window})" if b.window is not None else "causal"
    found = first_difference(b, list(range(b.requests)), expression, "", code="model", actual=own)
    if found is None:  # the parameter differs and no mask here shows it (an engine may also drop a window no request reaches)
        severity = "note" if have is None else "suspicious"
        return [Finding("model", f"--model {model}: {said}; no request here is long enough for "
                        f"the masks to differ{', a longer one will' if have is not None else ''}", severity)]
    return [Finding("model", f"--model {model}: {said}. {found.message.removeprefix(': ')}", request=found.request, cell=found.cell)]


RULES = (
    Rule("expect", "wrong", "batch", "a request whose mask is not the one --expect names (a note where every one "
         "holds)", expect, given="expectations"),
    Rule("model", "wrong", "batch", "a window or chunk that no layer type of --model's config has (an off-by-one named "
         "as such; suspicious where no request is long enough to show it, a note where it matches)",
         against_config, given="layer-masks"),
)
