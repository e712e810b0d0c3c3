"""transformers Doge: under SDPA the "is_causal skip" drops causality because Doge always passes its own mask.

Citation: huggingface/transformers issue #48748 ("`DogeForCausalLM` attends to future tokens with the
default `sdpa` backend ... cached and uncached `generate()` disagree"); fix proposed in PR #48769 and
PR #48770 (descriptions read): pass `allow_is_causal_skip=False` when `DogeModel.forward` builds the mask.
The fixed form is the one shipped in the installed transformers 5.24 `DogeModel.forward`
(`# Always materialize the mask: the dynamic mask is added onto it in prepare_dynamic_mask`).

Bug: `create_causal_mask` returns `None` for SDPA when there is no padding and a fresh prefill, relying
on SDPA's `is_causal=True`. But `DogeAttention.prepare_dynamic_mask` always builds a 4-D additive
mask from `dt_states` and merges the causal constraint only when the incoming mask is not None, and
with a non-None `attn_mask` SDPA never sets `is_causal`. So prefill attention is fully bidirectional.

Fix: `allow_is_causal_skip=False`, so the causal mask is always materialized and merged.

Reproduction: a 2-layer DogeForCausalLM built from `DogeConfig` (random weights, SDPA), prefill of 8
tokens with a cache, then one cached decode token. `python FILE` removes the fix's keyword (the
module-level `create_causal_mask` used by `DogeModel.forward` is wrapped to restore the default
`allow_is_causal_skip=True`), `--fixed` runs the installed fixed code unchanged.
"""
import sys

import torch
from transformers import DogeConfig, DogeForCausalLM
from transformers.models.doge import modeling_doge

FIXED = "--fixed" in sys.argv

if not FIXED:
    _create_causal_mask = modeling_doge.create_causal_mask

    def create_causal_mask(*args, allow_is_causal_skip=True, **kwargs):
        # Pre-fix call site: no allow_is_causal_skip=False, so the library default (True) applies.
        return _create_causal_mask(*args, allow_is_causal_skip=True, **kwargs)

    modeling_doge.create_causal_mask = create_causal_mask


def main():
    torch.manual_seed(0)
    config = DogeConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                        keep_window_size=2048, is_moe=False)
    config._attn_implementation = "sdpa"
    model = DogeForCausalLM(config).eval()
    input_ids = torch.randint(0, 64, (1, 8))
    with torch.no_grad():
        out = model(input_ids=input_ids, use_cache=True)
        nxt = out.logits[:, -1:].argmax(-1)
        step = model(input_ids=nxt, cache=out.cache, use_cache=True)
    print("prefill logits[0,0,:3]", [round(x, 4) for x in out.logits[0, 0, :3].tolist()],
          "decode argmax", step.logits[0, -1].argmax().item())


if __name__ == "__main__":
    main()
