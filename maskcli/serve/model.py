"""--model: the batch's window or chunk against the layer types a model's config has (maskcli.hf.layers reads them).

A batch is one layer's call. Its window (W keys including the query's own, however the engine spells it) or
chunk must be one the config gives a layer type, or it must have neither where the config has full-attention
layers. Where not, each request is compared with the nearest mask the config allows: wrong where a request's
mask differs (its first cell), suspicious where only the parameter does (no request is long enough to show it).
The masks compared are those the window or chunk makes on each request's positions, so that a draft tree or a
cascade is not taken for a window.
"""

from __future__ import annotations

from maskcli.serve.batch import ServeBatch
from maskcli.serve.checks import Finding
from maskcli.serve.expect import first_difference

# how each engine spells HF's sliding_window W (transformers' modeling_flash_attention_utils.py: window_size=(W-1, ...))
SPELLED = {"flash_attn": "window_size=({left}, 0)", "flashinfer": "window_left={left}", "sglang": "sliding_window_size={left}",
           "vllm": "sliding_window={w}", "trtllm": "attention_window_size={w}"}


def against_config(b: ServeBatch, masks: dict[str, tuple[str, int | None]], model: str) -> list[Finding]:
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
