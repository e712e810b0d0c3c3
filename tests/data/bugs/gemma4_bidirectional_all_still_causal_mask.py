# huggingface/transformers#46077 (fixed by #46079): Gemma4TextConfig(use_bidirectional_attention="all") made the
# attention modules non-causal but never set config.is_causal = False, so the mask helpers still built causal masks.
import sys

import torch
from transformers import Gemma4TextConfig
from transformers.models.gemma4.modeling_gemma4 import Gemma4TextModel

FIXED = "--fixed" in sys.argv


def make_config():
    config = Gemma4TextConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        global_head_dim=16,
        hidden_size_per_layer_input=0,
        vocab_size_per_layer_input=128,
        layer_types=["full_attention", "full_attention"],
        use_bidirectional_attention="all",
        max_position_embeddings=64,
    )
    config._attn_implementation = "sdpa"
    if not FIXED:
        # before #46079 the config class had no `self.is_causal = False` for "all"
        config.__dict__.pop("is_causal", None)
    return config


def main():
    torch.manual_seed(0)
    config = make_config()
    model = Gemma4TextModel(config).eval()
    input_ids = torch.randint(1, 128, (2, 10))
    attention_mask = torch.ones(2, 10, dtype=torch.long)
    attention_mask[1, 7:] = 0  # right-padded embedding batch
    with torch.no_grad():
        out = model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        # changing the last real token must change the first token's embedding if attention is bidirectional
        ids2 = input_ids.clone()
        ids2[0, 9] = (ids2[0, 9] + 1) % 128
        out2 = model(input_ids=ids2, attention_mask=attention_mask).last_hidden_state
    print(f"is_causal={getattr(config, 'is_causal', None)}  first-token change when last token edited: "
          f"{(out[0, 0] - out2[0, 0]).abs().max().item():.3e}")


if __name__ == "__main__":
    main()
