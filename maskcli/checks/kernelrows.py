"""What each attention API makes of a query row that sees no key: 0, NaN, or uniform weights (the fully-masked rule's
words and severity, checks/rows.py; docrows.py says the same of a document's empty rows)."""

from __future__ import annotations


def what_api_does(call) -> str:
    """What the call's API makes of a query row that sees no key."""
    api, details = call.api, call.details
    if api == "softmax" and details.get("sink_column"):  # GPT-OSS: the row's unmasked sink logit takes all its weight
        return "0 output there (the sink logit, left out, takes the softmax's whole weight)"
    if api == "softmax" and details.get("zeroed_after"):  # masked_fill(weights, mask, 0) after it (trace/after.py)
        return "0 output there (the program zeroes those rows' weights after the softmax)"
    if api == "softmax" and details.get("zeroed_output") == "values":  # (weights @ v is 0 there: trace/after.py)
        return "0 output there (the values those rows read are all 0)"
    if api == "softmax" and details.get("zeroed_output"):  # masked_fill(weights @ v, rows, 0) (trace/after.py)
        return "0 output there (the program zeroes those rows' output after the product with the values)"
    if api == "softmax" and details.get("by_hand") not in (None, "exp"):  # silu(scores): trace/pointwise.py
        return f"0 output there ({details['by_hand']} of a fill weighs every key about 0)"
    if api == "softmax" and details.get("fill") == "-inf" and not details.get("nan_rows", True):
        # -inf in these scores, yet no row is -inf only: a row with no key holds a finite low fill too, and the softmax
        # spreads its weight evenly over those keys alone (unsloth#3034's re-inverted mask: finfo.min kept, -inf masked)
        return "uniform weights over the keys its finite fill holds there, none on the -inf ones (both fills mixed)"
    if api == "softmax":
        return ("NaN weights there (softmax of all -inf)" if details.get("fill") == "-inf"
                else "uniform weights over every key there, masked ones included (a finite fill)")
    if api == "sdpa" and details.get("poison"):  # (trace/maskfacts.poison: NaN or +inf in a float attn_mask)
        return (f"NaN output there where the mask adds {details['poison']['value']} to the row, 0 where only -inf or a "
                "low fill masks it (SDPA gives rows with no key 0)")
    if api in ("mha", "sdpa") and details.get("finite_rows") and not details.get("nan_rows"):
        return "uniform weights over the keys its float mask fills with a finite value there, not -inf"
    if api == "mha" and details.get("need_weights"):
        return "NaN there (MHA with need_weights=True runs its own softmax)"
    if api == "mha" and details.get("nested"):
        return "0 output there (the encoder's nested tensor leaves its padded tokens out: they come back 0)"
    if api == "mha" and details.get("path") == "fast":
        return "NaN output there (MHA's fast path, taken in eval mode without grad, gives rows with no key NaN)"
    if api == "flex":
        return "0 output there (FlexAttention gives rows with no key 0)"
    if api == "flash":
        return "0 output there (FlashAttention gives rows with no key 0)"
    if api == "hf":
        used = details.get("hf", {}).get("attn_implementation") or "?"
        if used.startswith(("flash", "flex", "sdpa")):
            return f"0 output there ({used} gives rows with no key 0)"
        if used == "eager":
            return "uniform weights over every key there (HF's eager adds the dtype's lowest value)"
        return f"what there depends on the attention function {used!r}"
    return "0 output there (SDPA gives rows with no key 0)"
