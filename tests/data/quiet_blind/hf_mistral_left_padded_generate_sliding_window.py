"""transformers Mistral (random weights) batched greedy `generate` with left padding and a sliding window.

Follows huggingface/transformers src/transformers/models/mistral/modeling_mistral.py and
src/transformers/generation/utils.py as users call them: a MistralConfig with `sliding_window`, a tokenizer-style
left-padded batch with its `attention_mask`, `model.generate(input_ids, attention_mask=...)` with the default
(dynamic) cache and `attn_implementation="sdpa"`.

Mask meant: for every layer, token i of a row sees keys j with j <= i, i - j < sliding_window (=4) and j not a
left-pad position of that row; at each decoding step the single new query sees the last 4 real cache entries of
its row. Positions are counted from the first real token of each row (generate derives position_ids from the
attention_mask cumsum).
"""
import torch
from transformers import AutoModelForCausalLM, MistralConfig, MistralForCausalLM


def main():
    torch.manual_seed(0)
    config = MistralConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, sliding_window=4, pad_token_id=0, bos_token_id=1,
        eos_token_id=2,
    )
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    assert isinstance(model, MistralForCausalLM)

    prompts = [[1, 17, 23, 45, 9, 88, 31], [1, 54, 12], [1, 99, 7, 64, 5]]
    width = max(len(p) for p in prompts)
    input_ids = torch.tensor([[config.pad_token_id] * (width - len(p)) + p for p in prompts])
    attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])

    with torch.no_grad():
        out = model.generate(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=6,
                             do_sample=False, eos_token_id=None)
    assert out.shape == (3, width + 6)
    print(out[:, width:].tolist())


if __name__ == "__main__":
    main()
