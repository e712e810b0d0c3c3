# TransformerLensOrg/TransformerLens#1610 (merged, "fix(bridge): derive position_ids from attention_mask for
# left-padded input"; written from the PR's review thread, transformer_lens/model_bridge/transformer_bridge.py).
# The TransformerBridge wraps a Hugging Face model and forwards a left-padded batch with its attention_mask but no
# position_ids, so the wrapped model numbers every row 0..T-1 from the first (pad) column: a padded row's real tokens
# read position embeddings shifted by the number of pads. The fix derives position_ids from the attention mask
# (utils.get_offset_position_ids: cumsum - 1, pads clamped to 0) when a masked token precedes a real one.
import sys

import torch
from transformers import GPT2Config, GPT2LMHeadModel

FIXED = "--fixed" in sys.argv


def get_offset_position_ids(past_kv_pos_offset, attention_mask):
    # transformer_lens/utils.py
    shifted_position_ids = attention_mask.cumsum(dim=1) - 1
    position_ids = shifted_position_ids.masked_fill(shifted_position_ids < 0, 0)
    return position_ids[:, past_kv_pos_offset:]


class TransformerBridge:
    def __init__(self, original_model, pad_token_id):
        self.original_model = original_model
        self.pad_token_id = pad_token_id

    def to_tokens(self, prompts, padding_side="left"):
        T = max(len(p) for p in prompts)
        rows, masks = [], []
        for p in prompts:
            pad = [self.pad_token_id] * (T - len(p))
            if padding_side == "left":
                rows.append(pad + p)
                masks.append([0] * len(pad) + [1] * len(p))
            else:
                rows.append(p + pad)
                masks.append([1] * len(p) + [0] * len(pad))
        return torch.tensor(rows), torch.tensor(masks)

    def forward(self, input_ids, attention_mask=None, **kwargs):
        if FIXED:
            if (
                attention_mask is not None
                and "position_ids" not in kwargs
                and attention_mask.shape[1] >= input_ids.shape[1]
            ):
                _derived = get_offset_position_ids(0, attention_mask)
                _arange = torch.arange(attention_mask.shape[1], device=_derived.device)
                if bool(((_derived != _arange) & (attention_mask != 0)).any()):
                    kwargs["position_ids"] = _derived[:, -input_ids.shape[1]:]
        return self.original_model(input_ids=input_ids, attention_mask=attention_mask, **kwargs).logits

    __call__ = forward


def main():
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=4, bos_token_id=1, eos_token_id=1,
                        attn_implementation="eager")
    model = GPT2LMHeadModel(config).eval()
    bridge = TransformerBridge(model, pad_token_id=0)

    prompts = [[5, 9, 12, 7, 3, 22, 41, 17], [8, 30, 11]]
    input_ids, attention_mask = bridge.to_tokens(prompts, padding_side="left")
    with torch.no_grad():
        logits = bridge(input_ids, attention_mask=attention_mask)
    last = logits[:, -1, :]
    print("next tokens:", last.argmax(-1).tolist())
    print("row 1 last logits[:6]:", [round(v, 4) for v in last[1, :6].tolist()])


if __name__ == "__main__":
    main()
