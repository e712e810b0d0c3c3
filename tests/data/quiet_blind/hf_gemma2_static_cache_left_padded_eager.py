"""transformers Gemma 2 (random weights): left-padded batched `generate` into a preallocated StaticCache, eager.

Follows huggingface/transformers src/transformers/models/gemma2/modeling_gemma2.py (layer_types alternating
"sliding_attention" / "full_attention", attn_logit_softcapping, eager_attention_forward adding the mask to the
scores) and the documented static-cache recipe: `generate(..., cache_implementation="static")`, which
preallocates every layer's keys to a fixed length so that each step sees the same shapes.

Mask meant: full-attention layers: causal over the real tokens of each row, never a left-pad position and never
a cache slot not yet written (the static cache is longer than the text); sliding layers: the same, further
limited to the last `sliding_window` (=3) positions. Gemma 2 needs eager here because SDPA cannot apply the
logit soft-capping.
"""
import torch
from transformers import AutoModelForCausalLM, Gemma2Config


def main():
    torch.manual_seed(0)
    config = Gemma2Config(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=64, sliding_window=3, pad_token_id=0,
        bos_token_id=2, eos_token_id=1, attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
    )
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    assert model.config.layer_types[:2] == ["sliding_attention", "full_attention"]

    prompts = [[2, 40, 41, 42, 43, 44], [2, 50, 51], [2, 60, 61, 62]]
    width = max(len(p) for p in prompts)
    input_ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    attention_mask = (input_ids != 0).long()

    with torch.no_grad():
        out = model.generate(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=5,
                             do_sample=False, cache_implementation="static", eos_token_id=None)
    assert out.shape == (3, width + 5)
    print(out[:, width:].tolist())


if __name__ == "__main__":
    main()
