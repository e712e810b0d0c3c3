"""transformers Qwen2 (random weights) trained on a packed batch from DataCollatorWithFlattening, SDPA.

Follows huggingface/transformers src/transformers/data/data_collator.py (DataCollatorWithFlattening: concatenates
the examples into one row, returns `position_ids` restarting at 0 for every example, no attention_mask, and
labels with -100 at each example's first token) and src/transformers/masking_utils.py, which recognises the
restarting position_ids as packed sequences when no attention_mask is given.

Mask meant: block-diagonal causal: a token sees earlier tokens of its own example only, never tokens of the
example packed before it. `use_cache=False` as in training.
"""
import torch
from transformers import AutoModelForCausalLM, DataCollatorWithFlattening, Qwen2Config


def main():
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, use_cache=False,
    )
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    model.train()

    examples = [
        {"input_ids": [5, 6, 7, 8, 9]},
        {"input_ids": [15, 16, 17]},
        {"input_ids": [25, 26, 27, 28, 29, 30, 31]},
    ]
    collator = DataCollatorWithFlattening(return_tensors="pt")
    batch = collator(examples)
    assert "attention_mask" not in batch
    assert batch["position_ids"].tolist() == [[0, 1, 2, 3, 4, 0, 1, 2, 0, 1, 2, 3, 4, 5, 6]]

    out = model(**batch, use_cache=False)
    out.loss.backward()

    # the packed forward must equal running each example on its own
    with torch.no_grad():
        alone = torch.cat([model(input_ids=torch.tensor([e["input_ids"]])).logits[0] for e in examples])
    assert torch.allclose(out.logits[0].detach(), alone, atol=1e-4)
    print(f"packed loss {out.loss.item():.4f} over {batch['input_ids'].shape[1]} tokens")


if __name__ == "__main__":
    main()
